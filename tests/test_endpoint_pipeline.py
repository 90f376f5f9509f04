"""Endpoint deliveries on the relay's one claimer (issue #29), end to end: the events' retries
are claimed at their time while deliveries flow, and a healthy endpoint past a walk of
backing-off ones is served at once. Found by a review of the wiring; each failed on it. Real
database, the relay in-process, receivers on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine

import outbox
from outbox.dburl import to_asyncpg_dsn
from tests.support.receiver import Receiver
from tests.support.relays import running, wait_until
from tests.test_endpoint_delivery import (
    DEST,
    add_endpoint,
    aengine,  # noqa: F401  (fixture)
    delivered_to,
    endpoints_settings,
    enqueue,
    load_destination,
)
from tests.webhook_helpers import SECRET as SECRET_W


async def test_an_events_retry_is_claimed_while_deliveries_flow(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    make_receiver: Callable[..., Receiver],
) -> None:
    """A webhook event that failed once is due again 0.3 s later; nothing NOTIFYs for it, so
    the events' poll (1 s) claims it. While an endpoint's deliveries finish one by one, each
    finish wakes the source, which restarts the claimer's wait (and its poll) with the
    events not due: the retry waits until the deliveries are all done."""
    slow, hooks = make_receiver(), make_receiver()
    slow.respond(200, delay=0.03)
    hooks.respond(503, times=1)
    await add_endpoint(aengine, slow.url)
    hook = {
        "kind": "webhook",
        "url": hooks.url,
        "secrets": [SECRET_W],
        "allow_private_networks": True,
        "backoff": {"schedule": [0.3], "jitter": 0},
    }
    s = endpoints_settings(db_url, max_concurrency=1)
    s = s.model_copy(
        update={
            "relay": s.relay.model_copy(update={"poll_interval": 1.0}),
            "destinations": {**s.destinations, "hooks": load_destination(hook)},
        }
    )
    async with running(s):
        await enqueue(db_url, [{"payload": {"n": i}} for i in range(300)])  # ~9 s of sends
        await wait_until(lambda: len(slow.requests) >= 5, what="deliveries flowing")
        conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
        try:
            async with conn.transaction():
                await outbox.enqueue(conn, destination="hooks", payload={"h": 1})
        finally:
            await conn.close()
        await wait_until(lambda: len(hooks.requests) >= 1, what="first try")
        failed_at = time.monotonic()
        await wait_until(lambda: len(hooks.requests) >= 2, timeout=8, what="the retry")
        took = time.monotonic() - failed_at
        sent = len(slow.requests)
    assert sent < 300, "the deliveries were all done: the test proves nothing"
    assert took < 2.5, f"retry due after 0.3 s, poll 1 s: claimed after {took:.1f} s"


async def test_a_healthy_endpoint_past_a_scan_of_backing_off_ones_is_served_at_once(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    make_receiver: Callable[..., Receiver],
) -> None:
    """SCAN endpoints with deliveries backing off, then a healthy one: the claim that scans
    the first SCAN finds nothing and leaves its cursor. The dispatcher claimed again at once
    from the cursor; the claimer waits for its poll (5 s here), once per SCAN endpoints."""
    dead, healthy = make_receiver(), make_receiver()
    dead.respond(503)
    first = await add_endpoint(aengine, dead.url, event_types=["x"])
    second = await add_endpoint(aengine, dead.url, event_types=["x"])
    await add_endpoint(aengine, healthy.url, event_types=["y"])
    s = endpoints_settings(db_url, backoff={"schedule": [3600], "jitter": 0})
    s = s.model_copy(update={"relay": s.relay.model_copy(update={"poll_interval": 5.0})})
    async with running(s) as relay:
        source = relay.sinks[DEST].source  # type: ignore[attr-defined]
        source.scan = 2
        await enqueue(db_url, [{"payload": {}, "event_type": "x"}])
        await wait_until(lambda: len(dead.requests) == 2, what="both dead endpoints tried")
        await wait_until(
            lambda: _backing_off(db_url, [first.id, second.id]), what="recorded, backing off"
        )
        await asyncio.sleep(0.3)  # the wake-ups of those records are over
        source._cursor = None  # the scan starts from the first endpoint (as at any time)
        [b] = await enqueue(db_url, [{"payload": {}, "event_type": "y"}])
        started = time.monotonic()
        await wait_until(lambda: delivered_to(healthy) == [b], timeout=12, what="healthy sent")
        took = time.monotonic() - started
    assert took < 2.0, f"the healthy endpoint's delivery waited {took:.1f} s"


async def _backing_off(db_url: str, endpoints: list[int]) -> bool:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        rows = await conn.fetch(
            "SELECT status, attempts FROM outbox_deliveries WHERE endpoint_id = ANY($1)",
            endpoints,
        )
    finally:
        await conn.close()
    return len(rows) == 2 and all(r["status"] == "pending" and r["attempts"] == 1 for r in rows)
