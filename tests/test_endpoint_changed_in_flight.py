"""Rows a relay holds queued for an endpoint (claimed at their fan-out, or ahead of its free
request slots) when an operator disables or deletes the endpoint: none of them starts a
request from then on. A disabled endpoint keeps its queue (sent once it is enabled again); a
deleted one's deliveries end cancelled, never sent (docs/endpoints.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

import outbox
from tests.support.receiver import Receiver
from tests.support.relays import running, wait_until
from tests.test_endpoint_delivery import (
    add_endpoint,
    aengine,  # noqa: F401  (fixture)
    delivered_to,
    endpoints_settings,
    enqueue,
    fetch,
)
from tests.test_endpoint_ops import DEST, URL, endpoint, sql
from tests.test_endpoint_sending import claimed
from tests.test_endpoint_source import served


async def _burst_then(
    db_url: str,
    engine: AsyncEngine,
    receiver: Receiver,
    change: Callable[[AsyncConnection], Awaitable[object]],
    event: dict[str, object],
) -> tuple[int, set[str]]:
    """One request at a time (max_concurrency 1), 0.1 s each: a burst of 30 events is
    queued in the relay (sent at its fan-out, claimed ahead), and ``change`` made to the
    endpoint once the burst's second request came. The lease, 30 s, outlasts the queue, so
    no heartbeat stops it. Returns how many requests came after the change (4 s: the queue,
    sent, would have gone in 1.6) and the burst's delivery statuses."""
    receiver.respond(200, delay=0.1)
    s = endpoints_settings(db_url, relay={"poll_interval": 0.2, "lease": 30}, max_concurrency=1)
    async with running(s):
        [first] = await enqueue(db_url, [{**event, "payload": {"n": -1}}])
        await wait_until(lambda: first in delivered_to(receiver), what="its latency known")
        ids = await enqueue(db_url, [{**event, "payload": {"n": i}} for i in range(30)])
        await wait_until(lambda: len(receiver.requests) >= 3, what="the burst under way")
        async with engine.begin() as conn:
            await change(conn)
        at_change = len(receiver.requests)
        await asyncio.sleep(4.0)
        after = len(receiver.requests) - at_change
        rows = await fetch(
            db_url, "SELECT status FROM outbox_deliveries WHERE event_id = ANY($1)", ids
        )
    return after, {r["status"] for r in rows}


@pytest.mark.parametrize("change", ["disable", "delete"])
async def test_a_queue_held_for_an_endpoint_disabled_or_deleted_is_not_sent(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    receiver: Receiver,
    change: str,
) -> None:
    """The endpoint disabled (or deleted) while the relay holds a queue of its deliveries:
    the request in flight ends, and nothing queued behind it is sent (before, the whole
    queue went out, 16 requests and more, over the next seconds)."""
    ep = await add_endpoint(aengine, receiver.url)
    api = outbox.endpoints.disable if change == "disable" else outbox.endpoints.delete
    after, statuses = await _burst_then(
        db_url, aengine, receiver, lambda conn: api(conn, ep.id), {}
    )
    # At most the request in flight and one starting as the change landed.
    assert after <= 2, f"{after} requests sent to endpoint {ep.id} after it was {change}d"
    if change == "disable":
        # Its queue is kept: what was not sent waits, pending, for it to be enabled again.
        assert "pending" in statuses and "running" not in statuses, statuses
    else:
        # None held any more. A fan-out under way as the endpoint was deleted (its snapshot
        # from before) may have written a few pending: the claim's sweep of deleted
        # endpoints cancels those later, and none of them is sent (counted above).
        assert "cancelled" in statuses and "running" not in statuses, statuses


@pytest.mark.parametrize("change", ["tenant", "event_types"])
async def test_a_queue_held_for_an_endpoint_that_no_longer_takes_its_events_is_not_sent(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    receiver: Receiver,
    change: str,
) -> None:
    """As above, the endpoint handed over to another tenant, or narrowed to other event
    types: none of its queue is sent from then on (each ends cancelled, "no longer takes").
    Before, the check at sending compared with the tenant and types the endpoint's last
    claim read, so the whole queue went out under the old owner's (found by review)."""
    ep = await add_endpoint(aengine, receiver.url, tenant="acme", event_types=["order.created"])
    new: dict[str, object] = (
        {"tenant": "globex"} if change == "tenant" else {"event_types": ["order.paid"]}
    )
    after, statuses = await _burst_then(
        db_url,
        aengine,
        receiver,
        lambda conn: outbox.endpoints.update(conn, ep.id, **new),  # type: ignore[arg-type]
        {"tenant": "acme", "event_type": "order.created"},
    )
    assert after <= 2, f"{after} requests sent after the endpoint's {change} changed"
    assert "cancelled" in statuses and not statuses & {"pending", "running"}, statuses


async def test_an_older_read_of_an_endpoint_never_puts_back_what_a_newer_one_saw(
    db_url: str,
) -> None:
    """The enabled endpoints' read and the claims each bring the endpoint's tenant; one that
    began earlier (an older snapshot) and ends later must not put back the old tenant: the
    new owner's deliveries would then end cancelled, never sent (found in the last read of
    the change). Whichever read began last wins, in either order."""
    ep = endpoint(db_url)
    sql(db_url, "UPDATE outbox_endpoints SET tenant = 'newest' WHERE id = %s", ep)
    async with served(db_url) as s:
        source = s.source
        old = replace(claimed(URL, "old", "old"), endpoint_id=ep, destination=DEST)
        # Claims that began before the read: the read's tenant wins, even over one that
        # ends after it.
        state = source._state(replace(old, lease_started=time.monotonic() - 10))
        await source._read_enabled()
        assert state.tenant == "newest"
        source._state(replace(old, lease_started=time.monotonic() - 5))
        assert state.tenant == "newest"
        # A claim that began after the read (it saw a newer tenant): a read begun before it
        # that ends later leaves its tenant.
        source._state(replace(old, tenant="newer still", lease_started=time.monotonic() + 60))
        await source._read_enabled()
        assert state.tenant == "newer still"


async def test_a_read_begun_after_a_claim_with_an_older_snapshot_cancels_nothing_it_takes(
    db_url: str,
) -> None:
    """The reads are ordered by when they began on this side (the claim: once
    its lock was held; the enabled read: before it even has a connection), not by their
    snapshots. A claim that held its lock just before the NOTIFY read (one asked for by an
    earlier change) began can take its snapshot after that read's, across a hand-over: the
    claim saw the new owner and claimed its deliveries, the read saw the old one and wins.
    The new owner's deliveries ended cancelled, never sent (found by review). Now a delivery
    its own claim says the endpoint takes goes back in its place, and the next claim decides.
    Modelled here: the table still says the old owner (the read's snapshot), the claim
    carries the new one."""
    ep = endpoint(db_url)
    sql(db_url, "UPDATE outbox_endpoints SET tenant = 'acme' WHERE id = %s", ep)
    async with served(db_url) as s:
        source = s.source
        c = replace(
            claimed(URL, "globex", "globex"),
            endpoint_id=ep,
            destination=DEST,
            lease_started=time.monotonic() - 0.001,
        )
        state = source._state(c)
        await source._read_enabled()
        rec = source._not_sendable(c, state, None)
        assert rec is None or rec.status != "cancelled", rec
