"""The look for deliveries another relay wrote pending (DeliveryStore.look, DELIVERY_LOOK):
what finished deliveries run every LOOK_EVERY instead of a claim. In `bench fanout` those
claims, 10 a second, were a sixth of PostgreSQL's time a delivery (each took 5 ms to plan) and
nearly all found nothing: deliveries are sent at their fan-out."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from relay.db.pool import create_pool
from relay.db.store import Store
from relay.sinks.endpoints.lanes import FOUND_CHUNK
from relay.sinks.endpoints.store import DeliveryStore
from relay.tools.bench.fanout_setup import add_events
from tests.test_delivery_lanes import (  # noqa: F401  (fixtures)
    ENDPOINTS,
    _claim_all,
    _hold,
    conn,
    store,
)


@pytest.fixture
async def other(db_url: str) -> AsyncIterator[DeliveryStore]:
    """Another relay's store, on the same table, its floors read (a fan-out claims nothing
    before)."""
    pool = await create_pool(to_asyncpg_dsn(db_url), "other", 2)
    try:
        s = DeliveryStore(Store(pool, "public", "other", 30.0))
        assert await _claim_all(s) == []
        yield s
    finally:
        await pool.close()


async def test_a_look_finds_what_another_relay_wrote_pending_and_the_claim_takes_it(
    conn: asyncpg.Connection,  # noqa: F811
    store: DeliveryStore,  # noqa: F811
    other: DeliveryStore,
) -> None:
    await _claim_all(store)  # the floors read: none
    assert await store.look() is False
    await add_events(conn, 3)
    await other.fan_out(await _hold(conn, "other"), "none")  # pending: nothing sent at once
    seen = store.lanes.seen
    assert await store.look() is True
    assert store.lanes.seen == seen  # the claim reads them from there
    assert len(await _claim_all(store)) == 3 * ENDPOINTS


async def test_a_look_that_finds_nothing_pending_moves_on_past_what_it_read(
    conn: asyncpg.Connection,  # noqa: F811
    store: DeliveryStore,  # noqa: F811
    other: DeliveryStore,
) -> None:
    """Deliveries sent at their fan-out (written running) are nothing to claim: the look
    says so, and the next one does not read them again."""
    await _claim_all(store)
    await add_events(conn, 4)
    held = await _hold(conn, "other")
    room = {e: 100 for e in await conn.fetchval("SELECT array_agg(id) FROM outbox_endpoints")}
    _, sent, _, _ = await other.fan_out_claiming(held, "none", room)
    assert len(sent) == 4 * ENDPOINTS
    top = await conn.fetchval("SELECT max(id) FROM outbox_deliveries")
    assert await store.look() is False
    assert store.lanes.seen == top and not store.behind
    assert store.store.statements["delivery_look"] == 1


async def test_a_look_that_read_a_chunk_short_of_the_newest_says_to_claim(
    conn: asyncpg.Connection,  # noqa: F811
    store: DeliveryStore,  # noqa: F811
    other: DeliveryStore,
) -> None:
    """More was written since the last look than one reads: it moves on by a chunk and
    says the claim should read on (the claim reads the rest in chunks of its own)."""
    await _claim_all(store)
    await add_events(conn, FOUND_CHUNK)
    held = await _hold(conn, "other")
    room = {
        e: 10 * FOUND_CHUNK
        for e in await conn.fetchval("SELECT array_agg(id) FROM outbox_endpoints")
    }
    await other.fan_out_claiming(held, "none", room)  # all sent at once: nothing pending
    assert await store.look() is True
    assert store.lanes.seen == FOUND_CHUNK and store.behind
    assert await _claim_all(store) == []
    assert store.lanes.seen == ENDPOINTS * FOUND_CHUNK


async def test_ids_handed_out_again_make_a_look_say_to_claim(
    conn: asyncpg.Connection,  # noqa: F811
    store: DeliveryStore,  # noqa: F811
    other: DeliveryStore,
) -> None:
    """The deliveries emptied and their ids started again: the look cannot tell from its
    :seen, the floors are read again by the claim it asks for."""
    await add_events(conn, 5)
    await store.fan_out(await _hold(conn, "lanes"), "none")
    assert len(await _claim_all(store)) == 5 * ENDPOINTS
    await conn.execute("TRUNCATE outbox_deliveries RESTART IDENTITY")
    await add_events(conn, 1)
    await other.fan_out(await _hold(conn, "other"), "none")  # ids 1-3, below seen
    assert await store.look() is True
    assert store.lanes.floors is None
    assert len(await _claim_all(store)) == ENDPOINTS


async def test_a_look_before_the_floors_are_read_says_to_claim(
    store: DeliveryStore,  # noqa: F811
) -> None:
    assert await store.look() is True
    assert store.store.statements["delivery_look"] == 0  # the claim reads them first
