"""The endpoints' deliveries as a source of the relay's pipeline (DeliverySource), not yet
wired into the relay: claimed, held in the pipeline's own Leases, sent through the real
request path to loopback receivers, and recorded by the pipeline's Completer, against a real
database. The rows are written as the relay leaves them (tests/test_endpoint_ops.py helpers)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from outbox.dburl import to_asyncpg_dsn
from outbox.endpoint_secrets import SecretBox
from relay.db.store import Store, create_pool
from relay.obs.metrics import Metrics
from relay.pipeline.leases import Leases
from relay.runtime.pipes import Pipe
from relay.sinks.endpoints.config import EndpointsDestination
from relay.sinks.endpoints.source import DeliverySource
from relay.sinks.endpoints.state import EndpointState
from relay.sinks.endpoints.store import Claimed, DeliveryRecord, DeliveryStore
from relay.sinks.source import Source
from relay.sinks.webhook.config import WebhookClientSettings
from relay.sinks.webhook.requests import RequestPath
from tests.support.receiver import Receiver
from tests.support.relays import wait_until
from tests.test_endpoint_ops import DEST, delivery, endpoint, event, sql

LEASE = 30.0


class Served:
    """A DeliverySource with the pipeline's parts for it: its Leases and its Pipe's
    Completer; ``emitted`` keeps each outcome with the time it was handed over."""

    def __init__(self, source: DeliverySource) -> None:
        self.source = source
        self.leases: Leases[Claimed] = Leases(Metrics(), Counter())
        self.pipe: Pipe[Claimed] = Pipe("deliveries", source, self.leases)
        self.emitted: list[tuple[DeliveryRecord, float]] = []

    def emit(self, record: DeliveryRecord, c: Claimed) -> None:
        self.emitted.append((record, time.monotonic()))
        self.leases.handed([c])
        self.pipe.completer.add([record])

    async def claim(self, limit: int = 100) -> list[Claimed]:
        items = list(await self.source.claim(limit, self.leases))
        self.leases.claimed(items)
        return items

    async def deliver(self, items: list[Claimed]) -> None:
        """Send them group by group, as the pipeline would, and write their outcomes."""
        groups: dict[int, list[Claimed]] = {}
        for c in items:
            groups.setdefault(self.source.group(c), []).append(c)
        await asyncio.gather(*(self.source.deliver(g, self.emit) for g in groups.values()))
        assert await self.pipe.completer.flush_once()

    async def known_fast(self, endpoint_id: int) -> EndpointState:
        """The state of ``endpoint_id``, which has one delivery pending, once this source has
        sent it (no receiver: it fails) and then taken the endpoint for fast (10 ms), its
        circuit left out; with a pipeline to hand what fan-outs claim to (which does nothing)."""
        self.source.adopt = lambda items: None
        [c] = await self.claim(1)
        await self.deliver([c])
        state = self.source.states[endpoint_id]
        state.latency = 0.01
        state.endpoint = None  # no circuit (the failure's) to keep it out
        return state


@asynccontextmanager
async def served(
    db_url: str, relay_id: str = "r1", max_in_flight: int = 100, **dest: Any
) -> AsyncIterator[Served]:
    cfg = EndpointsDestination.model_validate(
        {
            "kind": "endpoints",
            "allow_private_networks": True,
            "max_attempts": 4,
            "backoff": {"schedule": [0.3], "jitter": 0},
            "circuit": {"threshold": 50},
            # New endpoints start at slow_concurrency: here as many as max_concurrency.
            "max_concurrency": 10,
            "slow_concurrency": 10,
            **dest,
        }
    )
    pool = await create_pool(to_asyncpg_dsn(db_url), relay_id, 2)
    requests = RequestPath(WebhookClientSettings())
    source = DeliverySource(
        DeliveryStore(Store(pool, "public", relay_id, LEASE)),
        requests,
        {DEST: cfg},
        max_in_flight=max_in_flight,
        secret_box=SecretBox(None),
    )
    checked: Source[Claimed] = source  # what the pipeline takes (mypy checks relay/ only)
    assert checked.name == "deliveries"
    try:
        yield Served(source)
    finally:
        await requests.close()
        await pool.close()


def pending(db_url: str, endpoint_id: int, count: int = 1) -> list[int]:
    """Deliveries due now to ``endpoint_id``, of events made for them (the first rows of a
    fresh database: event ids are made to differ from delivery ids, so that a check under
    the wrong id shows)."""
    events = [event(db_url) for _ in range(count)]
    sql(
        db_url,
        "SELECT setval('outbox_deliveries_id_seq', greatest(1000 + (SELECT max(id) FROM outbox),"
        " (SELECT last_value FROM outbox_deliveries_id_seq)))",
    )
    return [delivery(db_url, e, endpoint_id, "pending", attempts=0) for e in events]


def rows(db_url: str) -> dict[int, tuple[str, int, int]]:
    """Delivery id -> (status, attempts, claims)."""
    got = sql(db_url, "SELECT id, status, attempts, claims FROM outbox_deliveries")
    return {r[0]: (r[1], r[2], r[3]) for r in got}


def sent(receiver: Receiver) -> list[int]:
    return sorted(int(r.headers["webhook-id"]) for r in receiver.requests)


async def test_claimed_deliveries_are_sent_and_recorded_through_the_pipeline(
    db_url: str, receiver: Receiver
) -> None:
    ep = endpoint(db_url, url=receiver.url)
    ids = pending(db_url, ep, 3)
    async with served(db_url) as s:
        items = await s.claim()
        assert sorted(c.id for c in items) == ids
        assert all(c.id != c.event_id for c in items)
        assert s.source.states[ep].in_hand == 3
        await s.deliver(items)
        assert len(s.leases) == 0
        assert s.source.states[ep].in_hand == 0
        assert s.leases.stats["delivered"] == 3
    assert sent(receiver) == sorted(c.event_id for c in items)
    assert {i: r[0] for i, r in rows(db_url).items()} == dict.fromkeys(ids, "delivered")
    logged = sql(db_url, "SELECT delivery_id, http_status FROM outbox_attempts")
    assert sorted(logged) == [(i, 200) for i in ids]


async def test_each_outcome_is_handed_on_as_it_ends(db_url: str, receiver: Receiver) -> None:
    """Two deliveries of one endpoint, one group: the first request is slow. The other is
    sent beside it and its outcome handed on while the slow one is still in flight."""
    ep = endpoint(db_url, url=receiver.url)
    pending(db_url, ep, 2)
    receiver.respond(200, delay=1.0, times=1)
    async with served(db_url, max_concurrency=2, slow_concurrency=2) as s:
        items = await s.claim()
        assert len(items) == 2
        started = time.monotonic()
        await s.deliver(items)
    ends = sorted(t - started for _, t in s.emitted)
    assert len(ends) == 2
    assert ends[0] < 0.5 <= 1.0 <= ends[1], ends
    assert {r.status for r, _ in s.emitted} == {"delivered"}


async def test_a_lost_lease_is_not_sent(db_url: str, receiver: Receiver) -> None:
    """The row was taken back and claimed by another relay: the heartbeat finds it gone, and
    the delivery (id unlike its event's) is not sent; its outcome does not touch the row."""
    ep = endpoint(db_url, url=receiver.url)
    [i] = pending(db_url, ep)
    async with served(db_url) as s:
        [c] = await s.claim()
        assert c.id != c.event_id
        sql(
            db_url,
            "UPDATE outbox_deliveries SET locked_by = 'r2', claims = claims + 1 WHERE id = %s",
            i,
        )
        await s.leases.heartbeat(s.source, LEASE)
        assert len(s.leases) == 0 and s.leases.stats["lease_lost"] == 1
        await s.deliver([c])
    assert receiver.requests == []
    [(record, _)] = s.emitted
    assert (record.status, record.counted) == ("pending", 0)
    assert rows(db_url)[i] == ("running", 0, 2)  # the other relay's claim, untouched


async def test_a_stale_outcome_does_not_release_a_newer_claim(
    db_url: str, receiver: Receiver
) -> None:
    """A stall past the lease: the delivery is reaped and claimed again by this relay. The
    first claim is lost (never sent) and its outcome is not written; the newer claim stays
    held until its own outcome is."""
    ep = endpoint(db_url, url=receiver.url)
    [i] = pending(db_url, ep)
    async with served(db_url) as s:
        [old] = await s.claim()
        sql(db_url, "UPDATE outbox_deliveries SET locked_until = now() - interval '1 s'")
        assert await s.source.reap(4, {DEST: 4}) == 1
        [new] = await s.claim()
        assert (old.id, old.token, new.token) == (i, 1, 2)
        assert list(s.leases) == [new]
        await s.deliver([old])
        assert receiver.requests == []
        assert list(s.leases) == [new]  # the stale outcome released nothing
        assert rows(db_url)[i] == ("running", 1, 2)
        await s.deliver([new])
        assert len(s.leases) == 0
    assert sent(receiver) == [new.event_id]
    assert rows(db_url)[i] == ("delivered", 2, 2)


async def test_a_delivery_that_keeps_crashing_fails_at_its_attempt_limit(
    db_url: str, receiver: Receiver
) -> None:
    """max_attempts 4: a crash at its second attempt retries it; at its fourth, fails it.
    Written by the pipeline's Completer, the attempts counted and logged."""
    ep = endpoint(db_url, url=receiver.url)
    [young, old] = pending(db_url, ep, 2)
    sql(db_url, "UPDATE outbox_deliveries SET attempts = 3 WHERE id = %s", old)
    async with served(db_url) as s:
        items = await s.claim()
        for c in items:
            s.emit(s.source.crashed(c, RuntimeError("bug")), c)
        assert await s.pipe.completer.flush_once()
        assert len(s.leases) == 0
    got = rows(db_url)
    assert got[young] == ("pending", 1, 1)
    assert got[old] == ("failed", 4, 1)
    [(error,)] = sql(db_url, "SELECT last_error FROM outbox_deliveries WHERE id = %s", old)
    assert "gave up after 4 attempts" in error and "bug" in error
    assert receiver.requests == []


async def test_an_open_circuit_keeps_its_endpoint_out_of_the_claim(
    db_url: str, make_receiver: Any
) -> None:
    """circuit threshold 1: endpoint A answers 503 and its circuit opens; the next claim
    takes B's delivery and none of A's."""
    a, b = make_receiver(), make_receiver()
    a.respond(503)
    ep_a, ep_b = endpoint(db_url, url=a.url), endpoint(db_url, url=b.url)
    [first] = pending(db_url, ep_a)
    async with served(db_url, circuit={"threshold": 1, "cooldown": 60}) as s:
        await s.deliver(await s.claim())
        assert s.source.states[ep_a].circuit_open
        assert rows(db_url)[first][0] == "pending"
        sql(db_url, "UPDATE outbox_deliveries SET run_after = now()")
        more = pending(db_url, ep_a, 2) + pending(db_url, ep_b)
        items = await s.claim()
        assert [c.endpoint_id for c in items] == [ep_b]
        assert items[0].id == more[-1]
        await s.deliver(items)
        [(opened,)] = sql(
            db_url, "SELECT circuit_open_until FROM outbox_endpoints WHERE id = %s", ep_a
        )
        assert opened is not None  # written after the record, for `status`
    assert len(a.requests) == 1 and len(b.requests) == 1


async def test_when_room_is_short_endpoints_not_yet_known_fast_wait_for_their_first_answers(
    db_url: str, make_receiver: Any
) -> None:
    """max_in_flight 10: 8 deliveries of A and B held, none answered yet. The last two slots
    are the fair share's reserve: the claim leaves A and B out (their first requests may be
    slow ones) and gives one to C."""
    a, b, c = make_receiver(), make_receiver(), make_receiver()
    ep_a, ep_b, ep_c = (endpoint(db_url, url=r.url) for r in (a, b, c))
    pending(db_url, ep_a, 5)
    pending(db_url, ep_b, 3)
    async with served(db_url, max_in_flight=10) as s:
        held = await s.claim(10)
        assert Counter(x.endpoint_id for x in held) == {ep_a: 5, ep_b: 3}
        pending(db_url, ep_a, 2)
        pending(db_url, ep_b, 2)
        [to_c] = pending(db_url, ep_c, 1)
        items = await s.claim(1)
        assert [(x.id, x.endpoint_id) for x in items] == [(to_c, ep_c)]
        await s.source.release(s.leases.tokens())
        assert all(st.in_hand == 0 for st in s.source.states.values())
    assert {r[0] for r in rows(db_url).values()} == {"pending"}


async def test_a_wake_makes_the_source_due_until_it_is_claimed(db_url: str) -> None:
    async with served(db_url) as s:
        woken: list[bool] = []
        s.source.on_due = lambda: woken.append(True)
        assert s.source.due  # nothing claimed yet
        assert await s.claim() == []
        assert not s.source.due
        s.source.wake()
        assert s.source.due and woken == [True]


async def test_a_stop_that_cuts_requests_short_counts_them_as_attempts(
    db_url: str, receiver: Receiver
) -> None:
    """A group's requests are in flight when the stop cancels it: nothing is emitted, the
    endpoint's hand is empty again, and each cut short is recorded as an attempt (it may have
    reached the endpoint), retried later; a delivery whose request never started has none."""
    ep = endpoint(db_url, url=receiver.url)
    ids = pending(db_url, ep, 2)
    receiver.respond(200, delay=3.0)
    async with served(db_url, max_concurrency=2, slow_concurrency=2) as s:
        items = await s.claim()
        assert all(s.source.cut_short(c) is None for c in items)
        task = asyncio.create_task(s.source.deliver(items, s.emit))
        await wait_until(lambda: all(c.sending for c in items), what="requests in flight")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert s.emitted == [] and s.source.states[ep].in_hand == 0
        cut = [s.source.cut_short(c) for c in items]
        s.pipe.completer.add([r for r in cut if r is not None])
        assert await s.pipe.completer.flush_once()
        assert len(s.leases) == 0
    assert {i: r[:2] for i, r in rows(db_url).items()} == dict.fromkeys(ids, ("pending", 1))
    logged = sql(db_url, "SELECT delivery_id, error FROM outbox_attempts ORDER BY delivery_id")
    assert [i for i, _ in logged] == ids
    assert all("stopped during the request" in e for _, e in logged)


async def test_an_endpoint_that_answered_410_is_left_out_of_the_claim_at_once(
    db_url: str, make_receiver: Any
) -> None:
    """A answers 410 Gone: before its outcome (and the disabling) is written, the next claim
    already leaves A out and takes B's; once written, A is disabled and still left out, its
    delivery kept pending."""
    a, b = make_receiver(), make_receiver()
    a.respond(410)
    ep_a, ep_b = endpoint(db_url, url=a.url), endpoint(db_url, url=b.url)
    [gone] = pending(db_url, ep_a)
    async with served(db_url) as s:
        [c] = await s.claim()
        await s.source.deliver([c], s.emit)
        assert s.source.states[ep_a].gone
        more = pending(db_url, ep_a, 1) + pending(db_url, ep_b, 1)
        items = await s.claim()
        assert [x.id for x in items] == more[1:]
        await s.deliver(items)
        [(enabled,)] = sql(db_url, "SELECT enabled FROM outbox_endpoints WHERE id = %s", ep_a)
        assert enabled is False
        sql(db_url, "UPDATE outbox_deliveries SET run_after = now()")
        assert await s.claim() == []
    assert rows(db_url)[gone] == ("pending", 1, 1)
    assert len(a.requests) == 1 and len(b.requests) == 1


async def test_a_worker_that_raises_stops_its_groups_other_sends(
    db_url: str, receiver: Receiver
) -> None:
    """A bug outside an attempt (here: handing an outcome on raises) ends the group: the
    pipeline then records the rows left as crashed, so none of them may still go out after
    that (it would be sent under a record that says it was not)."""
    ep = endpoint(db_url, url=receiver.url)
    pending(db_url, ep, 6)
    # One answer comes first and its hand-on raises while the other worker's request is still
    # out: with the same delay for both, the other's answer could come in the same loop turn,
    # and that worker start its next request before the group is cancelled (sent before the
    # raise, a duplicate later, which at-least-once allows; not what this test is about).
    receiver.respond(200, delay=0.05, times=1)
    receiver.respond(200, delay=0.5)
    async with served(db_url, max_concurrency=6, slow_concurrency=6) as s:
        items = await s.claim()
        assert len(items) == 6
        # Sent by two workers (its destination's max_concurrency once claimed).
        cfg = s.source.destinations[DEST]
        s.source.destinations[DEST] = cfg.model_copy(update={"max_concurrency": 2})

        calls: list[int] = []

        def emit(record: DeliveryRecord, c: Claimed) -> None:
            calls.append(c.id)
            if len(calls) == 1:  # once: the other worker would go on sending
                raise RuntimeError("a bug handing an outcome on")

        with pytest.raises(RuntimeError, match="a bug handing"):
            await s.source.deliver(items, emit)
        await asyncio.sleep(0.8)  # past the other worker's answer, had it not been cut
        assert len(receiver.requests) == 2  # the two workers' first requests only
        assert s.source.states[ep].in_hand == 0
