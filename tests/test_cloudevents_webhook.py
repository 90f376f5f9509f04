"""CloudEvents over HTTP, end to end: rows in a real database, the relay in-process, a real
receiver on loopback, for webhook and endpoints destinations. Every request is read back with
the official CloudEvents SDK (``from_http`` of the 1.x API kept as ``cloudevents.v1``, and of
the 2.x ``cloudevents.core`` bindings, which also undo the binding's percent-encoding), each
attribute checked against the row, and the Standard Webhooks signature checked over exactly
the bytes received."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import Any
from urllib.parse import quote

import asyncpg
import pytest
from cloudevents.core.bindings import http as core_http
from cloudevents.core.formats.json import JSONFormat
from cloudevents.v1.http import from_http
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import outbox
from outbox.dburl import to_asyncpg_dsn, to_sqlalchemy_async_url
from tests.support.receiver import Receiver, Recorded
from tests.support.relays import running, settings, wait_until
from tests.webhook_helpers import SECRET, verify, verify_bytes

SOURCE = "/orders-service"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
BINARY = bytes(range(256))
# Needs the HTTP binding's percent-encoding: a space, non-ASCII letters, '%' and '"'.
ODD_TYPE = 'com.shop.commande créée "100%"'
# What the HTTP binding (3.1.3.2) sends unencoded: printable ASCII but space, '"' and '%'.
HEADER_SAFE = "".join(c for c in map(chr, range(0x21, 0x7F)) if c not in '"%')


async def enqueue(db_url: str, events: list[dict[str, Any]]) -> list[int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            return await outbox.enqueue_many(conn, events)
    finally:
        await conn.close()


async def fetch(db_url: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


async def rows(db_url: str) -> dict[int, asyncpg.Record]:
    return {r["id"]: r for r in await fetch(db_url, "SELECT * FROM outbox")}


async def ended(db_url: str, ids: list[int]) -> bool:
    got = await rows(db_url)
    return all(got[i]["status"] in ("delivered", "failed") for i in ids)


async def relay_to_hook(
    db_url: str, receiver: Receiver, events: list[dict[str, Any]], **envelope: Any
) -> tuple[list[int], dict[int, asyncpg.Record], dict[int, Recorded]]:
    """Enqueue ``events`` for a CloudEvents webhook destination, run the relay until each row
    has ended: (ids, rows, the request of each id the receiver got)."""
    dest = {
        "kind": "webhook",
        "url": receiver.url + "/in",
        "secrets": [SECRET],
        "allow_private_networks": True,
        "envelope": "cloudevents",
        "source": SOURCE,
        **envelope,
    }
    s = settings(db_url, "127.0.0.1:9", destinations={"hook": dest}, relay={"poll_interval": 0.2})
    ids = await enqueue(db_url, [{"destination": "hook", **e} for e in events])
    async with running(s):
        await wait_until(lambda: ended(db_url, ids), what="every row delivered or failed")
    by_id = {int(r.headers["webhook-id"]): r for r in receiver.requests}
    assert len(by_id) == len(receiver.requests)  # one request per row
    return ids, await rows(db_url), by_id


def created(row: asyncpg.Record) -> datetime:
    t: datetime = row["created_at"]
    return t


async def test_binary_mode_sends_ce_headers_and_the_payload_signed(
    db_url: str, receiver: Receiver
) -> None:
    ids, got, requests = await relay_to_hook(
        db_url,
        receiver,
        [
            {
                "payload": {"order": 1},
                "event_type": "com.shop.order.created",
                # traceparent stays; a row's ce-type cannot override the event's type; other
                # ce- headers are extension attributes.
                "headers": {"traceparent": TRACEPARENT, "ce-type": "spoofed", "ce-channel": "web"},
            },
            {"payload": BINARY, "content_type": "application/octet-stream", "event_type": ODD_TYPE},
            {"payload": {"order": 3}},  # no event_type: the destination's default_type
        ],
        default_type="com.shop.order.changed",
    )
    assert {got[i]["status"] for i in ids} == {"delivered"}
    assert set(requests) == set(ids)
    created_id, odd_id, default_id = ids
    expect = {
        created_id: ("com.shop.order.created", "application/json"),
        odd_id: (ODD_TYPE, "application/octet-stream"),
        default_id: ("com.shop.order.changed", "application/json"),
    }
    for i, (type_, content_type) in expect.items():
        r = requests[i]
        assert r.body == got[i]["payload"]  # the payload as it is
        verify_bytes(SECRET, r.body, r.headers)  # signed over exactly these bytes
        assert r.headers["content-type"] == content_type
        assert r.headers["ce-specversion"] == "1.0"
        assert r.headers["ce-type"] == quote(type_, safe=HEADER_SAFE)

        # The 1.x reader does not undo the percent-encoding (only ODD_TYPE needs it).
        event = from_http(r.headers, r.body, data_unmarshaller=lambda b: b)
        assert event["id"] == str(i)
        assert event["source"] == SOURCE
        assert event["type"] == (type_ if i != odd_id else r.headers["ce-type"])
        assert event["specversion"] == "1.0"
        assert datetime.fromisoformat(event["time"]) == created(got[i])
        assert event["datacontenttype"] == content_type
        assert event.get_data() == got[i]["payload"]

        core = core_http.from_http(core_http.HTTPMessage(r.headers, r.body), JSONFormat())
        assert (core.get_id(), core.get_source(), core.get_type()) == (str(i), SOURCE, type_)
        assert core.get_specversion() == "1.0"
        assert core.get_time() == created(got[i])
        assert core.get_datacontenttype() == content_type

    first = requests[created_id]
    verify(SECRET, first.body, first.headers)  # and with the reference library
    assert first.headers["traceparent"] == TRACEPARENT
    core = core_http.from_http(core_http.HTTPMessage(first.headers, first.body), JSONFormat())
    assert core.get_data() == {"order": 1}
    assert core.get_extension("channel") == "web"


async def test_structured_mode_sends_the_json_cloudevent_signed(
    db_url: str, receiver: Receiver
) -> None:
    ids, got, requests = await relay_to_hook(
        db_url,
        receiver,
        [
            {
                "payload": {"order": 1, "lines": [{"sku": "a", "qty": 2}]},
                "event_type": "com.shop.order.created",
                # No ce- header goes out in structured mode: readers would take it as binary.
                "headers": {"traceparent": TRACEPARENT, "ce-type": "spoofed"},
            },
            {"payload": BINARY, "content_type": "application/octet-stream", "event_type": ODD_TYPE},
            {"payload": {"order": 3}},  # no event_type and no default_type: failed, not sent
        ],
        cloudevents_mode="structured",
    )
    json_id, binary_id, untyped_id = ids
    assert got[json_id]["status"] == got[binary_id]["status"] == "delivered"
    untyped = got[untyped_id]
    assert untyped["status"] == "failed" and untyped["attempts"] == 1
    assert f"row {untyped_id} has no event_type" in untyped["last_error"]
    assert set(requests) == {json_id, binary_id}

    expect = {
        json_id: ("com.shop.order.created", "application/json"),
        binary_id: (ODD_TYPE, "application/octet-stream"),
    }
    for i, (type_, content_type) in expect.items():
        r = requests[i]
        assert r.headers["content-type"] == "application/cloudevents+json"
        assert not [k for k in r.headers if k.startswith("ce-")]
        verify(SECRET, r.body, r.headers)  # the document is what is signed
        verify_bytes(SECRET, r.body, r.headers)
        doc = json.loads(r.body)
        if content_type == "application/json":
            assert doc["data"] == json.loads(got[i]["payload"]) and "data_base64" not in doc
        else:
            assert "data" not in doc and "data_base64" in doc

        event = from_http(r.headers, r.body, data_unmarshaller=lambda b: b)
        assert event["id"] == str(i)
        assert event["source"] == SOURCE
        assert event["type"] == type_  # JSON strings need no percent-encoding
        assert event["specversion"] == "1.0"
        assert datetime.fromisoformat(event["time"]) == created(got[i])
        assert event["datacontenttype"] == content_type
        data = event.get_data()
        if content_type == "application/json":
            assert data is not None and json.loads(data) == json.loads(got[i]["payload"])
        else:
            assert data == got[i]["payload"]  # data_base64, decoded

        core = core_http.from_http(core_http.HTTPMessage(r.headers, r.body), JSONFormat())
        assert (core.get_id(), core.get_source(), core.get_type()) == (str(i), SOURCE, type_)
        assert core.get_specversion() == "1.0"
        assert core.get_time() == created(got[i])
        assert core.get_datacontenttype() == content_type
        if content_type != "application/json":
            assert core.get_data() == got[i]["payload"]

    assert requests[json_id].headers["traceparent"] == TRACEPARENT


# --- endpoints destinations: the event's type comes through the deliveries' own claim ------


@pytest.fixture
async def aengine(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    yield engine
    await engine.dispose()


@pytest.mark.parametrize("mode", ["binary", "structured"])
async def test_endpoints_destination_sends_cloudevents_to_each_endpoint(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver], mode: str
) -> None:
    first, second = make_receiver(), make_receiver()
    endpoints = []
    async with aengine.begin() as conn:
        for receiver in (first, second):
            endpoints.append(
                await outbox.endpoints.create(
                    conn, destination="customers", url=receiver.url, allow_private_networks=True
                )
            )
    dest = {
        "kind": "endpoints",
        "allow_private_networks": True,
        "backoff": {"schedule": [0.3], "jitter": 0},
        "envelope": "cloudevents",
        "source": SOURCE,
        "cloudevents_mode": mode,
    }
    s = settings(db_url, "127.0.0.1:9", destinations={"customers": dest})
    ids = await enqueue(
        db_url,
        [
            {"destination": "customers", "payload": {"n": 1}, "event_type": "invoice.paid"},
            {"destination": "customers", "payload": {"n": 2}, "event_type": ODD_TYPE},
            {"destination": "customers", "payload": {"n": 3}},  # no type: each delivery fails
        ],
    )

    async def done() -> bool:
        found = await fetch(db_url, "SELECT status FROM outbox_deliveries")
        return len(found) == 6 and all(r["status"] in ("delivered", "failed") for r in found)

    async with running(s):
        await wait_until(done, what="every delivery ended")
    got = await rows(db_url)
    for receiver, ep in zip((first, second), endpoints, strict=True):
        requests = {int(r.headers["webhook-id"]): r for r in receiver.requests}
        assert sorted(requests) == ids[:2]
        for i, type_ in zip(ids[:2], ("invoice.paid", ODD_TYPE), strict=True):
            r = requests[i]
            verify(ep.secret, r.body, r.headers)  # the endpoint's own secret, the bytes sent
            if mode == "structured":
                assert r.headers["content-type"] == "application/cloudevents+json"
            else:
                assert r.body == got[i]["payload"]
            core = core_http.from_http(core_http.HTTPMessage(r.headers, r.body), JSONFormat())
            assert (core.get_id(), core.get_source(), core.get_type()) == (str(i), SOURCE, type_)
            assert core.get_time() == created(got[i])
            assert core.get_datacontenttype() == "application/json"
            assert core.get_data() == {"n": ids.index(i) + 1}
            event = from_http(r.headers, r.body)
            assert (event["id"], event["source"], event["specversion"]) == (str(i), SOURCE, "1.0")
    failed = await fetch(
        db_url,
        "SELECT status, attempts, last_error FROM outbox_deliveries WHERE event_id = $1",
        ids[2],
    )
    assert len(failed) == 2
    for d in failed:
        assert d["status"] == "failed" and d["attempts"] == 1
        assert f"row {ids[2]} has no event_type" in d["last_error"]


async def test_binary_mode_sends_only_the_row_ce_headers_readers_accept(
    db_url: str, receiver: Receiver
) -> None:
    # A ce- header whose name is no attribute name (or one the relay sets, or
    # datacontenttype) would make the SDK refuse the whole event: it is not sent. Valid
    # extensions are, %-encoded as the relay's own attributes: read back, the row's value.
    value = '100% done é "q" '
    ids, got, requests = await relay_to_hook(
        db_url,
        receiver,
        [
            {
                "payload": {"order": 1},
                "event_type": "com.shop.order.created",
                "headers": {
                    "ce-my_ext": "x",
                    "CE-Trace-ID.v2": "abc",
                    "ce-datacontenttype": "text/plain",
                    "ce-Tenant": value,
                    "ce-region": "eu",
                    "traceparent": TRACEPARENT,
                },
            }
        ],
    )
    [i] = ids
    assert got[i]["status"] == "delivered"
    r = requests[i]
    verify_bytes(SECRET, r.body, r.headers)
    assert r.headers["ce-tenant"] == quote(value, safe=HEADER_SAFE)
    assert {k for k in r.headers if k.startswith("ce-")} == {
        "ce-id",
        "ce-source",
        "ce-type",
        "ce-specversion",
        "ce-time",
        "ce-tenant",
        "ce-region",
    }
    core = core_http.from_http(core_http.HTTPMessage(r.headers, r.body), JSONFormat())
    assert core.get_extension("tenant") == value
    assert core.get_extension("region") == "eu"
    assert core.get_datacontenttype() == "application/json"
    assert core.get_data() == {"order": 1}
    assert r.headers["traceparent"] == TRACEPARENT
