"""Endpoints destinations end to end: events fan out to the endpoints registered at runtime
and each delivery is sent, signed with its endpoint's secret, retried and logged on its own.
Real database, the relay in-process, several real receivers on loopback; signatures checked
with the standardwebhooks package."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import outbox
from outbox.dburl import to_asyncpg_dsn, to_sqlalchemy_async_url
from tests.support.receiver import Receiver
from tests.support.relays import running, settings, wait_until
from tests.webhook_helpers import closed_port, verify

DEST = "customer-events"


@pytest.fixture
async def aengine(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    yield engine
    await engine.dispose()


def endpoints_settings(db_url: str, **dest: Any) -> Any:
    d: dict[str, Any] = {
        "kind": "endpoints",
        "allow_private_networks": True,
        "backoff": {"schedule": [0.3], "jitter": 0},
        "max_attempts": 4,
        "circuit": {"threshold": 50},
    }
    d.update(dest)
    return settings(
        db_url,
        "127.0.0.1:9",
        destinations={DEST: d},
        relay={"poll_interval": 0.2, "lease": 5},
    )


async def add_endpoint(engine: AsyncEngine, url: str, **kw: Any) -> outbox.endpoints.Endpoint:
    async with engine.begin() as conn:
        return await outbox.endpoints.create(
            conn, destination=DEST, url=url, allow_private_networks=True, **kw
        )


async def enqueue(db_url: str, events: list[dict[str, Any]]) -> list[int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            return await outbox.enqueue_many(conn, [{"destination": DEST, **e} for e in events])
    finally:
        await conn.close()


async def fetch(db_url: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


def delivered_to(receiver: Receiver) -> list[int]:
    return sorted(int(r.headers["webhook-id"]) for r in receiver.requests if r.status == 200)


async def deliveries_done(db_url: str, count: int) -> bool:
    rows = await fetch(db_url, "SELECT status FROM outbox_deliveries")
    return len(rows) == count and all(
        r["status"] in ("delivered", "failed", "cancelled") for r in rows
    )


async def test_events_fan_out_to_matching_endpoints_signed_with_each_secret(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    everyone, acme, acme_paid, other = (make_receiver() for _ in range(4))
    ep_all = await add_endpoint(aengine, everyone.url)
    ep_acme = await add_endpoint(aengine, acme.url, tenant="acme")
    ep_paid = await add_endpoint(
        aengine, acme_paid.url, tenant="acme", event_types=["invoice.paid"]
    )
    await add_endpoint(aengine, other.url, tenant="globex")
    ids = await enqueue(
        db_url,
        [
            {"tenant": "acme", "event_type": "invoice.paid", "payload": {"n": 1}},
            {"tenant": "acme", "event_type": "invoice.voided", "payload": {"n": 2}},
            {"tenant": "initech", "event_type": "invoice.paid", "payload": {"n": 3}},
            {"payload": {"n": 4}},  # no tenant, no type: only endpoints taking everything
        ],
    )
    async with running(endpoints_settings(db_url)):
        await wait_until(lambda: deliveries_done(db_url, 4 + 2 + 1), what="deliveries ended")
    assert delivered_to(everyone) == ids
    assert delivered_to(acme) == ids[:2]
    assert delivered_to(acme_paid) == ids[:1]
    assert other.requests == []
    for receiver, ep in ((everyone, ep_all), (acme, ep_acme), (acme_paid, ep_paid)):
        for r in receiver.requests:
            verify(ep.secret, r.body, r.headers)  # each endpoint's own secret
    events = {r["id"]: r for r in await fetch(db_url, "SELECT * FROM outbox")}
    assert {events[i]["status"] for i in ids} == {"delivered"}
    log = await fetch(db_url, "SELECT * FROM outbox_attempts ORDER BY id")
    assert len(log) == 7 and {a["http_status"] for a in log} == {200}
    assert all(a["duration_ms"] is not None and a["duration_ms"] >= 0 for a in log)


async def test_an_event_no_endpoint_takes_is_recorded_as_such(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    await add_endpoint(aengine, receiver.url, tenant="acme")
    [lonely] = await enqueue(db_url, [{"tenant": "globex", "payload": {}}])
    async with running(endpoints_settings(db_url)):
        await wait_until(
            lambda: fetch(db_url, "SELECT 1 FROM outbox WHERE status = 'delivered'"),
            what="event recorded",
        )
    [row] = await fetch(db_url, "SELECT * FROM outbox WHERE id = $1", lonely)
    assert row["status"] == "delivered" and "no endpoint matched" in row["last_error"]
    assert await fetch(db_url, "SELECT * FROM outbox_deliveries") == []
    assert receiver.requests == []


async def test_a_dead_and_a_slow_endpoint_hold_only_their_own_deliveries(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    fast, slow = make_receiver(), make_receiver()
    slow.respond(200, delay=2.0)
    await add_endpoint(aengine, fast.url)
    await add_endpoint(aengine, slow.url)
    await add_endpoint(aengine, f"http://127.0.0.1:{closed_port()}/dead")
    async with running(endpoints_settings(db_url, max_concurrency=2)):
        started = time.monotonic()
        ids = await enqueue(db_url, [{"payload": {"n": i}} for i in range(20)])
        await wait_until(lambda: len(delivered_to(fast)) == 20, timeout=10, what="fast done")
        fast_took = time.monotonic() - started
    # 20 events at 2 s a request, 2 at a time, would take the slow endpoint 20 s.
    assert fast_took < 8, fast_took
    assert delivered_to(fast) == ids
    dead = await fetch(
        db_url,
        "SELECT d.* FROM outbox_deliveries d JOIN outbox_endpoints e ON e.id = d.endpoint_id "
        "WHERE e.url LIKE '%/dead'",
    )
    assert dead and all(d["last_error"] and "cannot connect" in d["last_error"] for d in dead)
    assert all(d["status"] in ("pending", "running", "failed") for d in dead)


async def test_failures_retry_per_endpoint_and_are_logged(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    ok, flaky = make_receiver(), make_receiver()
    flaky.respond(500, body=b"boom" * 400, times=2)
    await add_endpoint(aengine, ok.url)
    ep = await add_endpoint(aengine, flaky.url)
    [event] = await enqueue(db_url, [{"payload": {"x": 1}}])
    async with running(endpoints_settings(db_url)):
        await wait_until(lambda: deliveries_done(db_url, 2), what="both delivered")
    assert len(ok.requests) == 1 and len(flaky.requests) == 3
    assert {r.headers["webhook-id"] for r in flaky.requests} == {str(event)}
    [d] = await fetch(db_url, "SELECT * FROM outbox_deliveries WHERE endpoint_id = $1", ep.id)
    assert d["status"] == "delivered" and d["attempts"] == 3 and d["last_status"] == 200
    log = await fetch(
        db_url, "SELECT * FROM outbox_attempts WHERE endpoint_id = $1 ORDER BY id", ep.id
    )
    assert [a["http_status"] for a in log] == [500, 500, 200]
    assert log[0]["response"] == ("boom" * 400)[:1024]  # the first KiB of the answer
    assert "HTTP 500" in log[0]["error"]
    [endpoint] = await fetch(db_url, "SELECT * FROM outbox_endpoints WHERE id = $1", ep.id)
    assert endpoint["last_success_at"] is not None and endpoint["failing_since"] is None


async def test_changes_at_runtime_apply_within_a_second(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    first, second = make_receiver(), make_receiver()
    ep = await add_endpoint(aengine, first.url)
    async with running(endpoints_settings(db_url)):
        [a] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: delivered_to(first) == [a], what="first")
        async with aengine.begin() as conn:
            await outbox.endpoints.update(conn, ep.id, url=second.url, allow_private_networks=True)
        new = await add_endpoint(aengine, first.url)
        t0 = time.monotonic()
        [b] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: delivered_to(second) == [b], timeout=5, what="moved")
        await wait_until(lambda: delivered_to(first) == [a, b], timeout=5, what="added")
        assert time.monotonic() - t0 < 2
        async with aengine.begin() as conn:
            await outbox.endpoints.disable(conn, new.id, reason="paused by test")
        [c] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: delivered_to(second) == [b, c], timeout=5, what="third")
        await asyncio.sleep(0.5)
        assert delivered_to(first) == [a, b]  # disabled: not sent to
