"""The events' claim of an endpoints destination paced by the room its fast endpoints have
(EndpointsSink.claim_limit, relay/sinks/endpoints/at_once.py): it must never stall, and one
endpoint's backlog must not hold back the events of the others."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import asyncpg
import pytest
import uvloop
from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from relay.sinks.endpoints.at_once import FAN_OUT_AHEAD
from relay.sinks.endpoints.base import LOOK_EVERY, WAKE_COALESCE
from relay.sinks.endpoints.fan_outs import BACKLOG_HOLD
from tests.support.receiver import Receiver
from tests.support.relays import running, wait_until
from tests.test_endpoint_delivery import (
    DEST,
    SLOW_POLL,
    add_endpoint,
    aengine,  # noqa: F401  (fixture)
    delivered_to,
    endpoints_settings,
    enqueue,
    fetch,
)
from tests.test_endpoint_ops import endpoint
from tests.test_endpoint_source import pending as pending_rows
from tests.test_endpoint_source import served


async def test_events_are_claimed_when_one_event_has_more_deliveries_than_the_fast_queues(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    make_receiver: Callable[..., Receiver],
) -> None:
    """Twenty endpoints take every event, one fast and nineteen rate-limited (never sent at
    once): at max_concurrency 1 the fast one's queue is 16 deliveries, fewer than an event's
    20. The claim took int(16 // 20) = 0 events, for ever (found by review)."""
    fast = make_receiver()
    limited = [make_receiver() for _ in range(19)]
    await add_endpoint(aengine, fast.url)
    for r in limited:
        await add_endpoint(aengine, r.url, rate_limit=1000)
    async with running(endpoints_settings(db_url, max_concurrency=1)):
        [first] = await enqueue(db_url, [{"payload": {"n": 0}}])
        await wait_until(
            lambda: delivered_to(fast) == [first] and all(delivered_to(r) for r in limited),
            what="known fast",
        )
        [second] = await enqueue(db_url, [{"payload": {"n": 1}}])
        await wait_until(
            lambda: (
                delivered_to(fast) == [first, second]
                and all(delivered_to(r) == [first, second] for r in limited)
            ),
            timeout=10,
            what="the second event delivered",
        )


BACKLOG = (
    "WITH e AS (INSERT INTO outbox (destination, payload, content_type, status, attempts, "
    "delivered_at, tenant) SELECT $1, '{}', 'application/json', 'delivered', 1, now(), $3 "
    "FROM generate_series(1, $4) RETURNING id) "
    "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination) "
    "SELECT id, $2, $1 FROM e ORDER BY id"
)


async def _a_backlog(
    db_url: str, a: Receiver, b: Receiver, ep_a: int, count: int, served: int
) -> None:
    """A (tenant a) and B (tenant b) known to the running relay (an event each delivered),
    then ``count`` deliveries written for A at once, and ``served`` of them sent."""
    ids = await enqueue(db_url, [{"tenant": "a", "payload": {}}, {"tenant": "b", "payload": {}}])
    await wait_until(
        lambda: delivered_to(a) == ids[:1] and delivered_to(b) == ids[1:],
        what="both delivered",
    )
    await fetch(db_url, BACKLOG, DEST, ep_a, "a", count)
    await wait_until(lambda: len(a.requests) >= served, what="A's backlog served")


@pytest.mark.parametrize(
    ("rate_limit", "within"),
    # A fast endpoint of its own: waited for A's whole backlog (7 s; found by review). A
    # rate-limited one: while every fast endpoint has a backlog the claim is serving, the
    # events wait for it (claimed, their deliveries would only queue behind it), a second at
    # most.
    [(None, 2.0), (100, 2.5)],
    ids=["fast", "rate-limited"],
)
async def test_one_endpoints_backlog_holds_back_another_tenants_new_event_a_second_at_most(
    rate_limit: int | None,
    within: float,
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    make_receiver: Callable[..., Receiver],
) -> None:
    """Endpoint A (tenant a), fast, has a backlog of 150 deliveries (written while it was
    slow, or by another relay) that the claim serves at 20 a second. A new event for tenant
    b's endpoint is claimed meanwhile, not after A's whole backlog."""
    a, b = make_receiver(), make_receiver()
    a.respond(200, delay=0.05)
    ep_a = await add_endpoint(aengine, a.url, tenant="a")
    await add_endpoint(aengine, b.url, tenant="b", rate_limit=rate_limit)
    async with running(endpoints_settings(db_url, max_concurrency=1)):
        await _a_backlog(db_url, a, b, ep_a.id, 150, served=10)
        [new] = await enqueue(db_url, [{"tenant": "b", "payload": {"new": True}}])
        started = time.monotonic()
        await wait_until(lambda: new in delivered_to(b), timeout=30, what="B's new event")
        took = time.monotonic() - started
        left = await fetch(db_url, "SELECT 1 FROM outbox_deliveries WHERE status = 'pending'")
    assert took < within and left, (took, len(left))


async def test_finished_deliveries_look_now_and_then_and_claim_what_another_relay_left(
    db_url: str,
) -> None:
    """A finished delivery of an endpoint with nothing known to wait wakes no claim (they cost
    5 ms of planning and find nothing, deliveries being sent at their fan-out); but another
    relay may have written deliveries of it pending, which would then wait for the poll
    (found by review): every LOOK_EVERY a look (a few index probes) reads what was written
    since, and only what it finds wakes the claim."""
    async with served(db_url) as s:
        woken: list[float] = []
        s.source.on_due = lambda: woken.append(time.monotonic())
        await s.source.store._read_floors()  # read: nothing waits
        s.source._wake_soon(claim=False)
        await asyncio.sleep(WAKE_COALESCE * 3)
        assert woken == []  # looked: nothing pending
        assert s.source.store.store.statements["delivery_look"] == 1
        s.source._wake_soon(claim=False)
        await asyncio.sleep(WAKE_COALESCE * 3)
        assert s.source.store.store.statements["delivery_look"] == 1  # not before LOOK_EVERY
        # Another relay's fan-out could send nothing at once: its delivery waits, pending.
        [event] = await enqueue(db_url, [{"payload": {}}])
        await fetch(db_url, OTHERS_PENDING, event)
        await asyncio.sleep(LOOK_EVERY)
        s.source._wake_soon(claim=False)
        await asyncio.sleep(WAKE_COALESCE * 3)
        assert len(woken) == 1 and s.source.store.store.statements["delivery_look"] == 2
        s.source._wake_soon(claim=True)  # something of theirs waits: at once, no look
        await asyncio.sleep(WAKE_COALESCE * 3)
        assert len(woken) == 2 and s.source.store.store.statements["delivery_look"] == 2


def test_a_recheck_due_at_once_can_be_asked_for_again_under_uvloop(db_url: str) -> None:
    """uvloop hands a call due at once a handle without when(): asking for a recheck again
    before it ran raised AttributeError, in a finished delivery's wake-up (the events' claim,
    held back, then waited for the poll) or in the events' claim itself (found by `bench
    fanout --scenario steady`, which fell 15 s behind)."""

    async def main() -> None:
        async with served(db_url) as s:
            now = time.monotonic()
            s.source._recheck_room_at(now - 1)  # due at once
            s.source._recheck_room_at(now + 5)  # asked again before it ran: kept
            s.source._recheck_room_at(now - 2)
            await asyncio.sleep(0.05)
            assert s.source._recheck is None  # it ran

    uvloop.run(main())


async def test_a_look_that_fails_claims_instead_and_says_so_once(db_url: str) -> None:
    """A look the database refuses runs the claim it stands in for (which backs off and says
    what is wrong), and is logged once while it keeps failing, not ten times a second; a
    look under way when the relay halts is cancelled, and none starts after."""
    async with served(db_url) as s:
        woken: list[float] = []
        s.source.on_due = lambda: woken.append(time.monotonic())

        async def refused() -> bool:
            raise asyncpg.PostgresConnectionError("the server closed the connection")

        s.source.store.look = refused  # type: ignore[method-assign]
        with capture_logs() as logs:
            for _ in range(3):
                s.source._look_for_others()
                await asyncio.sleep(WAKE_COALESCE)
        assert len(woken) == 3
        said = [e for e in logs if e["event"] == "relay.endpoints.look_failed"]
        assert len(said) == 1 and "closed the connection" in said[0]["error"], logs

        async def slow() -> bool:
            await asyncio.sleep(30)
            return True

        s.source.store.look = slow  # type: ignore[method-assign]
        s.source._look_for_others()
        task = s.source._look_task
        assert task is not None
        s.source.halt()
        await asyncio.sleep(0)
        assert task.cancelled() and s.source._look_task is None
        s.source._look_for_others()
        assert s.source._look_task is None and len(woken) == 3


# A delivery of the event to a new endpoint, as another relay's fan-out writes one pending.
OTHERS_PENDING = (
    "WITH e AS (INSERT INTO outbox_endpoints (destination, url, secret)"
    " VALUES ('" + DEST + "', 'http://127.0.0.1:9/', 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw')"
    " RETURNING id)"
    " INSERT INTO outbox_deliveries (event_id, endpoint_id, destination)"
    " SELECT $1, e.id, '" + DEST + "' FROM e"
)


@pytest.mark.parametrize("other", ["rate-limited", "new"])
async def test_a_fast_endpoints_burst_of_events_holds_back_another_tenants_new_event(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    make_receiver: Callable[..., Receiver],
    other: str,
) -> None:
    """A fast endpoint with little room (max_concurrency 1, 50 ms a request) and a burst of
    150 events for it: paced by its room, the events waited in the table, and another
    tenant's new event behind them (7 s; found by review). They wait PACE_HOLD at most."""
    a, r = make_receiver(), make_receiver()
    a.respond(200, delay=0.05)
    await add_endpoint(aengine, a.url, tenant="a")
    if other == "rate-limited":
        await add_endpoint(aengine, r.url, tenant="r", rate_limit=100)
    async with running(endpoints_settings(db_url, max_concurrency=1)):
        [first] = await enqueue(db_url, [{"tenant": "a", "payload": {}}])
        if other == "rate-limited":
            [r0] = await enqueue(db_url, [{"tenant": "r", "payload": {}}])
            await wait_until(lambda: delivered_to(r) == [r0], what="r delivered")
        await wait_until(lambda: delivered_to(a) == [first], what="a known fast")
        if other == "new":
            await add_endpoint(aengine, r.url, tenant="r")
        await enqueue(db_url, [{"tenant": "a", "payload": {"n": i}} for i in range(150)])
        [new] = await enqueue(db_url, [{"tenant": "r", "payload": {"new": True}}])
        started = time.monotonic()
        await wait_until(lambda: new in delivered_to(r), timeout=30, what="r's new event")
        took = time.monotonic() - started
        sent_a = len(delivered_to(a))
    assert took < 2.5, f"r's event took {took:.1f} s, behind {sent_a - 1} of a's events"


async def test_a_fast_endpoints_burst_holds_back_a_slow_endpoints_new_event(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    make_receiver: Callable[..., Receiver],
) -> None:
    """Tenant s's endpoint is slow (0.3 s an answer, budget 0.2 s) but idle; tenant a's is
    fast (max_concurrency 1, 50 ms). A burst of 150 events for a, then one for s: the
    destination is paceable (the only other enabled endpoint is slow), so s's event waits in
    the table behind a's whole burst, though s has a free slot (found by the third review)."""
    a, s = make_receiver(), make_receiver()
    a.respond(200, delay=0.05)
    s.respond(200, delay=0.3)
    await add_endpoint(aengine, a.url, tenant="a")
    await add_endpoint(aengine, s.url, tenant="s")
    settings = endpoints_settings(
        db_url, max_concurrency=1, slow_concurrency=1, latency_budget=0.2, timeout=5
    )
    async with running(settings):
        ids = await enqueue(
            db_url, [{"tenant": "a", "payload": {}}, {"tenant": "s", "payload": {}}]
        )
        await wait_until(
            lambda: delivered_to(a) == ids[:1] and delivered_to(s) == ids[1:],
            what="a known fast, s known slow",
        )
        await asyncio.sleep(0.5)
        await enqueue(db_url, [{"tenant": "a", "payload": {"n": i}} for i in range(150)])
        [new] = await enqueue(db_url, [{"tenant": "s", "payload": {"new": True}}])
        started = time.monotonic()
        await wait_until(lambda: new in delivered_to(s), timeout=30, what="s's new event")
        took = time.monotonic() - started
        sent_a = len(delivered_to(a))
    assert took < 2.5, f"s's event took {took:.1f} s, behind {sent_a - 1} of a's events"


async def test_the_probe_hold_ends_without_waiting_for_the_poll(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    make_receiver: Callable[..., Receiver],
) -> None:
    """A fresh relay (no endpoint known): the claim takes one event (the probe) and holds the
    rest PROBE_HOLD (1 s) at most. The probe matched no endpoint, so no delivery is in flight
    and no finished delivery calls _woken_soon: nothing ends the hold but the next poll
    (poll_interval 10 s here; up to 300 s allowed) or a NOTIFY (found by the third review)."""
    r = make_receiver()
    await add_endpoint(aengine, r.url, tenant="t")
    async with running(endpoints_settings(db_url, SLOW_POLL)):
        await asyncio.sleep(1.0)
        started = time.monotonic()
        _, t_event = await enqueue(
            db_url, [{"tenant": "nobody", "payload": {}}, {"tenant": "t", "payload": {}}]
        )
        await wait_until(lambda: t_event in delivered_to(r), timeout=30, what="t's event")
        took = time.monotonic() - started
    assert took < 3.0, f"t's event took {took:.1f} s: held after the probe until the poll"


FILLER = (
    "INSERT INTO outbox_endpoints (destination, url, tenant, secret, description) "
    "SELECT $1, 'http://127.0.0.1:9/never/' || i, 'other-' || i, $2, 'filler' "
    "FROM generate_series(1, $3) AS i"
)


async def test_endpoints_no_waiting_event_matches_do_not_keep_the_claim_from_pacing(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    make_receiver: Callable[..., Receiver],
) -> None:
    """300 endpoints of other tenants beside one fast endpoint, none of them ever matched:
    not known to the relay, each kept the events from being paced (another tenant's event
    might wait behind the fast one's), so a burst was claimed whole and its deliveries written
    pending, claimed again one by one (the scale bench: 640 of 30,000 sent at their fan-out,
    PostgreSQL 1.9x the cost of 10 registered). The look ahead (FanOuts._look) reads whose
    events wait: theirs do not, so the burst is paced and sent at its fan-out."""
    from outbox import endpoint_secrets

    r = make_receiver()
    r.respond(200, delay=0.005)
    await add_endpoint(aengine, r.url, tenant="t")
    await fetch(db_url, FILLER, DEST, endpoint_secrets.generate(), 300)
    async with running(endpoints_settings(db_url, max_concurrency=2)) as relay:
        first = await enqueue(db_url, [{"tenant": "t", "payload": {}}])
        await wait_until(lambda: delivered_to(r) == first, what="known fast")
        [pipe] = [p for p in relay.pipes if p.name == "deliveries"]
        stats = pipe.source.stats
        ids = await enqueue(db_url, [{"tenant": "t", "payload": {"n": i}} for i in range(300)])
        await wait_until(
            lambda: delivered_to(r) == sorted(first + ids), timeout=30, what="delivered"
        )
    assert stats["sent_at_fan_out"] >= 270, stats


async def test_a_backlog_of_an_endpoint_answering_in_a_third_of_a_second_holds_nothing_back(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    make_receiver: Callable[..., Receiver],
) -> None:
    """Endpoint A answers in 0.3 s (well under its latency budget: not slow) and has a backlog
    it takes at 3 a second; holding the events back cannot make it take that any faster. Its
    backlog held every endpoint's new events a second in every eleven (a 2 s endpoint made
    the isolation benchmark's healthy p99 1.1 s): now only a quick endpoint's does."""
    a, b = make_receiver(), make_receiver()
    a.respond(200, delay=0.3)
    ep_a = await add_endpoint(aengine, a.url, tenant="a")
    await add_endpoint(aengine, b.url, tenant="b")
    async with running(endpoints_settings(db_url, max_concurrency=1)) as relay:
        [pipe] = [p for p in relay.pipes if p.name == "deliveries"]
        source = pipe.source
        await _a_backlog(db_url, a, b, ep_a.id, 30, served=3)
        queues, _ = source._queues(DEST)
        assert {q.endpoint_id: (q.backlog, q.quick) for q in queues}[ep_a.id] == (True, False)
        # No hold under way (one would start now for a backlog that holds the events back),
        # nor deliveries the claim has not read (they hold the events too).
        source._hold_since.pop(DEST, None)
        assert source.store.lanes.floors is not None and not source.store.behind
        # As many events as fit the others' room: none held back for A's sake.
        assert source.fan_out_fits(DEST, 100, claiming=False) != 0
        [new] = await enqueue(db_url, [{"tenant": "b", "payload": {"new": True}}])
        await wait_until(lambda: new in delivered_to(b), timeout=5, what="B's new event")
        left = await fetch(db_url, "SELECT 1 FROM outbox_deliveries WHERE status = 'pending'")
    assert left  # B's event went while A's backlog was still being served


async def test_an_endpoint_is_quick_within_the_hold_and_until_a_hold_leaves_its_backlog(
    db_url: str,
) -> None:
    """The plan's queues (FanOuts._queues): an endpoint is quick while its queue of
    FAN_OUT_AHEAD x max_concurrency answers within BACKLOG_HOLD (62.5 ms an answer), and not
    once a hold has left its backlog behind (FanOuts._judge_hold)."""
    ep = endpoint(db_url)
    pending_rows(db_url, ep, 1)
    async with served(db_url, max_in_flight=1000, max_concurrency=4) as s:
        state = await s.known_fast(ep)

        def quick(latency: float) -> bool:
            state.latency = latency
            [q] = s.source._queues(DEST)[0]
            return q.quick

        assert quick(0.06) and quick(BACKLOG_HOLD / FAN_OUT_AHEAD)
        assert not quick(0.07)
        s.source._outlasted.add(ep)
        assert not quick(0.01)
