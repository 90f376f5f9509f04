"""CloudEvents over Kafka, end to end: rows in a real database, the relay in-process, the
Tansu broker; every message read back with the official CloudEvents SDK (its Kafka binding,
both the 1.x API kept as ``cloudevents.v1`` and the 2.x ``cloudevents.core`` bindings) and
each attribute checked against the row."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

import asyncpg
import pytest
from aiokafka.structs import ConsumerRecord
from cloudevents.core.bindings import kafka as core_kafka
from cloudevents.core.formats.json import JSONFormat
from cloudevents.v1 import kafka as ce_kafka

import outbox
from outbox.dburl import to_asyncpg_dsn
from tests.support.kafka import consume, outbox_id
from tests.support.relays import running, settings, wait_until

SOURCE = "https://shop.example/orders"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
BINARY = bytes(range(256))


async def enqueue(db_url: str, events: list[dict[str, Any]]) -> list[int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            return await outbox.enqueue_many(conn, events)
    finally:
        await conn.close()


async def rows(db_url: str) -> dict[int, asyncpg.Record]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        return {r["id"]: r for r in await conn.fetch("SELECT * FROM outbox")}
    finally:
        await conn.close()


async def ended(db_url: str, ids: list[int]) -> bool:
    got = await rows(db_url)
    return all(got[i]["status"] in ("delivered", "failed") for i in ids)


async def relay_to_kafka(
    db_url: str,
    bootstrap: str,
    events: list[dict[str, Any]],
    kafka: dict[str, Any] | None = None,
    **envelope: Any,
) -> tuple[list[int], dict[int, asyncpg.Record], dict[int, ConsumerRecord[bytes, bytes]]]:
    """Enqueue ``events`` for a CloudEvents destination, run the relay until each row has
    ended, and read the topic: (ids, rows, the message of each delivered id)."""
    topic = f"ce-{uuid.uuid4().hex[:8]}"
    dest = {"kind": "kafka", "topic": topic, "envelope": "cloudevents", "source": SOURCE}
    s = settings(
        db_url, bootstrap, destinations={"orders": {**dest, **envelope}}, kafka=kafka or {}
    )
    ids = await enqueue(db_url, [{"destination": "orders", **e} for e in events])
    async with running(s):
        await wait_until(lambda: ended(db_url, ids), what="every row delivered or failed")
    got = await rows(db_url)
    delivered = [i for i in ids if got[i]["status"] == "delivered"]
    records = await consume(
        bootstrap,
        topic,
        count=len(delivered),
        done=lambda recs: set(delivered) <= {outbox_id(r) for r in recs},
    )
    by_id = {outbox_id(r): r for r in records}
    assert set(by_id) == set(delivered)  # and nothing else reached the topic
    for r in records:
        names = [k for k, _ in r.headers]
        assert len(names) == len(set(names)), f"a header twice: {names}"
    return ids, got, by_id


def message(record: ConsumerRecord[bytes, bytes]) -> ce_kafka.KafkaMessage:
    assert record.value is not None
    return ce_kafka.KafkaMessage(dict(record.headers), record.key, record.value)


def core_message(record: ConsumerRecord[bytes, bytes]) -> core_kafka.KafkaMessage:
    assert record.value is not None
    return core_kafka.KafkaMessage(dict(record.headers), record.key, record.value)


def created(row: asyncpg.Record) -> datetime:
    t: datetime = row["created_at"]
    return t


async def test_binary_mode_attributes_are_headers_and_the_payload_is_the_value(
    db_url: str, kafka_bootstrap: str
) -> None:
    ids, got, by_id = await relay_to_kafka(
        db_url,
        kafka_bootstrap,
        [
            {
                "payload": {"order": 1, "total": "9.90"},
                "key": "order-1",
                "event_type": "com.shop.order.created",
                # traceparent stays; a row's ce_type cannot override the event's type; other
                # ce_ headers are extension attributes.
                "headers": {"traceparent": TRACEPARENT, "ce_type": "spoofed", "ce_channel": "web"},
            },
            {
                "payload": BINARY,
                "content_type": "application/octet-stream",
                "event_type": "com.shop.order.exported",
            },
            {"payload": {"order": 3}, "key": "order-3"},  # no event_type, no default_type
        ],
    )
    created_id, exported_id, untyped_id = ids
    assert got[created_id]["status"] == got[exported_id]["status"] == "delivered"

    # The row without a type is failed with the reason, at once, and never sent.
    untyped = got[untyped_id]
    assert untyped["status"] == "failed" and untyped["attempts"] == 1
    assert f"row {untyped_id} has no event_type" in untyped["last_error"]
    assert "default_type" in untyped["last_error"]

    for i, type_, key, content_type in (
        (created_id, "com.shop.order.created", b"order-1", "application/json"),
        (exported_id, "com.shop.order.exported", None, "application/octet-stream"),
    ):
        record = by_id[i]
        headers = dict(record.headers)
        assert record.key == key
        assert headers["outbox-id"] == str(i).encode()
        assert headers["content-type"] == content_type.encode()
        assert headers["ce_specversion"] == b"1.0"
        assert record.value == got[i]["payload"]  # the payload as it is

        event = ce_kafka.from_binary(message(record), data_unmarshaller=lambda b: b)
        assert event["id"] == str(i)
        assert event["source"] == SOURCE
        assert event["type"] == type_
        assert event["specversion"] == "1.0"
        assert datetime.fromisoformat(event["time"]) == created(got[i])
        assert event["time"].endswith("Z")
        assert event["datacontenttype"] == content_type
        assert event.get_data() == got[i]["payload"]
        assert event.get("partitionkey") == key

        core = core_kafka.from_binary(core_message(record), JSONFormat())
        assert (core.get_id(), core.get_source(), core.get_type()) == (str(i), SOURCE, type_)
        assert core.get_specversion() == "1.0"
        assert core.get_time() == created(got[i])
        assert core.get_datacontenttype() == content_type

    created_headers = dict(by_id[created_id].headers)
    assert created_headers["traceparent"] == TRACEPARENT.encode()
    assert created_headers["ce_channel"] == b"web"
    core = core_kafka.from_binary(core_message(by_id[created_id]), JSONFormat())
    assert core.get_data() == {"order": 1, "total": "9.90"}
    assert core.get_extension("channel") == "web"
    assert core_kafka.from_binary(core_message(by_id[exported_id]), JSONFormat()).get_data() == (
        BINARY
    )


@pytest.mark.parametrize("ordering", ["none", "key"])  # the ordered claim returns the type too
async def test_structured_mode_value_is_the_json_cloudevent(
    db_url: str, kafka_bootstrap: str, ordering: str
) -> None:
    ids, got, by_id = await relay_to_kafka(
        db_url,
        kafka_bootstrap,
        [
            {
                "payload": {"order": 1, "lines": [{"sku": "a", "qty": 2}]},
                "key": "order-1",
                "event_type": "com.shop.order.created",
                # In structured mode no ce_ header is sent: readers would take it as binary.
                "headers": {"traceparent": TRACEPARENT, "ce_type": "spoofed"},
            },
            {"payload": BINARY, "content_type": "application/octet-stream"},  # default_type
            {"payload": "plain text", "content_type": "text/plain", "event_type": "note"},
        ],
        cloudevents_mode="structured",
        default_type="com.shop.order.changed",
        ordering=ordering,
    )
    assert {got[i]["status"] for i in ids} == {"delivered"}
    json_id, binary_id, text_id = ids
    expect = {
        json_id: ("com.shop.order.created", "application/json", b"order-1"),
        binary_id: ("com.shop.order.changed", "application/octet-stream", None),
        text_id: ("note", "text/plain", None),
    }
    for i, (type_, content_type, key) in expect.items():
        record = by_id[i]
        headers = dict(record.headers)
        assert headers["content-type"] == b"application/cloudevents+json"
        assert headers["outbox-id"] == str(i).encode()
        assert not [k for k in headers if k.lower().startswith("ce_")]
        assert record.key == key
        assert record.value is not None
        doc = json.loads(record.value)
        if content_type == "application/json":
            assert "data_base64" not in doc and doc["data"] == json.loads(got[i]["payload"])
        else:
            assert "data" not in doc and "data_base64" in doc

        # The 1.x API reads the structured value (it maps every Kafka header to an
        # attribute, content-type included: so datacontenttype is checked with 2.x below).
        event = ce_kafka.from_structured(message(record))
        assert event["id"] == str(i)
        assert event["source"] == SOURCE
        assert event["type"] == type_
        assert event["specversion"] == "1.0"
        assert datetime.fromisoformat(event["time"]) == created(got[i])
        data = event.get_data()
        if content_type == "application/json":
            assert data == json.loads(got[i]["payload"])
        else:
            assert data == got[i]["payload"]  # data_base64, decoded

        core = core_kafka.from_structured(core_message(record), JSONFormat())
        assert (core.get_id(), core.get_source(), core.get_type()) == (str(i), SOURCE, type_)
        assert core.get_specversion() == "1.0"
        assert core.get_time() == created(got[i])
        assert core.get_datacontenttype() == content_type
        if content_type != "application/json":
            assert core.get_data() == got[i]["payload"]

    assert dict(by_id[json_id].headers)["traceparent"] == TRACEPARENT.encode()


async def test_binary_mode_sends_only_the_row_ce_headers_readers_accept(
    db_url: str, kafka_bootstrap: str
) -> None:
    # A ce_ header whose name is no attribute name (or one the relay sets, or
    # datacontenttype) would make the SDK refuse the whole event: it is not sent; valid
    # extensions are, under their lower-case name, with the row's value.
    ids, got, by_id = await relay_to_kafka(
        db_url,
        kafka_bootstrap,
        [
            {
                "payload": {"order": 1},
                "event_type": "com.shop.order.created",
                "headers": {
                    "ce_Trace-ID": "abc",
                    "ce_my_ext": "x",
                    "ce_datacontenttype": "text/plain",
                    "ce_Tenant": "100% done é",
                    "ce_region": "eu",
                    "traceparent": TRACEPARENT,
                },
            }
        ],
    )
    [i] = ids
    assert got[i]["status"] == "delivered"
    headers = dict(by_id[i].headers)
    assert headers["ce_tenant"] == "100% done é".encode() and headers["ce_region"] == b"eu"
    assert {k for k in headers if k.lower().startswith("ce_")} == {
        "ce_id",
        "ce_source",
        "ce_type",
        "ce_specversion",
        "ce_time",
        "ce_tenant",
        "ce_region",
    }
    core = core_kafka.from_binary(core_message(by_id[i]), JSONFormat())
    assert core.get_extension("tenant") == "100% done é"
    assert core.get_extension("region") == "eu"
    assert core.get_datacontenttype() == "application/json"
    assert core.get_data() == {"order": 1}
    assert ce_kafka.from_binary(message(by_id[i]))["tenant"] == "100% done é"


async def test_an_oversized_structured_cloudevent_is_refused_by_its_size(
    db_url: str, kafka_bootstrap: str
) -> None:
    # The payload alone fits kafka.max_request_size; as data_base64 in the document it does
    # not: the row is failed by the relay's own size check, the envelope named, never sent.
    limit = 4096
    ids, got, by_id = await relay_to_kafka(
        db_url,
        kafka_bootstrap,
        [
            {"payload": b"\x01" * 3300, "content_type": "application/octet-stream"},
            {"payload": b"\x01" * 1000, "content_type": "application/octet-stream"},
        ],
        kafka={"max_request_size": limit},
        cloudevents_mode="structured",
        default_type="com.shop.blob",
    )
    big, small = ids
    assert got[small]["status"] == "delivered" and set(by_id) == {small}
    assert got[big]["status"] == "failed" and got[big]["attempts"] == 1
    error = got[big]["last_error"]
    assert error.startswith("MessageSizeTooLargeError: the message is "), error
    assert f"CloudEvent envelope and framing, above kafka.max_request_size ({limit})" in error
    size = int(error.split("the message is ")[1].split()[0])
    assert size > limit > 3300 + 200
