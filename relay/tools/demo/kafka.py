"""The demo's first use: events relayed to a Kafka topic, read back from it."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import KafkaError

from relay.tools.demo.errors import DemoError
from relay.tools.demo.orders import EVENT_TYPE, RUN_HEADER, Placed


@dataclass(frozen=True)
class Message:
    outbox_id: int
    key: str
    value: str


def destination(topic: str) -> dict[str, Any]:
    return {"kind": "kafka", "topic": topic}


async def check_broker(bootstrap: str) -> None:
    """Fail now, saying so, if no broker answers at ``bootstrap``: before anything is set up,
    rather than after the relay waited for it."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    # aiokafka logs each refused connection as an error: the one line below says it all.
    quiet = logging.getLogger("aiokafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        await client.bootstrap()
    except (KafkaError, OSError) as exc:
        raise DemoError(
            f"no Kafka broker answers at {bootstrap} ({exc}): start one there, or leave out "
            "--bootstrap for a local one"
        ) from exc
    finally:
        quiet.setLevel(level)
        await client.close()


async def read_topic(
    bootstrap: str, topic: str, want: int, timeout: float, run: str
) -> list[Message]:
    """The messages of demo run ``run`` on the topic, read from its beginning without a
    consumer group (which would take seconds to join), until ``want`` arrived or ``timeout``.
    Other messages (an earlier run's, on a broker of one's own) are passed over."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    seen: list[Message] = []
    try:
        await consumer.start()
        deadline = time.monotonic() + timeout
        parts = consumer.partitions_for_topic(topic)
        while not parts and time.monotonic() < deadline:
            await consumer.topics()
            parts = consumer.partitions_for_topic(topic)
            await asyncio.sleep(0.05)
        if not parts:  # nothing was ever written to it
            return []
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        while len(seen) < want and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for r in records:
                    h = dict(r.headers)
                    if h.get(RUN_HEADER) != run.encode():
                        continue
                    seen.append(
                        Message(int(h["outbox-id"]), (r.key or b"").decode(), r.value.decode())
                    )
    finally:
        await consumer.stop()
    return sorted(seen, key=lambda m: m.outbox_id)


def report(seen: list[Message], placed: Placed, topic: str) -> tuple[list[str], bool]:
    """What the topic holds, and whether it is what was committed, each event once."""
    ok = sorted(m.outbox_id for m in seen) == sorted(placed.kafka)
    lines = [
        f"kafka: {len(seen)}/{len(placed.kafka)} events on topic {topic!r} ({EVENT_TYPE}); "
        f"the rolled-back order's never written ({'OK' if ok else 'MISMATCH'})"
    ]
    if seen:
        first = seen[0]
        lines.append(f"  e.g. outbox-id={first.outbox_id} key={first.key} value={first.value}")
    return lines, ok
