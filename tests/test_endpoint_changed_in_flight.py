"""Rows a relay holds queued for an endpoint (claimed at their fan-out, or ahead of its free
request slots) when an operator disables or deletes the endpoint: none of them starts a
request from then on. A disabled endpoint keeps its queue (sent once it is enabled again); a
deleted one's deliveries end cancelled, never sent (docs/endpoints.md)."""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

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


@pytest.mark.parametrize("change", ["disable", "delete"])
async def test_a_queue_held_for_an_endpoint_disabled_or_deleted_is_not_sent(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    receiver: Receiver,
    change: str,
) -> None:
    """One request at a time (max_concurrency 1), 0.1 s each: a burst of 30 events is
    queued in the relay (sent at its fan-out, claimed ahead). The endpoint is disabled (or
    deleted) once the burst's second request came: the request in flight ends, and nothing
    queued behind it is sent (before, the whole queue went out, 16 requests and more, over
    the next seconds; the lease, 30 s, outlasts it, so no heartbeat stops it)."""
    receiver.respond(200, delay=0.1)
    ep = await add_endpoint(aengine, receiver.url)
    s = endpoints_settings(db_url, relay={"poll_interval": 0.2, "lease": 30}, max_concurrency=1)
    async with running(s):
        [first] = await enqueue(db_url, [{"payload": {"n": -1}}])
        await wait_until(lambda: first in delivered_to(receiver), what="its latency known")
        ids = await enqueue(db_url, [{"payload": {"n": i}} for i in range(30)])
        await wait_until(lambda: len(receiver.requests) >= 3, what="the burst under way")
        async with aengine.begin() as conn:
            if change == "disable":
                await outbox.endpoints.disable(conn, ep.id)
            else:
                await outbox.endpoints.delete(conn, ep.id)
        changed_at = time.monotonic()
        at_change = len(receiver.requests)
        await asyncio.sleep(4.0)  # the queue, sent, would have gone in 1.6 s
        after = len(receiver.requests) - at_change
        rows = await fetch(
            db_url, "SELECT status FROM outbox_deliveries WHERE event_id = ANY($1)", ids
        )
    # At most the request in flight and one starting as the change landed.
    assert after <= 2, (
        f"{after} requests sent to endpoint {ep.id} in the "
        f"{time.monotonic() - changed_at:.1f} s after it was {change}d"
    )
    statuses = {r["status"] for r in rows}
    if change == "disable":
        # Its queue is kept: what was not sent waits, pending, for it to be enabled again.
        assert "pending" in statuses and "running" not in statuses, statuses
    else:
        # None held any more. A fan-out under way as the endpoint was deleted (its snapshot
        # from before) may have written a few pending: the claim's sweep of deleted
        # endpoints cancels those later, and none of them is sent (counted above).
        assert "running" not in statuses, statuses


@pytest.mark.parametrize("change", ["tenant", "event_types"])
async def test_a_queue_held_for_an_endpoint_that_no_longer_takes_its_events_is_not_sent(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    receiver: Receiver,
    change: str,
) -> None:
    """As above, the endpoint handed over to another tenant, or narrowed to other event
    types, while the relay holds a queue of its deliveries: none of it is sent from then on
    (each ends cancelled, "no longer takes"). Before, the check at sending compared with the
    tenant and types the endpoint's last claim read, so the whole queue went out under the
    old owner's (found by review)."""
    receiver.respond(200, delay=0.1)
    ep = await add_endpoint(aengine, receiver.url, tenant="acme", event_types=["order.created"])
    s = endpoints_settings(db_url, relay={"poll_interval": 0.2, "lease": 30}, max_concurrency=1)
    event = {"tenant": "acme", "event_type": "order.created"}
    async with running(s):
        [first] = await enqueue(db_url, [{**event, "payload": {"n": -1}}])
        await wait_until(lambda: first in delivered_to(receiver), what="its latency known")
        ids = await enqueue(db_url, [{**event, "payload": {"n": i}} for i in range(30)])
        await wait_until(lambda: len(receiver.requests) >= 3, what="the burst under way")
        async with aengine.begin() as conn:
            if change == "tenant":
                await outbox.endpoints.update(conn, ep.id, tenant="globex")
            else:
                await outbox.endpoints.update(conn, ep.id, event_types=["order.paid"])
        at_change = len(receiver.requests)
        await asyncio.sleep(4.0)  # the queue, sent, would have gone in 1.6 s
        after = len(receiver.requests) - at_change
        rows = await fetch(
            db_url, "SELECT status FROM outbox_deliveries WHERE event_id = ANY($1)", ids
        )
    assert after <= 2, f"{after} requests sent after the endpoint's {change} changed"
    statuses = {r["status"] for r in rows}
    assert "cancelled" in statuses and not statuses & {"pending", "running"}, statuses
