"""Deliveries claimed by their fan-out (FAN_OUT's :room_ids): written running under this
relay's lease and handed to the pipeline, with no claim statement and no pending version; only
for endpoints where nothing else goes first and no limit is passed; and, against another
relay's claims, under the in-flight lock."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import SimpleNamespace

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.dburl import to_asyncpg_dsn
from relay.db import queries
from relay.db.pool import create_pool
from relay.db.queries import serial_key
from relay.db.queries.render import render_ops
from relay.db.store import Store
from relay.ops.replay_queries import REPLAY_EVENT_INSERT
from relay.sinks.endpoints.at_once import FAN_OUT_AHEAD
from relay.sinks.endpoints.store import DeliveryRecord, DeliveryStore
from relay.tools.bench.common import DESTINATION
from relay.tools.bench.fanout import _delivered
from relay.tools.bench.fanout_setup import add_events
from relay.tools.bench.fanout_sql import PROBE_CLAIM_ALL
from tests.support.fan_outs import (  # noqa: F401  (fixtures)
    LEASE,
    conn_fixture,
    endpoints_fixture,
    store_fixture,
)
from tests.support.receiver import Receiver
from tests.support.relays import running, wait_until
from tests.test_delivery_lanes import ROOM, _claim_all, _hold
from tests.test_endpoint_delivery import (
    SLOW_POLL,
    add_endpoint,
    aengine,  # noqa: F401  (fixture)
    delivered_to,
    deliveries_done,
    endpoints_settings,
    enqueue,
    fetch,
)
from tests.test_endpoint_ops import DEST, endpoint
from tests.test_endpoint_source import pending as pending_rows
from tests.test_endpoint_source import served


async def _by_status(conn: asyncpg.Connection) -> dict[int, dict[str, list[int]]]:
    """Endpoint -> status -> the events of its deliveries in that status."""
    out: dict[int, dict[str, list[int]]] = {}
    for r in await conn.fetch(
        "SELECT endpoint_id, status, event_id FROM outbox_deliveries ORDER BY event_id"
    ):
        out.setdefault(r[0], {}).setdefault(r[1], []).append(r[2])
    return out


async def test_a_fan_out_claims_each_endpoints_room_as_it_writes_and_leaves_the_rest(
    conn: asyncpg.Connection, store: DeliveryStore, endpoints: list[int]
) -> None:
    a, b, c = endpoints
    await add_events(conn, 10)
    held = await _hold(conn, "lanes")
    matched, sent, until, started = await store.fan_out_claiming(held, "none", {a: 4, b: 20})
    assert matched == dict.fromkeys((i for i, _ in held), 3)
    events = [i for i, _ in held]
    # a's first four (oldest first), all of b's; c, not in the room, none.
    assert sorted((r[4], r[3]) for r in sent) == sorted(
        [(a, e) for e in events[:4]] + [(b, e) for e in events]
    )
    by = await _by_status(conn)
    assert by[a] == {"running": events[:4], "pending": events[4:]}
    assert by[b] == {"running": events} and by[c] == {"pending": events}
    rows = await conn.fetch(
        "SELECT id, locked_by, claims, attempts, locked_until - now() AS left "
        "FROM outbox_deliveries WHERE status = 'running'"
    )
    assert {(r[1], r[2], r[3]) for r in rows} == {("lanes", 1, 0)}
    assert all(LEASE - 5 < r[4].total_seconds() <= LEASE for r in rows)
    assert {r[0] for r in rows} == {r[0] for r in sent}
    # What sending needs of the endpoint comes with each, of the statement's snapshot.
    urls = dict(await conn.fetch("SELECT id, url FROM outbox_endpoints"))
    assert all(r[5] == urls[r[4]] and r[6] for r in sent)
    assert store.holding() == 14 and until == pytest.approx(started + LEASE)
    # Held as the claim's: their outcome is recorded under token 1, and the claim takes only
    # the deliveries left pending.
    written = await store.record([_delivered_sent(r) for r in sent])
    assert written == {(r[0], 1) for r in sent} and store.holding() == 0
    left = await _claim_all(store)
    assert len(left) == 6 + 10
    by = await _by_status(conn)
    assert all(set(s) == {"delivered"} for s in by.values())


def _delivered_sent(r: asyncpg.Record) -> DeliveryRecord:
    """The delivered record of a delivery FAN_OUT claimed (a row of endpoints -1)."""
    return _delivered(
        SimpleNamespace(id=r[0], token=1, event_id=r[3], endpoint_id=r[4], replay=False)
    )


async def _only(conn: asyncpg.Connection, endpoint: int) -> None:
    """The deliveries of every endpoint but ``endpoint`` delivered: none of theirs waits."""
    await conn.execute(
        "UPDATE outbox_deliveries SET status = 'delivered' WHERE endpoint_id <> $1", endpoint
    )


@pytest.mark.parametrize(
    "waits",
    ["rate-limited", "held by another relay", "a fresh one pending", "one due again"],
)
async def test_a_fan_out_claims_none_of_an_endpoint_that_must_wait_or_is_limited(
    conn: asyncpg.Connection, store: DeliveryStore, endpoints: list[int], waits: str
) -> None:
    """Nothing of it is claimed at once, whatever room the relay gives it: its rate limit
    counts attempts across relays (the claim's), another relay's rows count against its
    max_concurrency, and deliveries already waiting go first (the claim serves them)."""
    a, b, _ = endpoints
    await add_events(conn, 1)
    first = await _hold(conn, "lanes")
    if waits == "rate-limited":
        await conn.execute("UPDATE outbox_endpoints SET rate_limit = 100 WHERE id = $1", a)
    await store.fan_out(first, "none")  # one delivery to each, pending
    await conn.execute(
        "UPDATE outbox_deliveries SET status = 'delivered' WHERE endpoint_id <> $1", a
    )
    if waits == "held by another relay":
        await conn.execute(
            "UPDATE outbox_deliveries SET status = 'running', locked_by = 'other', claims = 1, "
            "locked_until = now() + interval '1 minute' WHERE endpoint_id = $1",
            a,
        )
    elif waits == "one due again":
        await conn.execute(
            "UPDATE outbox_deliveries SET claims = 1, run_after = now() - interval '1 second' "
            "WHERE endpoint_id = $1",
            a,
        )
    elif waits == "rate-limited":
        await conn.execute("UPDATE outbox_deliveries SET status = 'delivered'")
    await add_events(conn, 3)
    _, sent, _, _ = await store.fan_out_claiming(await _hold(conn, "lanes"), "none", {a: 10, b: 10})
    assert {r[4] for r in sent} == {b}, waits
    by = await _by_status(conn)
    assert len(by[a]["pending"]) == 3 + (waits in ("a fresh one pending", "one due again"))


async def test_another_relays_expired_lease_does_not_hold_an_endpoint_back(
    conn: asyncpg.Connection, store: DeliveryStore, endpoints: list[int]
) -> None:
    """A dead relay's rows wait for the reaper; they do not keep the endpoint from being sent
    to at once (as they do not hold its room in the claim)."""
    a = endpoints[0]
    await add_events(conn, 1)
    await store.fan_out(await _hold(conn, "lanes"), "none")
    await conn.execute(
        "UPDATE outbox_deliveries SET status = 'running', locked_by = 'dead', claims = 1, "
        "locked_until = now() - interval '1 second' WHERE endpoint_id = $1",
        a,
    )
    await conn.execute(
        "UPDATE outbox_deliveries SET status = 'delivered' WHERE endpoint_id <> $1", a
    )
    await add_events(conn, 2)
    _, sent, _, _ = await store.fan_out_claiming(await _hold(conn, "lanes"), "none", {a: 10})
    assert len(sent) == 2


async def test_a_fan_out_that_claims_waits_for_a_claim_in_progress_and_counts_its_rows(
    db_url: str, conn: asyncpg.Connection, store: DeliveryStore, endpoints: list[int]
) -> None:
    """Another relay's claim, not yet committed, is taking the endpoint's room: a fan-out that
    began meanwhile would not see its rows (its snapshot is older than their commit) and would
    send the endpoint more at once than its max_concurrency. Under the in-flight lock the
    fan-out waits for the claim, and its snapshot then sees them."""
    a = endpoints[0]
    await add_events(conn, 1)
    await store.fan_out(await _hold(conn, "lanes"), "none")
    await conn.execute(
        "UPDATE outbox_deliveries SET status = 'delivered' WHERE endpoint_id <> $1", a
    )
    await add_events(conn, 3)
    events = await _hold(conn, "lanes")
    other = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        claim = other.transaction()
        await claim.start()
        await other.execute(render_ops(queries.DELIVERY_CLAIM_LOCK, "public"), store._serial)
        await other.execute(
            "UPDATE outbox_deliveries SET status = 'running', locked_by = 'other', claims = 1, "
            "locked_until = now() + interval '1 minute' WHERE endpoint_id = $1",
            a,
        )
        fan_out = asyncio.create_task(store.fan_out_claiming(events, "none", {a: 10}))
        await asyncio.sleep(0.5)
        assert not fan_out.done()  # waits for the claim
        await claim.commit()
        _, sent, _, _ = await asyncio.wait_for(fan_out, 10)
    finally:
        await other.close()
    assert sent == []
    by = await _by_status(conn)
    assert by[a] == {"running": by[a]["running"], "pending": [e for e, _ in events]}


async def test_a_claim_waits_for_a_fan_out_that_claims_and_counts_its_rows(
    db_url: str, conn: asyncpg.Connection, store: DeliveryStore, endpoints: list[int]
) -> None:
    """The other way round: a claim that began while another relay's fan-out was writing
    deliveries running would not see them, and would take the endpoint's room again."""
    a = endpoints[0]
    await add_events(conn, 4)
    await store.fan_out(await _hold(conn, "lanes"), "none")  # 4 pending each
    other = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        fan_out = other.transaction()
        await fan_out.start()
        await other.execute(render_ops(queries.FAN_OUT_LOCK, "public"), store._serial)
        await add_events(other, 1)
        await other.execute(
            "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, status, "
            "locked_by, locked_until, claims) SELECT max(id), $1, $2, 'running', 'other', "
            "now() + interval '1 minute', 1 FROM outbox",
            a,
            DESTINATION,
        )
        caps = {a: 1}  # its max_concurrency, as the fair share gives it
        claim = asyncio.create_task(
            store.claim([DESTINATION], [ROOM], [ROOM], 100, [], 1000, None, caps)
        )
        await asyncio.sleep(0.5)
        assert not claim.done()  # waits for the fan-out
        await fan_out.commit()
        got, _, _ = await asyncio.wait_for(claim, 10)
    finally:
        await other.close()
    assert a not in {c.endpoint_id for c in got}  # its one request is the other relay's
    assert len(got) == 8


async def test_a_running_relay_sends_fast_endpoints_their_deliveries_without_claiming_them(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    make_receiver: Callable[..., Receiver],
) -> None:
    """Once its endpoints are known to be fast, a relay claims the events as their
    deliveries fit in the endpoints' queues, and sends each one its fan-out claimed: no
    delivery claim, (nearly) none of them pending; each delivered once, its attempt logged, and
    max_concurrency held."""
    receivers = [make_receiver() for _ in range(2)]
    for r in receivers:
        r.respond(200, delay=0.005)
        await add_endpoint(aengine, r.url)
    async with running(endpoints_settings(db_url, max_concurrency=2)) as relay:
        first = await enqueue(db_url, [{"payload": {}}])
        await wait_until(
            lambda: all(delivered_to(r) == first for r in receivers), what="known fast"
        )
        [pipe] = [p for p in relay.pipes if p.name == "deliveries"]
        stats = pipe.source.stats
        ids = await enqueue(db_url, [{"payload": {"n": i}} for i in range(200)])
        await wait_until(
            lambda: all(delivered_to(r) == sorted(first + ids) for r in receivers),
            timeout=30,
            what="delivered",
        )
        await wait_until(lambda: deliveries_done(db_url, 402), what="recorded")
        # Nearly all: the events' claim sizes its batch from the room it sees, and a
        # request that ends later than it expected leaves a delivery or two pending.
        assert stats["sent_at_fan_out"] >= 390, stats
        # The claims (at the poll, woken by a delivery left pending) took the rest.
        assert stats["claimed"] - stats["sent_at_fan_out"] == 402 - stats["sent_at_fan_out"]
    assert all(r.max_in_flight <= 2 for r in receivers)
    logged = await fetch(db_url, "SELECT delivery_id, count(*) FROM outbox_attempts GROUP BY 1")
    assert len(logged) == 402 and {r[1] for r in logged} == {1}


async def test_a_stopping_relay_claims_nothing_at_a_fan_out(db_url: str) -> None:
    """Once the relay stops (halt), a fan-out still in progress writes its deliveries
    pending: claimed at once, they would be held by a relay that sends nothing more."""
    ep = endpoint(db_url)
    pending_rows(db_url, ep, 1)
    async with served(db_url, max_in_flight=1000, max_concurrency=4) as s:
        await s.known_fast(ep)
        assert s.source._room(DEST) == {ep: 4 * FAN_OUT_AHEAD}
        s.source.halt()
        assert s.source._room(DEST) == {}
    # Without a pipeline to hand them to, a source claims none at its fan-outs.
    async with served(db_url, max_concurrency=4) as s:
        s.source.states = {}
        assert s.source.adopt is None and s.source._room(DEST) == {}


async def test_a_replay_left_open_holds_up_no_delivery_claim(
    db_url: str, conn: asyncpg.Connection, store: DeliveryStore, endpoints: list[int]
) -> None:
    """An application's replay, not yet committed, holds the fan-outs' lock (serial, 1). A
    fan-out that claims took the in-flight lock (serial, 2) and then waited for it, and every
    delivery claim of every relay waited behind that (found by review): the fan-out takes the
    fan-outs' lock first."""
    await add_events(conn, 1)
    [(old, _)] = await conn.fetch(PROBE_CLAIM_ALL, "someone")
    await add_events(conn, 5)
    mine = await _hold(conn, "lanes")
    app = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = app.transaction()
        await tx.start()
        await app.fetch(
            render_ops(REPLAY_EVENT_INSERT, "public"), old, endpoints[0], DESTINATION,
            serial_key("public"),
        )  # fmt: skip
        fan_out = asyncio.create_task(
            store.fan_out_claiming(mine, "none", dict.fromkeys(endpoints, 4))
        )
        await asyncio.sleep(0.5)
        assert not fan_out.done()  # fan-outs wait for the replay: as before
        claim = asyncio.create_task(store.claim([DESTINATION], [4], [4], 100, [], 1000, None, {}))
        done, _ = await asyncio.wait({claim}, timeout=3)
        await tx.commit()
        await fan_out
        await claim
    finally:
        await app.close()
    assert done, "a delivery claim waited for an application's replay"


async def test_rows_claimed_after_waiting_for_the_in_flight_lock_are_not_born_expired(
    db_url: str, conn: asyncpg.Connection, endpoints: list[int]
) -> None:
    """The lock and the statement run in one transaction, whose now() is its start, before
    the wait: rows claimed after a wait longer than the lease were written with their lease
    already over, and reaped at once, an attempt counted, none sent (found by review)."""
    lease = 2.0
    pool = await create_pool(to_asyncpg_dsn(db_url), "r1", 3)
    other = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        store = DeliveryStore(Store(pool, "public", "r1", lease))
        await add_events(conn, 3)
        await store.fan_out(await _hold(conn, "r1"), "none")  # pending, for the claim below
        await store._read_floors()
        await _only(conn, endpoints[0])
        await add_events(conn, 3)
        mine = await _hold(conn, "r1")
        tx = other.transaction()
        await tx.start()  # another relay's fan-out, in progress for longer than the lease
        await other.execute(render_ops(queries.FAN_OUT_LOCK, "public"), store._serial)
        fan_out = asyncio.create_task(store.fan_out_claiming(mine, "none", {endpoints[1]: 4}))
        claim = asyncio.create_task(store.claim([DESTINATION], [4], [4], 100, [], 1000, None, {}))
        await asyncio.sleep(lease + 1)
        await tx.commit()
        _, sent, _, _ = await fan_out
        claimed, _, _ = await claim
        rows = await conn.fetch(
            "SELECT id, locked_until > now() + interval '1 second' AS live "
            "FROM outbox_deliveries WHERE status = 'running' ORDER BY id"
        )
    finally:
        await other.close()
        await pool.close()
    assert sent and claimed, (sent, claimed)
    assert len(rows) == len(sent) + len(claimed) and all(r["live"] for r in rows), rows


def _lose_the_first_fan_out_answer(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The first fan-out that claims commits, and its answer is lost (the connection closed
    after the COMMIT); the list returned holds its rows once it was."""
    lost: list[object] = []
    real = DeliveryStore._after

    async def after(self: DeliveryStore, lock: str, *args: object) -> object:
        rows = await real(self, lock, *args)
        if lock == queries.FAN_OUT_LOCK and not lost:
            lost.append(rows)
            raise asyncpg.ConnectionDoesNotExistError("connection was closed in the middle")
        return rows

    monkeypatch.setattr(DeliveryStore, "_after", after)
    return lost


async def test_a_fan_out_whose_answer_was_lost_fails_no_delivery_unsent(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FAN_OUT commits and its answer is lost (a connection reset after the COMMIT): the
    sink retries the events, which are recorded already. The deliveries it claimed are
    running under this relay's lease, held by nothing: the reaper took them back after the
    lease counting an attempt, and with max_attempts 1 failed one never sent (found by
    review). The relay puts them back, unattempted, at once."""
    lost = _lose_the_first_fan_out_answer(monkeypatch)
    await add_endpoint(aengine, receiver.url)
    async with running(endpoints_settings(db_url, max_attempts=1)):
        [first] = await enqueue(db_url, [{"payload": {"n": 0}}])
        await wait_until(lambda: delivered_to(receiver) == [first], what="known fast")
        [second] = await enqueue(db_url, [{"payload": {"n": 1}}])
        await wait_until(lambda: lost, what="a fan-out that sends at once")
        await wait_until(lambda: delivered_to(receiver) == [first, second], timeout=4, what="sent")
    [d] = await fetch(db_url, "SELECT * FROM outbox_deliveries WHERE event_id = $1", second)
    assert (d["status"], d["attempts"]) == ("delivered", 1), dict(d)


async def test_what_a_lost_fan_out_claimed_is_sent_once_put_back_not_at_the_poll(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Put back (claimed once: the waiting lane), the deliveries of a fan-out whose answer
    was lost are not what the looks for fresh deliveries read; nothing claimed them before
    the poll, 10 s here (found by review)."""
    lost = _lose_the_first_fan_out_answer(monkeypatch)
    await add_endpoint(aengine, receiver.url)
    async with running(endpoints_settings(db_url, SLOW_POLL)):
        [first] = await enqueue(db_url, [{"payload": {"n": 0}}])
        await wait_until(lambda: delivered_to(receiver) == [first], timeout=15, what="known fast")
        [second] = await enqueue(db_url, [{"payload": {"n": 1}}])
        await wait_until(lambda: lost, timeout=15, what="a fan-out that sends at once")
        put_back = time.monotonic()
        await wait_until(lambda: second in delivered_to(receiver), timeout=15, what="sent")
        took = time.monotonic() - put_back
    assert took < 3.0, f"sent {took:.1f} s after its fan-out's answer was lost"


async def test_a_fan_out_cancelled_after_its_commit_puts_back_what_it_claimed(
    conn: asyncpg.Connection,
    store: DeliveryStore,
    endpoints: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fan-out cancelled (the relay stopping) as its COMMIT's answer came: the deliveries
    it claimed are running under this relay's lease and held by nothing. Only a lost answer
    (a database error or a timeout) was settled; these waited for the lease to end and were
    reaped with an attempt counted, never made. Settled as a lost answer is, at the
    reaper's next pass, which waits for a fan-out under way rather than skip (with fan-outs
    back to back, it skipped until the lease ended; found by review)."""
    a, b, _ = endpoints
    real = DeliveryStore._after

    async def after(self: DeliveryStore, lock: str, *args: object) -> object:
        await real(self, lock, *args)  # committed
        raise asyncio.CancelledError()

    monkeypatch.setattr(DeliveryStore, "_after", after)
    await add_events(conn, 3)
    held = await _hold(conn, "lanes")
    with pytest.raises(asyncio.CancelledError):
        await store.fan_out_claiming(held, "none", {a: 4, b: 4})
    assert await conn.fetchval("SELECT count(*) FROM outbox_deliveries WHERE status = 'running'")
    # The reaper's settle (wait=False), with the next fan-out under way: it waits for that
    # one (fan-outs back to back never leave the lock free at a given moment).
    release = asyncio.Event()

    async def next_fan_out() -> None:
        async with store._at_once:
            await release.wait()

    under_way = asyncio.create_task(next_fan_out())
    await asyncio.sleep(0)
    asyncio.get_running_loop().call_later(0.2, release.set)
    await store.settle(wait=False)
    await under_way
    rows = await conn.fetch("SELECT status, attempts FROM outbox_deliveries")
    assert len(rows) == 9 and {(r[0], r[1]) for r in rows} == {("pending", 0)}, rows
