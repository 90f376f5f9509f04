"""``drain``: prefill N events, then time relays emptying the table; optionally the naive loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import asyncpg

from outbox.dburl import to_asyncpg_dsn
from outbox.sql import load
from relay.app import Relay
from relay.model import Envelope, Lease
from relay.settings import load_settings
from relay.tools.bench.common import (
    DESTINATION,
    HeldSnapshot,
    Target,
    held_snapshot,
    machine_cpu,
    per_event_us,
    percentile,
    prefill,
    rss_mb,
    table_stats,
)

# The seed article's loop, one row per round: claim and mark running, commit, deliver, mark
# done. Kept beside this module in drain.sql (not in outbox.queries) because the product never
# runs it.
_q = load("relay.tools.bench", "drain.sql", binds="numbered")

NAIVE_PICK = _q["naive_pick"]
NAIVE_RUNNING = _q["naive_running"]
NAIVE_DONE = _q["naive_done"]
TRUNCATE_OUTBOX = _q["truncate_outbox"]


def relay_settings(
    db_url: str,
    batch_size: int,
    max_in_flight: int | None,
    ordering: str = "none",
    retention: float | None = None,
    claims: str = "auto",
) -> Any:
    # The benchmark's relay is its own: the shell's OUTBOX_* variables name another outbox.
    return load_settings(
        None,
        environment=False,
        database_url=db_url,
        log_level="warning",
        relay={
            "batch_size": batch_size,
            "max_in_flight": max_in_flight or batch_size * 4,
            "poll_interval": 0.5,
            **({} if retention is None else {"retention": retention}),
            "claims": claims,
        },
        # Placeholders: the benchmark passes its sinks in directly.
        destinations={DESTINATION: {"kind": "kafka", "topic": "unused", "ordering": ordering}},
        # No metrics listener: a benchmark must not take the port of a relay on this host.
        http={"enabled": False},
    )


async def drain(
    db_url: str,
    target: Target,
    *,
    events: int,
    payload: int,
    keys: int,
    batch_size: int,
    relays: int,
    max_in_flight: int | None,
    max_seconds: float,
    ordering: str = "none",
    retention: float | None = None,
    hold_snapshot: bool = False,
    claims: str = "auto",
) -> dict[str, Any]:
    await prefill(db_url, events, payload, keys)
    held: HeldSnapshot | None = None
    async with contextlib.AsyncExitStack() as stack:
        if hold_snapshot:
            # After the prefill (and its VACUUM), before the relay claims anything: the
            # claims' and the outcomes' updates leave versions no vacuum may remove.
            held = await stack.enter_async_context(held_snapshot(db_url))
        settings = relay_settings(db_url, batch_size, max_in_flight, ordering, retention, claims)
        run = await _drain(settings, target, events, relays, max_seconds)
        result: dict[str, Any] = {
            "events": events,
            "delivered": run.delivered,
            "complete": run.delivered == events,
            "relays": relays,
            "ordering": ordering,
            "claims": claims,
            "keys": keys,
            "batch_size": batch_size,
            "payload_bytes": payload,
            **run.figures(),
        }
        if target.kind == "webhook":
            result.update(
                _webhook_figures(target.latencies, run.receiver_cpu, run.delivered, run.elapsed)
            )
        result["hold_snapshot"] = hold_snapshot
        result.update(await table_stats(db_url, result["delivered"]))
    if held is not None:
        result.update(held.figures())
    return result


@dataclass
class _Drained:
    """What the relays of one drain did, and what it cost."""

    delivered: int
    statements: int  # of the hot path: claims, records, activations
    elapsed: float
    cpu: float  # this process's
    machine: tuple[float | None, float | None]  # the host's CPU seconds, before and after
    receiver_cpu: float | None

    def figures(self) -> dict[str, Any]:
        delivered, statements = self.delivered, self.statements
        return {
            "seconds": round(self.elapsed, 3),
            "events_per_s": round(delivered / self.elapsed, 1),
            "hot_path_statements": statements,
            "statements_per_event": round(statements / max(delivered, 1), 4),
            "relay_cpu_per_event_us": round(self.cpu / max(delivered, 1) * 1e6, 1),
            # Everything else on the host in the same time: the database, the broker or
            # receiver.
            "others_cpu_per_event_us": _others(*self.machine, self.cpu, delivered),
            "max_rss_mb": round(rss_mb(), 1),
        }


async def _drain(
    settings: Any, target: Target, events: int, relays: int, max_seconds: float
) -> _Drained:
    running = [Relay(settings, sinks={DESTINATION: target.make_sink()}) for _ in range(relays)]
    target.latencies.clear()
    receiver0 = target.receiver_cpu() if target.receiver_cpu else None
    cpu0, machine0 = time.process_time(), machine_cpu()
    started = time.monotonic()
    tasks = [asyncio.create_task(r.run()) for r in running]
    try:
        deadline = started + max_seconds
        while sum(r.stats["delivered"] for r in running) < events:
            if time.monotonic() > deadline or any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.005)
        elapsed = time.monotonic() - started
        cpu = time.process_time() - cpu0
        machine1 = machine_cpu()
        receiver_cpu = None
        if target.receiver_cpu is not None and receiver0 is not None:
            receiver_cpu = target.receiver_cpu() - receiver0
    finally:
        for r in running:
            r.stop()
        await asyncio.gather(*tasks)
    delivered = sum(r.stats["delivered"] for r in running)
    statements = sum(
        sum(r.store.statements[k] for k in ("claim", "record", "activate")) for r in running
    )
    return _Drained(delivered, statements, elapsed, cpu, (machine0, machine1), receiver_cpu)


def _others(before: float | None, after: float | None, relay: float, events: int) -> float | None:
    if before is None or after is None:
        return None
    return per_event_us(max(after - before - relay, 0.0), events)


def _webhook_figures(
    latencies: list[float], receiver_cpu: float | None, delivered: int, elapsed: float
) -> dict[str, Any]:
    """Where a webhook drain's time goes: requests, their latency, the receiver's CPU."""
    figures: dict[str, Any] = {"requests_per_s": round(len(latencies) / elapsed, 1)}
    if latencies:
        figures["request_p50_ms"] = round(percentile(latencies, 50), 2)
        figures["request_p99_ms"] = round(percentile(latencies, 99), 2)
    if receiver_cpu is not None:
        figures["receiver_cpu_per_event_us"] = round(receiver_cpu / max(delivered, 1) * 1e6, 1)
    return figures


async def naive(
    db_url: str, target: Target, *, events: int, payload: int, keys: int, max_seconds: float
) -> dict[str, Any]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    await conn.execute(TRUNCATE_OUTBOX)
    await prefill(db_url, events, payload, keys)
    sink = target.make_sink()
    await sink.start()
    done = 0
    started = time.monotonic()
    try:
        while done < events and time.monotonic() - started < max_seconds:
            async with conn.transaction():
                row = await conn.fetchrow(NAIVE_PICK)
                if row is None:
                    break
                await conn.execute(NAIVE_RUNNING, row[0])
            lease = Lease(float("inf"))  # the naive loop holds its row lock instead
            env = Envelope(
                row[0], row[1], row[2], row[3], row[4], {}, row[5], row[6].timestamp(), 0, lease
            )
            await sink.deliver([env])
            await conn.execute(NAIVE_DONE, row[0])
            done += 1
        elapsed = time.monotonic() - started
    finally:
        await sink.close()
        await conn.close()
    return {
        "events": done,
        "seconds": round(elapsed, 3),
        "events_per_s": round(done / elapsed, 1),
        "round_trips_per_event": 5,  # BEGIN, SELECT … FOR UPDATE, UPDATE, COMMIT, UPDATE
    }
