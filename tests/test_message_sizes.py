"""The largest event enqueue accepts is one the relay delivers with Kafka's defaults, and the
relay refuses exactly the messages its producer would refuse."""

from __future__ import annotations

import time
import uuid

import asyncpg
import pytest
from aiokafka.record.default_records import DefaultRecordBatchBuilder

import outbox
from outbox.dburl import to_asyncpg_dsn
from outbox.message import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_CONTENT_TYPE_BYTES,
    MAX_HEADERS,
    MAX_HEADERS_BYTES,
    MAX_KEY_BYTES,
)
from relay.model import Envelope, Lease
from relay.sinks.kafka.config import KafkaDestination, KafkaSettings
from relay.sinks.kafka.sink import KafkaSink
from tests.support.kafka import consume, outbox_id
from tests.support.relays import running, settings, status_counts, wait_until


def biggest_event() -> dict[str, object]:
    """The largest event enqueue accepts, by the producer's measure: the most headers, each
    long enough that its lengths take two bytes, filling the header budget exactly."""
    names = [f"h{i:02d}" for i in range(MAX_HEADERS)]
    room = MAX_HEADERS_BYTES - sum(len(n) for n in names)
    sizes = [room // MAX_HEADERS + (1 if i < room % MAX_HEADERS else 0) for i in range(MAX_HEADERS)]
    headers = {n: "x" * k for n, k in zip(names, sizes, strict=True)}
    assert sum(len(k) + len(v) for k, v in headers.items()) == MAX_HEADERS_BYTES
    content_type = "application/x-" + "z" * (MAX_CONTENT_TYPE_BYTES - 14)
    assert len(content_type) == MAX_CONTENT_TYPE_BYTES
    return {
        "destination": "orders",
        "key": "k" * MAX_KEY_BYTES,
        "headers": headers,
        "content_type": content_type,
        "payload": b"p" * DEFAULT_MAX_PAYLOAD_BYTES,
    }


def test_the_largest_event_fits_kafkas_default_with_the_documented_room() -> None:
    event = biggest_event()
    headers = [(k, str(v).encode()) for k, v in event["headers"].items()]  # type: ignore[attr-defined]
    headers += [("outbox-id", b"9" * 19), ("content-type", str(event["content_type"]).encode())]
    size = DefaultRecordBatchBuilder.estimate_size_in_bytes(
        str(event["key"]).encode(), event["payload"], headers
    )
    assert 1_017_000 < size < 1_019_000  # "about 1,018,100" in outbox/message.py and the docs
    assert 1024 * 1024 - size > 30_000


async def test_the_largest_event_enqueue_accepts_is_delivered_with_kafka_defaults(
    db_url: str, kafka_bootstrap: str
) -> None:
    event = biggest_event()
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            row = await outbox.enqueue(conn, **event)  # type: ignore[arg-type]
        # One byte more of any part is refused, at enqueue.
        for field, bigger in (
            ("payload", b"p" * (DEFAULT_MAX_PAYLOAD_BYTES + 1)),
            ("key", "k" * (MAX_KEY_BYTES + 1)),
            ("headers", {**event["headers"], "h99": "x" * 200}),  # type: ignore[dict-item]
            ("headers", {**event["headers"], "extra": ""}),  # type: ignore[dict-item]
            ("content_type", str(event["content_type"]) + "z"),
        ):
            async with conn.transaction():
                with pytest.raises(outbox.OutboxValidationError) as err:
                    await outbox.enqueue(conn, **{**event, field: bigger})  # type: ignore[arg-type]
                assert err.value.field == field
    finally:
        await conn.close()
    topic = f"big-{uuid.uuid4().hex[:8]}"
    s = settings(db_url, kafka_bootstrap, topic=topic)  # the producer's default size limit
    assert s.kafka.max_request_size == 1024 * 1024
    async with running(s):
        await wait_until(
            lambda: _status(db_url, {"delivered": 1}), timeout=30, what="the event delivered"
        )
    (got,) = await consume(kafka_bootstrap, topic, count=1)
    assert outbox_id(got) == row and got.value == event["payload"]


async def _status(db_url: str, want: dict[str, int]) -> bool:
    return await status_counts(db_url) == want


def _size(row_id: int, payload_len: int, sink: KafkaSink) -> int:
    env = Envelope(
        row_id,
        "orders",
        None,
        b"",
        "application/octet-stream",
        {},
        0,
        time.time(),
        1,
        Lease(0.0),
    )
    return int(
        DefaultRecordBatchBuilder.estimate_size_in_bytes(
            None, b"x" * payload_len, sink._headers(env)
        )
    )


async def test_the_relay_refuses_exactly_what_the_producer_refuses(
    db_url: str, kafka_bootstrap: str
) -> None:
    limit = 4096
    topic = f"edge-{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            fits, over = await outbox.enqueue_many(
                conn, [{"destination": "orders", "payload": b""} for _ in range(2)]
            )
        probe = KafkaSink(
            KafkaSettings(bootstrap_servers=kafka_bootstrap),
            {"orders": KafkaDestination(kind="kafka", topic=topic)},
        )
        # The largest payload that fits, for the one; the smallest that does not, for the other.
        n = max(i for i in range(limit) if _size(fits, i, probe) <= limit)
        m = min(i for i in range(limit) if _size(over, i, probe) > limit)
        assert _size(fits, n, probe) == limit or _size(fits, n + 1, probe) > limit
        await conn.execute("UPDATE outbox SET payload = $2 WHERE id = $1", fits, b"x" * n)
        await conn.execute("UPDATE outbox SET payload = $2 WHERE id = $1", over, b"x" * m)
    finally:
        await conn.close()
    s = settings(db_url, kafka_bootstrap, topic=topic, kafka={"max_request_size": limit})
    async with running(s):
        await wait_until(
            lambda: _status(db_url, {"delivered": 1, "failed": 1}), timeout=30, what="settled"
        )
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        failed = await conn.fetchrow(
            "SELECT id, attempts, last_error FROM outbox WHERE status = 'failed'"
        )
    finally:
        await conn.close()
    assert failed is not None and failed["id"] == over and failed["attempts"] == 1
    assert f"above kafka.max_request_size ({limit})" in failed["last_error"]
    (got,) = await consume(kafka_bootstrap, topic, count=1)
    assert outbox_id(got) == fits and len(got.value or b"") == n
