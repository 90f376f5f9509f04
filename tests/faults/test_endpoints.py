"""Endpoints destinations under faults: an endpoint disabled with a short retention keeps its
queue, and a relay killed in the middle of a fan-out sends no (event, endpoint) pair twice.
Real relay processes, real receivers on loopback, signatures checked with standardwebhooks."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import outbox
from outbox.dburl import to_asyncpg_dsn, to_sqlalchemy_async_url
from tests.support.faults import end_of_run, fetch, fetchval, fleet, install_audit, kill
from tests.support.faults import relay_config as base_config
from tests.support.receiver import Receiver
from tests.support.relays import wait_until
from tests.webhook_helpers import verify

pytestmark = pytest.mark.slow

DEST = "customer-events"


@pytest.fixture
async def aengine(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    yield engine
    await engine.dispose()


def relay_config(db_url: str, name: str, **relay: Any) -> dict[str, Any]:
    cfg = base_config(db_url, "127.0.0.1:9", "unused", relay_id=name, **relay)
    cfg["destinations"] = {
        DEST: {
            "kind": "endpoints",
            "allow_private_networks": True,  # the receivers are on loopback
            "max_concurrency": 1,
            "backoff": {"schedule": [0.2], "jitter": 0},
        }
    }
    return cfg


async def register(engine: AsyncEngine, url: str) -> outbox.endpoints.Endpoint:
    async with engine.begin() as conn:
        return await outbox.endpoints.create(
            conn, destination=DEST, url=url, allow_private_networks=True
        )


async def enqueue(db_url: str, n: int) -> list[int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            return await outbox.enqueue_many(
                conn, [{"destination": DEST, "payload": {"n": i}} for i in range(n)]
            )
    finally:
        await conn.close()


def received(receiver: Receiver) -> Counter[int]:
    """The events an endpoint answered 2xx to, with how many times each."""
    return Counter(
        int(r.headers["webhook-id"])
        for r in receiver.requests
        if r.status is not None and 200 <= r.status < 300
    )


@pytest.mark.timeout(120)
async def test_an_endpoint_disabled_by_a_410_keeps_its_queue_through_retention(
    db_url: str,
    aengine: AsyncEngine,
    make_receiver: Callable[..., Receiver],
    tmp_path: Path,
    fault_report: dict[str, object],
) -> None:
    """A receiver answers 410 once (a bad deploy) after 4 of 10 queued events: its endpoint
    is disabled at once. With a retention of one second, run every 0.2 s, the relay must keep
    the events of its 6 queued deliveries; enabling the endpoint sends all of them."""
    receiver = make_receiver()
    receiver.respond(200, times=4)
    receiver.respond(410, body=b"deploy in progress", times=1)
    ep = await register(aengine, receiver.url)
    with fleet(tmp_path) as relays:
        relays.start(relay_config(db_url, "r1", retention=1, retention_interval=0.2), "r1")
        ids = await enqueue(db_url, 10)
        await wait_until(
            lambda: fetch(db_url, "SELECT 1 FROM outbox_endpoints WHERE NOT enabled"),
            what="disabled by its 410",
        )
        got = len(received(receiver))
        # Retention runs over and over past the events' retention while the endpoint is off.
        await asyncio.sleep(2.5)
        kept = await fetchval(db_url, "SELECT count(*) FROM outbox WHERE id = ANY($1)", ids)
        assert kept >= 10 - got, "events of queued deliveries were deleted"
        async with aengine.begin() as conn:
            await outbox.endpoints.enable(conn, ep.id)
        await wait_until(lambda: set(received(receiver)) == set(ids), what="all delivered")
        await wait_until(
            lambda: fetchval(db_url, "SELECT count(*) = 0 FROM outbox"), what="retention after"
        )
    counts = received(receiver)
    assert set(counts) == set(ids) and max(counts.values()) == 1
    for r in receiver.requests:
        verify(ep.secret, r.body, r.headers)
    statuses = await fetch(db_url, "SELECT status, count(*) AS n FROM outbox_deliveries GROUP BY 1")
    assert {r["status"]: r["n"] for r in statuses} == {"delivered": 10}
    fault_report.update(events=10, received_before_disable=got, lost=0, duplicates=0)


# A statement that records a fanned-out event waits here (a BEFORE trigger on the update that
# marks it delivered) until the test has killed its relay.
STALL = """
CREATE FUNCTION stall_fan_out_record() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_sleep(60);
    RETURN NEW;
END $$;
CREATE TRIGGER stall_fan_out_record BEFORE UPDATE ON outbox
    FOR EACH ROW WHEN (OLD.status = 'running' AND NEW.status = 'delivered')
    EXECUTE FUNCTION stall_fan_out_record();
"""

TERMINATE_STALLED = """
SELECT pg_terminate_backend(pid) FROM pg_stat_activity
WHERE datname = current_database() AND wait_event = 'PgSleep' AND pid <> pg_backend_pid()
"""

STALLED = """
SELECT count(*) > 0 FROM pg_stat_activity
WHERE datname = current_database() AND wait_event = 'PgSleep' AND pid <> pg_backend_pid()
"""


@pytest.mark.timeout(120)
async def test_a_relay_killed_between_fan_out_and_record_sends_no_pair_twice(
    db_url: str,
    aengine: AsyncEngine,
    make_receiver: Callable[..., Receiver],
    tmp_path: Path,
    fault_report: dict[str, object],
) -> None:
    """With retention = 0, a relay dies after fanning a batch out and before its events are
    recorded (held there by a trigger); its deliveries may meanwhile be sent and deleted. The
    next relay must not fan the batch out again: each (event, endpoint) pair is sent once."""
    receivers = [make_receiver(), make_receiver()]
    endpoints = [await register(aengine, r.url) for r in receivers]
    await install_audit(db_url)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(STALL)
    finally:
        await conn.close()
    settings = {"retention": 0, "retention_interval": 0.2, "lease": 3}
    with fleet(tmp_path) as relays:
        victim = relays.start(relay_config(db_url, "victim", **settings), "victim")
        ids = await enqueue(db_url, 20)
        await wait_until(lambda: fetchval(db_url, STALLED), what="the record stalled")
        # A relay that had committed its fan-out sends the deliveries within milliseconds and
        # retention 0 deletes them as they end: give it that time, so that the test can tell.
        await asyncio.sleep(1.5)
        sent_before_kill = sum(sum(received(r).values()) for r in receivers)
        kill(victim)
        conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
        try:
            # PostgreSQL notices a dead client only when it next talks to it: end the stalled
            # statement as a server that noticed would (it rolls back).
            await conn.execute(TERMINATE_STALLED)
            await conn.execute("DROP TRIGGER stall_fan_out_record ON outbox")
        finally:
            await conn.close()
        started = time.monotonic()
        relays.start(relay_config(db_url, "heir", **settings), "heir")
        for r in receivers:
            await wait_until(lambda r=r: set(received(r)) == set(ids), what="all delivered")
        await wait_until(
            lambda: fetchval(db_url, "SELECT count(*) = 0 FROM outbox"), what="events deleted"
        )
        recovered_s = time.monotonic() - started
    for r, ep in zip(receivers, endpoints, strict=True):
        counts = received(r)
        assert set(counts) == set(ids)
        assert max(counts.values()) == 1, f"pairs sent twice: {counts.most_common(3)}"
        for req in r.requests:
            verify(ep.secret, req.body, req.headers)
    figures = await end_of_run(db_url)
    fault_report.update(
        events=20,
        endpoints=2,
        sent_before_kill=sent_before_kill,
        duplicates=0,
        recovered_s=round(recovered_s, 2),
        **figures,
    )
