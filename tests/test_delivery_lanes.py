"""The delivery claim's two lanes (migration 0018): fresh deliveries read from a floor per
endpoint that no fan-out passes, deliveries due again apart; what the relay keeps of them
(relay/sinks/endpoints/lanes.py) and what it does when they are wrong."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from relay.db import queries
from relay.db.pool import create_pool
from relay.db.queries import FAN_OUT, serial_key
from relay.db.queries.render import render_ops
from relay.db.store import Store
from relay.ops.replay_queries import REPLAY_EVENT_INSERT
from relay.sinks.endpoints.lanes import CHECK_EVERY, FOUND_CHUNK
from relay.sinks.endpoints.store import DeliveryStore
from relay.tools.bench.common import DESTINATION
from relay.tools.bench.fanout import _delivered
from relay.tools.bench.fanout_setup import add_events, register
from relay.tools.bench.fanout_sql import PROBE_CLAIM_ALL

ENDPOINTS = 3
ROOM = 1000


@pytest.fixture
async def conn(db_url: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await register(c, [f"http://127.0.0.1:{9000 + i}/" for i in range(ENDPOINTS)])
        yield c
    finally:
        await c.close()


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[DeliveryStore]:
    pool = await create_pool(to_asyncpg_dsn(db_url), "lanes", 2)
    try:
        yield DeliveryStore(Store(pool, "public", "lanes", 30.0))
    finally:
        await pool.close()


async def _claim_all(store: DeliveryStore) -> list[int]:
    """Every delivery the claims take until one takes none (recorded delivered); their ids."""
    ids: list[int] = []
    cursor: int | None = None
    for _ in range(50):
        got, cursor, _ = await store.claim(
            [DESTINATION], [ROOM], [ROOM], 5000, [], 1000, cursor, {}
        )
        if got:
            await store.record([_delivered(c) for c in got])
        ids += [c.id for c in got]
        if not got and cursor is None and not store.behind:
            return ids
    raise AssertionError("the claims never ran dry")


async def _hold(conn: asyncpg.Connection, relay: str) -> list[tuple[int, int]]:
    return sorted((r[0], r[1]) for r in await conn.fetch(PROBE_CLAIM_ALL, relay))


@contextlib.asynccontextmanager
async def _fan_out_in_progress(
    db_url: str, conn: asyncpg.Connection
) -> AsyncIterator[asyncpg.transaction.Transaction]:
    """The events pending fanned out by relay "early" in a transaction left open (its ids
    drawn, its lock held) until the block commits it."""
    early = await _hold(conn, "early")
    slow = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = slow.transaction()
        await tx.start()
        await slow.fetch(
            render_ops(FAN_OUT, "public"),
            [i for i, _ in early],
            [t for _, t in early],
            "early",
            "none",
            serial_key("public"),
            [],  # none claimed as it is written
            [],
            [],
            30.0,
        )
        yield tx
    finally:
        await slow.close()


async def test_a_fan_out_waits_for_one_in_progress_so_none_commits_below_a_floor(
    db_url: str, conn: asyncpg.Connection, store: DeliveryStore
) -> None:
    """A fan-out drew its ids and has not committed; another fans out after it, and a claim
    runs. Without the fan-outs' lock the second commits first, the claim takes its deliveries
    and moves the floors past the first's ids: those were left pending, found only by the
    floors' check minutes later. With it the second waits, and every delivery is claimed."""
    await _claim_all(store)  # the floors read, and nothing to claim
    await add_events(conn, 5)
    async with _fan_out_in_progress(db_url, conn) as tx:
        await add_events(conn, 5)
        later = await _hold(conn, "lanes")
        fan_out = asyncio.create_task(store.fan_out(later, "none"))
        await asyncio.sleep(0.5)
        waited = not fan_out.done()
        first = await _claim_all(store)
        await tx.commit()
        await fan_out
    second = await _claim_all(store)
    left = await conn.fetchval("SELECT count(*) FROM outbox_deliveries WHERE status = 'pending'")
    assert (len(first) + len(second), left) == (10 * ENDPOINTS, 0)
    assert waited, "the second fan-out did not wait for the first"
    assert first == []  # it waited: nothing was committed before the first fan-out


async def test_deliveries_written_below_the_floors_are_claimed_after_their_check(
    conn: asyncpg.Connection, store: DeliveryStore
) -> None:
    """A delivery written by hand in a transaction that commits after the claims passed its
    id is below the floors: the floors' check (every CHECK_EVERY) finds it."""
    await add_events(conn, 2)
    held = await _hold(conn, "lanes")
    late = conn.transaction()
    await late.start()
    [(event, endpoint)] = await conn.fetch(
        "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination) "
        "SELECT -1, min(id), $1 FROM outbox_endpoints RETURNING event_id, endpoint_id",
        DESTINATION,
    )
    # On the store's pool, not in the open transaction; it waits for nothing: the hand
    # insert took no lock.
    await store.fan_out(held, "none")
    assert len(await _claim_all(store)) == 2 * ENDPOINTS
    await late.commit()
    assert await _claim_all(store) == []  # below the floors: not seen
    await store.check_floors()  # not due yet: nothing read
    assert await _claim_all(store) == []
    store.lanes.checked_at -= CHECK_EVERY
    await store.check_floors()  # the reaper's pass runs it
    [late_id] = await _claim_all(store)
    status = await conn.fetchval(
        "SELECT status FROM outbox_deliveries WHERE event_id = $1 AND endpoint_id = $2",
        event,
        endpoint,
    )
    assert status == "delivered" and late_id > 0


async def test_ids_handed_out_again_reset_the_floors(
    conn: asyncpg.Connection, store: DeliveryStore
) -> None:
    """The deliveries emptied and their ids started again (TRUNCATE … RESTART IDENTITY, a
    restore): the highest id went back, the floors are read again, and new deliveries, with
    ids below the old floors, are claimed."""
    await add_events(conn, 20)
    await store.fan_out(await _hold(conn, "lanes"), "none")
    assert len(await _claim_all(store)) == 20 * ENDPOINTS
    await conn.execute("TRUNCATE outbox_deliveries RESTART IDENTITY")
    await add_events(conn, 2)
    await store.fan_out(await _hold(conn, "lanes"), "none")
    # The claim that sees the highest id went back takes nothing; the next reads the floors.
    assert await _claim_all(store) == []
    assert store.lanes.floors is None
    assert len(await _claim_all(store)) == 2 * ENDPOINTS


async def test_a_relay_counts_what_it_holds_until_recorded_released_lost_or_its_lease_ends(
    db_url: str, conn: asyncpg.Connection
) -> None:
    """The claim counts this relay's deliveries in flight from what the relay holds (:held),
    not from the table: an endpoint with its room taken gets nothing more until the relay
    records, releases or loses a delivery, or its lease ends."""
    pool = await create_pool(to_asyncpg_dsn(db_url), "held", 2)
    store = DeliveryStore(Store(pool, "public", "held", 1.0))

    async def claim() -> list[int]:
        got, _, _ = await store.claim([DESTINATION], [2], [2], 100, [], 1000, None, {})
        return sorted(c.endpoint_id for c in got)

    try:
        await add_events(conn, 20)
        await store.fan_out(await _hold(conn, "held"), "none")
        first, _, _ = await store.claim([DESTINATION], [2], [2], 100, [], 1000, None, {})
        assert len(first) == 2 * ENDPOINTS
        assert await claim() == []  # every endpoint's room is held
        one = [c for c in first if c.endpoint_id == first[0].endpoint_id]
        await store.record([_delivered(one[0])])
        assert await claim() == [one[0].endpoint_id]  # recorded: room for one
        await store.release([(one[1].id, one[1].token)])
        assert await claim() == [one[0].endpoint_id]  # released: room for one
        lost = next(c for c in first if c.endpoint_id != one[0].endpoint_id)
        await conn.execute(  # another relay took it after its lease ran out
            "UPDATE outbox_deliveries SET locked_by = 'other', claims = claims + 1, "
            "locked_until = now() + interval '1 minute' WHERE id = $1",
            lost.id,
        )
        kept = [(c.id, c.token) for c in first if c.endpoint_id == lost.endpoint_id]
        assert await store.heartbeat(kept) == {i for i, _ in kept if i != lost.id}
        # Lost, but the other relay's row is in flight: still no room for that endpoint.
        assert lost.endpoint_id not in await claim()
        await asyncio.sleep(1.1)  # every lease ended: none of them counts any more
        assert sorted(set(await claim())) == sorted({c.endpoint_id for c in first})
    finally:
        await pool.close()


async def test_ids_handed_out_again_past_the_old_seen_reset_the_floors(
    conn: asyncpg.Connection, store: DeliveryStore
) -> None:
    """Ids started again and, before the next claim, passed the old seen: seen never went
    back, but the ids' epoch (the id sequence's file) changed, so the floors are read again
    (a review's find: 6 of 15 left pending until the floors' check)."""
    await add_events(conn, 2)
    await store.fan_out(await _hold(conn, "lanes"), "none")
    assert len(await _claim_all(store)) == 2 * ENDPOINTS  # seen 6
    await conn.execute("TRUNCATE outbox_deliveries RESTART IDENTITY")
    await add_events(conn, 5)
    await store.fan_out(await _hold(conn, "lanes"), "none")  # ids 1 to 15
    got = await _claim_all(store) + await _claim_all(store)
    left = await conn.fetchval("SELECT count(*) FROM outbox_deliveries WHERE status = 'pending'")
    assert (len(got), left) == (5 * ENDPOINTS, 0)


async def test_a_replay_written_beside_a_fan_out_in_progress_waits_for_it(
    db_url: str, conn: asyncpg.Connection, store: DeliveryStore
) -> None:
    """`outbox-relay replay ID --endpoint EID` writes a delivery: it draws its id under the
    fan-outs' lock. Without it, its id came above a fan-out still in progress; once
    recorded it counted in seen, and the fan-out's deliveries, committed later, were below
    it (a review's find: 9 left pending until the floors' check)."""
    await _claim_all(store)
    await add_events(conn, 3)
    async with _fan_out_in_progress(db_url, conn) as tx:
        endpoint = await conn.fetchval("SELECT min(id) FROM outbox_endpoints")
        replay = asyncio.create_task(
            conn.fetchval(
                render_ops(REPLAY_EVENT_INSERT, "public"),
                -1,
                endpoint,
                DESTINATION,
                serial_key("public"),
            )
        )
        await asyncio.sleep(0.3)
        waited = not replay.done()
        got, _, _ = await store.claim([DESTINATION], [ROOM], [ROOM], 5000, [], 1000, None, {})
        await store.record([_delivered(c) for c in got])
        await tx.commit()
        assert await replay is not None
    rest = await _claim_all(store)
    left = await conn.fetchval("SELECT count(*) FROM outbox_deliveries WHERE status = 'pending'")
    assert (len(got) + len(rest), left) == (3 * ENDPOINTS + 1, 0)
    assert waited


async def test_claims_in_small_batches_take_every_endpoints_deliveries(
    conn: asyncpg.Connection, store: DeliveryStore
) -> None:
    """A batch of 2 fills at the first endpoint: the deliveries found of the endpoints past
    it are given floors all the same (without them, 4 of 12 were claimed: a review's find
    that no other test caught)."""
    await _claim_all(store)
    await add_events(conn, 4)
    await store.fan_out(await _hold(conn, "lanes"), "none")
    ids: list[int] = []
    cursor: int | None = None
    for _ in range(40):
        got, cursor, _ = await store.claim([DESTINATION], [ROOM], [ROOM], 2, [], 1000, cursor, {})
        await store.record([_delivered(c) for c in got])
        ids += [c.id for c in got]
    assert len(ids) == len(set(ids)) == 4 * ENDPOINTS


async def test_a_stale_record_does_not_uncount_a_newer_claim_of_the_same_row(
    db_url: str, conn: asyncpg.Connection
) -> None:
    """The relay stalled past its lease; the row was put back and claimed again by this
    relay (token 2); the first claim's outcome (token 1) comes late: not written, and the
    newer claim stays counted (a review's find: it was forgotten, and the endpoint, at
    max_concurrency 1, got a second delivery while token 2's was in flight)."""
    pool = await create_pool(to_asyncpg_dsn(db_url), "held", 2)
    s = DeliveryStore(Store(pool, "public", "held", 1.0))
    try:
        await add_events(conn, 1)
        await s.fan_out(await _hold(conn, "held"), "none")
        first, _, _ = await s.claim([DESTINATION], [1], [1], 100, [], 1000, None, {})
        old = first[0]
        await asyncio.sleep(1.1)  # the stall: every lease ended
        await conn.execute(  # the reaper put it back, due now
            "UPDATE outbox_deliveries SET status = 'pending', locked_by = NULL, "
            "locked_until = NULL, run_after = now() WHERE id = $1",
            old.id,
        )
        again, _, _ = await s.claim([DESTINATION], [1], [1], 100, [], 1000, None, {})
        [new] = [c for c in again if c.id == old.id]
        assert new.token != old.token
        await add_events(conn, 1)
        await s.fan_out(await _hold(conn, "held"), "none")
        assert await s.record([_delivered(old)]) == set()  # stale: not applied
        more, _, _ = await s.claim([DESTINATION], [1], [1], 100, [], 1000, None, {})
        assert old.endpoint_id not in {c.endpoint_id for c in more}
    finally:
        await pool.close()


async def test_a_check_that_started_before_a_claim_does_not_lower_its_floors(
    conn: asyncpg.Connection, store: DeliveryStore
) -> None:
    """The reaper's check reads in a snapshot taken before a claim that commits meanwhile:
    the rows that claim took are not below the floors as they were before the check, so
    they lower nothing (a review's find: every active endpoint's floor was set back, and a
    warning logged, every 300 s under steady traffic)."""
    await _claim_all(store)
    await add_events(conn, 3)
    await store.fan_out(await _hold(conn, "lanes"), "none")
    gate = asyncio.Event()
    call = store.store.call

    async def slow(method: str, sql: str, *args: object) -> object:
        rows = await call(method, sql, *args)
        if sql is queries.DELIVERY_FLOORS:
            await gate.wait()  # a long read under a held snapshot
        return rows

    store.store.call = slow  # type: ignore[method-assign,assignment]
    store.lanes.checked_at -= CHECK_EVERY
    check = asyncio.create_task(store.check_floors())
    await asyncio.sleep(0.2)
    assert len(await _claim_all(store)) == 3 * ENDPOINTS
    after_claim = dict(store.lanes.floors or {})
    gate.set()
    await check
    assert store.lanes.floors == after_claim


async def test_other_relays_in_flight_count_whether_their_ids_sort_before_or_after(
    db_url: str, conn: asyncpg.Connection
) -> None:
    """Other relays' deliveries in flight are read by two ranges of relay ids around this
    relay's: both count against an endpoint's max_concurrency."""
    await add_events(conn, 4)
    held = await _hold(conn, "mmm")
    pool = await create_pool(to_asyncpg_dsn(db_url), "mmm", 2)
    store = DeliveryStore(Store(pool, "public", "mmm", 30.0))
    try:
        await store.fan_out(held, "none")
        endpoint = await conn.fetchval("SELECT min(id) FROM outbox_endpoints")
        for relay, event in (("aaa", held[0][0]), ("zzz", held[1][0])):
            await conn.execute(
                "UPDATE outbox_deliveries SET status = 'running', locked_by = $1, "
                "claims = 1, locked_until = now() + interval '1 minute' "
                "WHERE event_id = $2 AND endpoint_id = $3",
                relay,
                event,
                endpoint,
            )
        got, _, _ = await store.claim([DESTINATION], [3], [3], 100, [], 1000, None, {})
    finally:
        await pool.close()
    counts = {e: sum(1 for c in got if c.endpoint_id == e) for e in {c.endpoint_id for c in got}}
    assert counts[endpoint] == 1 and sorted(counts.values()) == [1, 3, 3]


async def test_a_claim_reads_a_chunk_of_a_large_fan_out_and_the_rest_at_the_next(
    conn: asyncpg.Connection, store: DeliveryStore
) -> None:
    """Past seen, a claim reads the next FOUND_CHUNK ids, not every delivery of a large
    fan-out (the planner read the whole range and sorted it, claim after claim, while a drain
    caught up: 15% slower); it says it is behind, and the next claims read the rest."""
    await _claim_all(store)  # the floors read: none, seen 0
    await add_events(conn, FOUND_CHUNK)
    await store.fan_out(await _hold(conn, "lanes"), "none")  # 3 x FOUND_CHUNK ids
    got, _, _ = await store.claim([DESTINATION], [1], [1], 10, [], 1000, None, {})
    assert store.behind and store.lanes.seen == FOUND_CHUNK
    assert max(c.id for c in got) <= FOUND_CHUNK
    claims = 1
    while store.behind:
        await store.claim([DESTINATION], [1], [1], 10, [], 1000, None, {})
        claims += 1
    assert claims == 3 and store.lanes.seen == ENDPOINTS * FOUND_CHUNK
    assert len(got) + len(await _claim_all(store)) == ENDPOINTS * FOUND_CHUNK


async def test_fresh_deliveries_past_an_id_gap_are_claimed_at_once(
    conn: asyncpg.Connection, store: DeliveryStore
) -> None:
    """The ids jumped far ahead (a sequence set ahead; a table emptied by retention, whose
    floors reset to a seen far below the sequence): the next fan-out's deliveries are
    claimed at once, not after one claim per FOUND_CHUNK ids of the gap (a review's find:
    none of them in 5 claims)."""
    await _claim_all(store)  # the floors read, seen 0
    await conn.execute(
        "SELECT setval(pg_get_serial_sequence('outbox_deliveries', 'id')::regclass, $1)",
        100 * FOUND_CHUNK,
    )
    await add_events(conn, 1)
    await store.fan_out(await _hold(conn, "lanes"), "none")
    got, _, _ = await store.claim([DESTINATION], [ROOM], [ROOM], 5000, [], 1000, None, {})
    assert len(got) == ENDPOINTS and not store.behind


async def test_a_heartbeat_after_a_stall_past_the_lease_counts_its_delivery_again(
    db_url: str, conn: asyncpg.Connection
) -> None:
    """The relay stalled past its lease, a claim ran first (the delivery no longer counted),
    then the heartbeat renewed the lease: the delivery is still being sent, and counts
    again (a review's find: it was forgotten, and the endpoint got a second delivery). A
    heartbeat that finds an earlier claim of a row lost leaves the later claim counted."""
    pool = await create_pool(to_asyncpg_dsn(db_url), "held", 2)
    s = DeliveryStore(Store(pool, "public", "held", 1.0))

    async def claim(skip: Sequence[int] = ()) -> set[int]:
        got, _, _ = await s.claim([DESTINATION], [1], [1], 100, skip, 1000, None, {})
        return {c.endpoint_id for c in got}

    try:
        await add_events(conn, 3)
        await s.fan_out(await _hold(conn, "held"), "none")
        first, _, _ = await s.claim([DESTINATION], [1], [1], 100, [], 1000, None, {})
        old = first[0]
        await asyncio.sleep(1.1)  # the stall: every lease ended
        await s.release([(c.id, c.token) for c in first if c.id != old.id])
        assert old.endpoint_id not in await claim([old.endpoint_id])  # a claim runs first
        assert await s.heartbeat([(old.id, old.token)]) == {old.id}
        assert old.endpoint_id not in await claim()  # renewed: it counts again
        await conn.execute(  # put back by hand, claimed again (first) by this relay
            "UPDATE outbox_deliveries SET status = 'pending', locked_by = NULL, "
            "locked_until = NULL, run_after = now() - interval '1 hour' WHERE id = $1",
            old.id,
        )
        s._held.pop(old.id)
        again, _, _ = await s.claim([DESTINATION], [1], [1], 100, [], 1000, None, {})
        assert [c.id for c in again if c.endpoint_id == old.endpoint_id] == [old.id]
        assert await s.heartbeat([(old.id, old.token)]) == set()  # the old token: lost
        assert old.endpoint_id not in await claim()  # the new claim still counts
    finally:
        await pool.close()
