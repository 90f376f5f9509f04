"""The delivery claim's two lanes (migration 0018): fresh deliveries read from a floor per
endpoint that no fan-out passes, deliveries due again apart; what the relay keeps of them
(relay/sinks/endpoints/lanes.py) and what it does when they are wrong."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from relay.db.pool import create_pool
from relay.db.queries import FAN_OUT, serial_key
from relay.db.queries.render import render_ops
from relay.db.store import Store
from relay.sinks.endpoints.lanes import CHECK_EVERY, Floors
from relay.sinks.endpoints.store import DeliveryStore
from relay.tools.bench.common import DESTINATION
from relay.tools.bench.fanout import _delivered
from relay.tools.bench.fanout_setup import add_events, register
from relay.tools.bench.fanout_sql import PROBE_CLAIM_ALL

ENDPOINTS = 3
ROOM = 1000

# --- what the relay keeps (pure) -------------------------------------------------------------


def test_the_first_read_takes_every_floor_and_the_top() -> None:
    lanes = Floors()
    assert lanes.due(0.0)
    assert lanes.read([(1, 10), (2, 5)], 40, now=100.0) == []
    assert (lanes.floors, lanes.seen) == ({1: 9, 2: 4}, 40)
    assert not lanes.due(100.0 + CHECK_EVERY - 1) and lanes.due(100.0 + CHECK_EVERY)


def test_a_later_read_lowers_floors_and_names_the_endpoints_it_found_below_them() -> None:
    lanes = Floors({1: 9, 2: 4}, seen=40)
    # 1 has a delivery below its floor; 3 had none kept, and one at or below seen; 4 one above
    # seen (found by the next claim anyway); 2 one above its floor.
    missed = lanes.read([(1, 7), (2, 30), (3, 40), (4, 41)], 50, now=0.0)
    assert missed == [1, 3]
    assert lanes.floors == {1: 6, 2: 4, 3: 39, 4: 40}
    assert lanes.seen == 40  # a check never moves seen


def test_a_claim_moves_the_floors_it_gives_and_drops_an_endpoint_with_none_pending() -> None:
    lanes = Floors({1: 9, 2: 4, 3: 7}, seen=40)
    assert lanes.claimed([(1, 20), (2, None), (5, 44)], 60)
    assert (lanes.floors, lanes.seen) == ({1: 20, 3: 7, 5: 44}, 60)
    assert lanes.as_json() == '{"1":20,"3":7,"5":44}'


def test_seen_going_back_drops_every_floor_until_they_are_read_again() -> None:
    lanes = Floors({1: 9}, seen=40)
    assert not lanes.claimed([(1, 20)], 39)
    assert lanes.floors is None and lanes.due(0.0) and lanes.as_json() == "{}"
    assert lanes.claimed([(1, 20)], 39)  # not read yet: nothing kept, nothing to move


# --- against the database --------------------------------------------------------------------


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
        if not got and cursor is None:
            return ids
    raise AssertionError("the claims never ran dry")


async def _hold(conn: asyncpg.Connection, relay: str) -> list[tuple[int, int]]:
    return sorted((r[0], r[1]) for r in await conn.fetch(PROBE_CLAIM_ALL, relay))


async def test_a_fan_out_waits_for_one_in_progress_so_none_commits_below_a_floor(
    db_url: str, conn: asyncpg.Connection, store: DeliveryStore
) -> None:
    """A fan-out drew its ids and has not committed; another fans out after it, and a claim
    runs. Without the fan-outs' lock the second commits first, the claim takes its deliveries
    and moves the floors past the first's ids: those were left pending, found only by the
    floors' check minutes later. With it the second waits, and every delivery is claimed."""
    await _claim_all(store)  # the floors read, and nothing to claim
    await add_events(conn, 5)
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
        )
        await add_events(conn, 5)
        later = await _hold(conn, "lanes")
        fan_out = asyncio.create_task(store.fan_out(later, "none"))
        await asyncio.sleep(0.5)
        waited = not fan_out.done()
        first = await _claim_all(store)
        await tx.commit()
        await fan_out
    finally:
        await slow.close()
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
    store.lanes.checked_at -= CHECK_EVERY
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
