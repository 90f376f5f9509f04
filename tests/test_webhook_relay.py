"""End to end: rows in a real database, the relay in-process, a real receiver on loopback."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import asyncpg

import outbox
from outbox.dburl import to_asyncpg_dsn
from tests.support.receiver import Receiver
from tests.support.relays import running, settings, wait_until
from tests.webhook_helpers import SECRET, closed_port, open_port, verify


def hook(url: str, **kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "kind": "webhook",
        "url": url,
        "secrets": [SECRET],
        "allow_private_networks": True,
        "backoff": {"schedule": [0.5], "jitter": 0},
        "max_attempts": 8,
    }
    d.update(kw)
    return d


async def enqueue(db_url: str, destination: str, n: int, first: int = 0) -> list[int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            return await outbox.enqueue_many(
                conn,
                [{"destination": destination, "payload": {"n": first + i}} for i in range(n)],
            )
    finally:
        await conn.close()


async def rows(db_url: str) -> dict[int, asyncpg.Record]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        return {r["id"]: r for r in await conn.fetch("SELECT * FROM outbox ORDER BY id")}
    finally:
        await conn.close()


async def all_in(db_url: str, ids: list[int], status: str) -> bool:
    got = await rows(db_url)
    return {got[i]["status"] for i in ids} == {status}


def relay_settings(db_url: str, **destinations: dict[str, Any]) -> Any:
    return settings(db_url, "127.0.0.1:9", destinations=destinations, relay={"poll_interval": 0.2})


async def test_retries_honour_backoff_and_retry_after(db_url: str, receiver: Receiver) -> None:
    receiver.respond(500, body=b"boom", times=1)
    receiver.respond(429, headers={"Retry-After": "2"}, times=1)
    [row_id] = await enqueue(db_url, "hook", 1)
    async with running(relay_settings(db_url, hook=hook(receiver.url))):
        await wait_until(
            lambda: all_in(db_url, [row_id], "delivered"), timeout=20, what="delivered"
        )
    reqs = receiver.requests
    assert len(reqs) == 3
    assert {r.headers["webhook-id"] for r in reqs} == {str(row_id)}
    for r in reqs:
        verify(SECRET, r.body, r.headers)
    # run_after: 0.5 s of backoff after the 500, the asked 2 s after the 429.
    assert reqs[1].at - reqs[0].at >= 0.45
    assert reqs[2].at - reqs[1].at >= 1.9
    assert reqs[2].at - reqs[1].at < 0.5 + 2 + 2  # not the backoff on top, nor lost
    row = (await rows(db_url))[row_id]
    assert row["attempts"] == 3


async def test_flaky_endpoint_gets_every_event_in_the_end(
    db_url: str, make_receiver: Callable[..., Receiver]
) -> None:
    port = closed_port()
    ids = await enqueue(db_url, "hook", 12)
    s = relay_settings(
        db_url,
        hook=hook(
            f"http://127.0.0.1:{port}/in",
            timeout=0.5,
            circuit={"threshold": 5, "cooldown": 0.3, "max_cooldown": 1},
        ),
    )
    async with running(s):
        # Connection refused first: every row is attempted and waits for a retry.
        await wait_until(
            lambda: _all_attempted(db_url, ids), timeout=20, what="a refused attempt each"
        )
        receiver = make_receiver(port=open_port(port))
        receiver.respond(reset=True, times=2)
        receiver.respond(200, delay=1.0, times=2)  # past the 0.5 s timeout
        receiver.respond(503, headers={"Retry-After": "1"}, times=2)
        await wait_until(lambda: all_in(db_url, ids, "delivered"), timeout=30, what="all delivered")
    seen = receiver.requests
    assert {int(r.headers["webhook-id"]) for r in seen} == set(ids)
    assert len(seen) >= len(ids) + 6  # the scripted failures happened, then one success each
    got = await rows(db_url)
    assert all(got[i]["attempts"] >= 2 for i in ids)


async def _all_attempted(db_url: str, ids: list[int]) -> bool:
    got = await rows(db_url)
    return all(
        got[i]["attempts"] >= 1
        and "cannot connect (ConnectionRefusedError)" in (got[i]["last_error"] or "")
        for i in ids
    )


async def test_gone_and_refused_rows_fail_with_a_clear_reason(
    db_url: str, make_receiver: Callable[..., Receiver]
) -> None:
    gone, private = make_receiver(), make_receiver()
    gone.respond(410, body=b"this endpoint was deleted")
    [gone_id] = await enqueue(db_url, "gone", 1)
    [private_id] = await enqueue(db_url, "private", 1)
    s = relay_settings(
        db_url,
        gone=hook(gone.url),
        private=hook(private.url, allow_private_networks=False),
    )
    async with running(s):
        await wait_until(
            lambda: all_in(db_url, [gone_id, private_id], "failed"), what="both failed"
        )
    got = await rows(db_url)
    assert got[gone_id]["attempts"] == 1
    assert "HTTP 410" in got[gone_id]["last_error"]
    assert "this endpoint was deleted" in got[gone_id]["last_error"]
    assert "allow_private_networks" in got[private_id]["last_error"]
    assert private.requests == []


async def test_dead_endpoint_does_not_slow_a_healthy_one(
    db_url: str, make_receiver: Callable[..., Receiver]
) -> None:
    dead, healthy = make_receiver(), make_receiver()
    dead.respond(200, delay=3.0)  # never answers within the timeout
    circuit = {"threshold": 2, "cooldown": 30}
    s = relay_settings(
        db_url,
        dead=hook(dead.url, timeout=1.0, max_concurrency=2, circuit=circuit),
        healthy=hook(healthy.url),
    )
    async with running(s):
        started = time.monotonic()
        # One transaction, so one claim mixes both endpoints' rows.
        conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
        try:
            async with conn.transaction():
                dead_ids = await outbox.enqueue_many(
                    conn, [{"destination": "dead", "payload": {"n": i}} for i in range(6)]
                )
                healthy_ids = await outbox.enqueue_many(
                    conn, [{"destination": "healthy", "payload": {"n": i}} for i in range(20)]
                )
        finally:
            await conn.close()
        await wait_until(lambda: len(healthy.requests) == 20, timeout=10, what="healthy got 20")
        healthy_time = max(r.at for r in healthy.requests) - started
        await wait_until(lambda: all_in(db_url, healthy_ids, "delivered"), what="healthy recorded")
        await wait_until(lambda: _dead_settled(db_url, dead_ids), what="dead rows back pending")
        dead_time = time.monotonic() - started
    # Healthy deliveries took a small fraction of one dead-endpoint timeout.
    assert healthy_time / dead_time < 0.3, (healthy_time, dead_time)
    got = await rows(db_url)
    # Two failures open the circuit; with two requests in flight, a third row may have
    # taken a freed slot before the second failure landed. The rest were deferred, with no
    # attempt spent.
    attempts = sorted(got[i]["attempts"] for i in dead_ids)
    attempted = sum(attempts)
    assert 2 <= attempted <= 3 and set(attempts) == {0, 1}, attempts
    assert len(dead.requests) == attempted


async def _dead_settled(db_url: str, ids: list[int]) -> bool:
    got = await rows(db_url)
    return all(got[i]["status"] == "pending" and got[i]["last_error"] for i in ids)


async def test_a_full_endpoint_that_drains_is_claimed_for_at_once(
    db_url: str, receiver: Receiver
) -> None:
    """An endpoint taking one request at a time is full after a claim of 20 (4 x its
    max_concurrency): when those rows leave the sink the claim resumes then, not at the next
    poll (30 s here). Before, a fast endpoint was paced by the poll interval."""
    ids = await enqueue(db_url, "hook", 100)
    s = settings(
        db_url,
        "127.0.0.1:9",
        destinations={"hook": hook(receiver.url, max_concurrency=1)},
        relay={"poll_interval": 30, "batch_size": 20, "max_in_flight": 100},
    )
    async with running(s):
        await wait_until(lambda: all_in(db_url, ids, "delivered"), timeout=20, what="delivered")
    assert len(receiver.requests) == 100
