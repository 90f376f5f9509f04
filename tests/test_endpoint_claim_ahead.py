"""Claim ahead (#29 C6, CLAIM_AHEAD in relay/sinks/endpoints/base.py): a hostile review found
four ways in which claiming four times a fast endpoint's room broke a guarantee. Each is a test
here that failed with claiming ahead on before its fix: a concurrent claim of another relay
(rows ahead kept only where none of the endpoint's picked rows was skipped as locked), a small
batch (every endpoint's room before any row ahead), an endpoint that turns slow (a row put
back once it holds slow_concurrency requests), and a stop (no queued row started)."""

from __future__ import annotations

import asyncio
import time

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.dburl import to_asyncpg_dsn
from relay.db.store import Store, create_pool
from relay.sinks.endpoints.fairness import UNCAPPED
from relay.sinks.endpoints.store import DeliveryStore
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
from tests.test_endpoint_ops import DEST, delivery, endpoint, event


async def test_a_concurrent_claim_of_another_relay_is_not_outrun_by_claiming_ahead(
    db_url: str,
) -> None:
    """Two relays claim one endpoint at the same instant, neither seeing the other's rows
    running. Before C6 both picked the same first rows (room - running), so SKIP LOCKED left
    the second one only what the first did not take: together at most max_concurrency.
    Claiming ahead, the second picks 4x the room and keeps everything past the first's rows:
    relay A (which knows the endpoint only at its start cap, 1) sends 1 while B sends 4."""
    ep = endpoint(db_url)
    ids = [delivery(db_url, event(db_url), ep, "pending") for _ in range(30)]
    a = await asyncpg.connect(to_asyncpg_dsn(db_url))
    pool = await create_pool(to_asyncpg_dsn(db_url), "b", 2)
    try:
        async with a.transaction():
            # Relay A's claim, not yet committed: its room (start cap 1) is the oldest row.
            await a.execute(
                "UPDATE outbox_deliveries SET status = 'running', locked_by = 'a', "
                "locked_until = now() + interval '30 s', claims = claims + 1 WHERE id = $1",
                ids[0],
            )
            store = DeliveryStore(Store(pool, "public", "b", 30.0))
            claimed, _, _ = await store.claim(
                [DEST], [4], [1], 500, [], 1000, None, {ep: UNCAPPED}, (), 4
            )
    finally:
        await a.close()
        await pool.close()
    # A sends 1; B may not send more than max_concurrency less that one.
    assert len(claimed) <= 3, len(claimed)


async def test_a_claim_too_small_for_every_endpoints_room_does_not_give_it_to_one_ahead(
    db_url: str,
) -> None:
    """The claim's batch (the relay's free capacity, less the reserve) is filled in endpoint
    order: claiming ahead, the first fast endpoint takes it all (queued behind its own
    request slots, not in flight) and the next ones none, where before each had its room."""
    eps = [endpoint(db_url) for _ in range(3)]
    for ep in eps:
        for _ in range(30):
            delivery(db_url, event(db_url), ep, "pending")
    caps = dict.fromkeys(eps, UNCAPPED)
    pool = await create_pool(to_asyncpg_dsn(db_url), "ahead", 2)
    try:
        store = DeliveryStore(Store(pool, "public", "ahead", 30.0))
        claimed, _, _ = await store.claim([DEST], [4], [1], 12, [], 1000, None, caps, (), 4)
    finally:
        await pool.close()
    per = {ep: sum(1 for c in claimed if c.endpoint_id == ep) for ep in eps}
    assert per == dict.fromkeys(eps, 4), per  # 2158a87: {first: 12, second: 0, third: 0}


def _max_overlap(spans: list[tuple[float, float]]) -> int:
    points = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    best = now = 0
    for _, step in points:
        now += step
        best = max(best, now)
    return best


async def test_an_endpoint_that_turns_slow_is_held_to_slow_concurrency_after_its_first_round(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    receiver: Receiver,
) -> None:
    """Known fast, then slow (past latency_budget): before C6 its next requests went at
    slow_concurrency once the round claimed while it looked fast ended. Claimed ahead, the 12
    rows queued behind that round are all sent at max_concurrency: 4 rounds of 4, not 1."""
    await add_endpoint(aengine, receiver.url)
    s = endpoints_settings(
        db_url, max_concurrency=4, slow_concurrency=1, latency_budget=0.2, timeout=5
    )
    async with running(s):
        [first] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: delivered_to(receiver) == [first], what="known fast")
        receiver.respond(200, delay=0.6)
        await enqueue(db_url, [{"payload": {"n": i}} for i in range(16)])
        await wait_until(lambda: len(delivered_to(receiver)) == 17, timeout=30, what="sent")
    slow = sorted((r for r in receiver.requests[1:]), key=lambda r: r.at)
    first_round_done = max(r.done for r in slow[:4] if r.done is not None)
    later = [(r.at, r.done) for r in slow[4:] if r.at > first_round_done + 0.05]
    assert later, "every request went out in the first round"
    assert _max_overlap([(a, d) for a, d in later if d is not None]) <= 1


async def test_a_stop_starts_no_request_of_deliveries_queued_behind_the_slots(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    receiver: Receiver,
) -> None:
    """A stop waits for the requests in flight; deliveries claimed but not started are
    released unattempted. Claimed ahead, the rows waiting in the endpoint's request slots are
    still started after the stop (each worker pops the next), one round after another until
    shutdown_timeout, and the last ones cut short count an attempt."""
    await add_endpoint(aengine, receiver.url)
    s = endpoints_settings(db_url, max_concurrency=2, slow_concurrency=2, timeout=5)
    s = s.model_copy(update={"relay": s.relay.model_copy(update={"shutdown_timeout": 5})})
    async with running(s) as relay:
        [first] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: delivered_to(receiver) == [first], what="known fast")
        receiver.respond(200, delay=0.5)
        await enqueue(db_url, [{"payload": {"n": i}} for i in range(8)])
        await wait_until(lambda: len(receiver.requests) >= 3, what="sending")
        stopped = time.monotonic()
        relay.stop()
        await asyncio.sleep(0)
    started_after = [r for r in receiver.requests if r.at > stopped + 0.05]
    rows = await fetch(db_url, "SELECT status, attempts FROM outbox_deliveries")
    assert started_after == [], f"{len(started_after)} requests started after the stop"
    assert sum(1 for r in rows if r["status"] == "pending" and r["attempts"] == 0) >= 4
