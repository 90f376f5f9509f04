"""Reading what reached the broker, without a consumer group (groups take ~5 s to join)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord


def outbox_id(record: ConsumerRecord[bytes, bytes]) -> int:
    return int(dict(record.headers)["outbox-id"])


async def consume_ids(
    bootstrap: str, topic: str, ids: Iterable[int], *, timeout: float = 30.0
) -> list[ConsumerRecord[bytes, bytes]]:
    """Read until every one of ``ids`` was seen (duplicates included in the result)."""
    want = set(ids)
    return await consume(
        bootstrap,
        topic,
        count=len(want),
        timeout=timeout,
        done=lambda recs: want <= {outbox_id(r) for r in recs},
    )


async def consume(
    bootstrap: str,
    topic: str,
    *,
    count: int,
    timeout: float = 20.0,
    done: Callable[[list[ConsumerRecord[bytes, bytes]]], bool] | None = None,
) -> list[ConsumerRecord[bytes, bytes]]:
    """Read ``topic`` from the beginning until ``count`` records arrived (or ``done`` says so,
    or the deadline passes)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout
        partitions: set[int] | None = None
        while not partitions:
            partitions = consumer.partitions_for_topic(topic)
            if not partitions:
                await consumer.topics()  # refresh metadata
                if time.monotonic() > deadline:
                    return []
                await asyncio.sleep(0.05)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[ConsumerRecord[bytes, bytes]] = []
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200, max_records=10_000)
            for records in batch.values():
                out.extend(records)
            if done is None and len(out) >= count:
                break
            # With a predicate, also drain what is already there (redeliveries included).
            if done is not None and not batch and done(out):
                break
        return out
    finally:
        await consumer.stop()
