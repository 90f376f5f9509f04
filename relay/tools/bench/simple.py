"""The simple batched loop the relay must beat: claim 100 rows, send them, await the acks,
mark them delivered; four such loops in one process, each on its own connection.

It is what a team writes in an afternoon, and it is fast because it does nothing else: no
leases renewed, no fencing tokens, no retries or backoff, no per-destination rotation, no
metrics. ``bench drain --compare-simple`` runs it in the same session as the relay so that
the ratio, not a figure from another day, says whether the relay's guarantees cost speed.
To Kafka it sends with aiokafka directly (the row id as a header, as the relay does); to the
other sinks through the benchmark's own sink.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer

from outbox.dburl import to_asyncpg_dsn
from outbox.sql import load
from relay.model import Envelope, Lease
from relay.sinks.kafka.partitioner import Partitioner
from relay.tools.bench.common import DESTINATION, Target, machine_cpu, per_event_us, prefill

# Kept beside this module in simple.sql, not in relay/db/queries/: the product never runs them.
_q = load("relay.tools.bench", "simple.sql", binds="numbered")

SIMPLE_CLAIM = _q["simple_claim"]
SIMPLE_DONE = _q["simple_done"]


async def simple(
    db_url: str,
    target: Target,
    *,
    events: int,
    payload: int,
    keys: int,
    loops: int = 4,
    batch: int = 100,
    max_seconds: float,
) -> dict[str, Any]:
    await prefill(db_url, events, payload, keys)
    dsn = to_asyncpg_dsn(db_url)
    conns = [await asyncpg.connect(dsn) for _ in range(loops)]
    send = await _sender(target)
    done = 0
    deadline = time.monotonic() + max_seconds

    async def one_loop(conn: asyncpg.Connection) -> None:
        nonlocal done
        claim = await conn.prepare(SIMPLE_CLAIM)
        while time.monotonic() < deadline:
            rows = await claim.fetch(DESTINATION, batch)
            if not rows:
                return
            await send.deliver(rows)
            await conn.execute(SIMPLE_DONE, [r[0] for r in rows])
            done += len(rows)

    cpu0, machine0 = time.process_time(), machine_cpu()
    started = time.monotonic()
    try:
        await asyncio.gather(*(one_loop(c) for c in conns))
        elapsed = time.monotonic() - started
        cpu = time.process_time() - cpu0
        machine1 = machine_cpu()
    finally:
        await send.close()
        for c in conns:
            await c.close()
    return {
        "events": done,
        "loops": loops,
        "batch_size": batch,
        "seconds": round(elapsed, 3),
        "events_per_s": round(done / elapsed, 1),
        "cpu_per_event_us": round(cpu / max(done, 1) * 1e6, 1),
        "others_cpu_per_event_us": (
            None
            if machine0 is None or machine1 is None
            else per_event_us(max(machine1 - machine0 - cpu, 0.0), done)
        ),
    }


class _Sender:
    async def deliver(self, rows: list[asyncpg.Record]) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        return None


class _KafkaSender(_Sender):
    def __init__(self, producer: AIOKafkaProducer, topic: str) -> None:
        self.producer = producer
        self.topic = topic

    async def deliver(self, rows: list[asyncpg.Record]) -> None:
        futures = [
            await self.producer.send(
                self.topic,
                value=r[2],
                key=r[1].encode() if r[1] is not None else None,
                headers=[("outbox-id", str(r[0]).encode())],
            )
            for r in rows
        ]
        await asyncio.gather(*futures)

    async def close(self) -> None:
        await self.producer.stop()


class _SinkSender(_Sender):
    def __init__(self, target: Target) -> None:
        self.sink = target.make_sink()

    async def deliver(self, rows: list[asyncpg.Record]) -> None:
        lease, now = Lease(float("inf")), time.time()
        envs = [Envelope(r[0], DESTINATION, r[1], r[2], r[3], {}, 0, now, 1, lease) for r in rows]
        await self.sink.deliver(envs)

    async def close(self) -> None:
        await self.sink.close()


async def _sender(target: Target) -> _Sender:
    if target.kind != "kafka":
        sender = _SinkSender(target)
        await sender.sink.start()
        return sender
    assert target.bootstrap
    topic = f"bench-simple-{time.monotonic_ns() % 10**8}"
    target.topics.append(topic)
    # The relay's compiled partitioner, so that the comparison is of the loops, not of hashes.
    producer = AIOKafkaProducer(
        bootstrap_servers=target.bootstrap,
        acks="all",
        enable_idempotence=target.idempotent,
        partitioner=Partitioner(),
    )
    await producer.start()
    return _KafkaSender(producer, topic)
