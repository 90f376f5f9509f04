"""Reading what reached the broker, without a consumer group (groups take ~5 s to join)."""

from __future__ import annotations

import asyncio
import time

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord


async def consume(
    bootstrap: str, topic: str, *, count: int, timeout: float = 20.0
) -> list[ConsumerRecord[bytes, bytes]]:
    """Read ``topic`` from the beginning until ``count`` records arrived (or the deadline)."""
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
        while len(out) < count and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200, max_records=10_000)
            for records in batch.values():
                out.extend(records)
        return out
    finally:
        await consumer.stop()
