"""The delivery claim under a held snapshot (a pg_dump, a report, an idle transaction): VACUUM
removes nothing, and every delivery claimed and recorded since leaves a dead entry in the
claim index (its pending version) and in the running index (its running version). The claim's
walk over the endpoints with pending deliveries, each endpoint's due rows and each endpoint's
count of deliveries in flight pass over all of them, so its cost grows with every delivery
made since the snapshot was taken. `bench fanout --scenario steady --rate 100 --seconds 300
--hold-snapshot` (800 deliveries/s): p50 23 ms in the first 30 s, 101 ms at 60 s, 5.1 s at
120 s, 125 s at 270 s; 6.4 ms in every window without the snapshot, autovacuum on
(docs/performance.md, "The endpoints path under a held snapshot").

Migration 0018 gave the claim two lanes: fresh deliveries read from a floor per endpoint,
deliveries due again apart (relay/sinks/endpoints/lanes.py); the claim's pages are now flat as
the history grows.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from relay.db.pool import create_pool
from relay.db.queries import deliveries as dq
from relay.db.queries.render import render_ops
from relay.db.store import Store
from relay.sinks.endpoints.fairness import UNCAPPED
from relay.sinks.endpoints.lanes import FOUND_CHUNK
from relay.sinks.endpoints.store import DeliveryStore
from relay.tools.bench.common import DESTINATION
from relay.tools.bench.fanout import _delivered
from relay.tools.bench.fanout_setup import add_events, register
from relay.tools.bench.fanout_sql import PROBE_CLAIM_ALL
from tests.test_claim_lanes import held_snapshot

RELAY = "held-probe"
ENDPOINTS = 8
ROOM = 16  # each endpoint's max_concurrency: a claim takes up to 16 of each
TENANT = "held"


async def _round(store: DeliveryStore, conn: asyncpg.Connection, events: int) -> int:
    """``events`` written, fanned out, every pending delivery claimed and recorded
    delivered."""
    await add_events(conn, events, TENANT)
    held = sorted((r[0], r[1]) for r in await conn.fetch(PROBE_CLAIM_ALL, RELAY))
    made = sum((await store.fan_out(held, "no endpoint matched")).values())
    cursor: int | None = None
    done = 0
    for _ in range(made + 10):  # bounded: each claim but the last takes one or more
        got, cursor, _ = await store.claim(
            [DESTINATION], [ROOM], [ROOM], 2000, [], 1000, cursor, {}
        )
        if got:
            await store.record([_delivered(c) for c in got])
            done += len(got)
        elif cursor is None:
            break
    assert done >= made  # and the rows the last measure left pending
    return made


async def _claim_plan(store: DeliveryStore, conn: asyncpg.Connection) -> dict[str, Any]:
    """The plan of one claim (EXPLAIN ANALYZE, rolled back) with 100 fresh deliveries waiting
    per endpoint."""
    await add_events(conn, 100, TENANT)
    held = sorted((r[0], r[1]) for r in await conn.fetch(PROBE_CLAIM_ALL, RELAY))
    await store.fan_out(held, "no endpoint matched")
    sql = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + render_ops(dq.DELIVERY_CLAIM, "public")
    args = [[DESTINATION], [ROOM], 2000, RELAY, "{}", 1000, None, 30.0, [], [ROOM], 1]
    args += [UNCAPPED, 2000, True, store.lanes.as_json(), store.lanes.seen, FOUND_CHUNK, "{}"]
    try:
        async with conn.transaction():
            raw = await conn.fetchval(sql, *args)
            raise _RollBack((json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"])
    except _RollBack as r:
        return r.plan


class _RollBack(Exception):
    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan


async def _pages(store: DeliveryStore, conn: asyncpg.Connection) -> int:
    top = await _claim_plan(store, conn)
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


@pytest.fixture
async def stores(
    db_url: str, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[DeliveryStore, asyncpg.Connection]]:
    dsn = to_asyncpg_dsn(db_url)
    conn = await asyncpg.connect(dsn)
    pool = await create_pool(dsn, RELAY, 1)
    lease = getattr(request, "param", 30.0)
    try:
        await register(conn, [f"http://127.0.0.1:{9000 + i}/" for i in range(ENDPOINTS)], TENANT)
        yield DeliveryStore(Store(pool, "public", RELAY, lease)), conn
    finally:
        await pool.close()
        await conn.close()


@pytest.mark.parametrize("stores", [1.0], indirect=True)  # a lease of 1 s
async def test_the_delivery_claim_reads_as_many_pages_after_5x_the_history(
    db_url: str, stores: tuple[DeliveryStore, asyncpg.Connection]
) -> None:
    """The claim of 128 fresh deliveries after 2,000 deliveries made under a held snapshot,
    and again after 10,000: it must read about as many pages. From the start of each
    endpoint's range (the claim index, before migration 0018) it read 2.5x as many: 3,890
    pages, then 9,544. The leases of the history have ended when it is measured: the count
    in flight reads a lease's worth of dead versions (the test below)."""
    store, conn = stores
    async with held_snapshot(db_url):
        assert await _round(store, conn, 250) == 250 * ENDPOINTS
        await asyncio.sleep(1.2)
        first = await _pages(store, conn)
        for _ in range(4):
            await _round(store, conn, 250)
        await asyncio.sleep(1.2)
        after = await _pages(store, conn)
    assert after <= 1.2 * first + 100, (first, after)


@pytest.mark.parametrize("stores", [1.0], indirect=True)  # a lease of 1 s
async def test_the_claims_count_in_flight_reads_only_leases_not_yet_ended(
    db_url: str, stores: tuple[DeliveryStore, asyncpg.Connection]
) -> None:
    """Each endpoint's deliveries in flight are counted by their live leases, from the index
    of running deliveries by (endpoint, lease end) read from now() on: the dead running
    version of each delivery recorded under a held snapshot carries a lease that has ended,
    and is not read. By endpoint alone (outbox_deliveries_running_idx, before migration 0017)
    the count read every one of them: 2,000 here, 250 per endpoint and claim."""
    store, conn = stores
    async with held_snapshot(db_url):
        assert await _round(store, conn, 250) == 250 * ENDPOINTS
        await asyncio.sleep(1.5)  # every lease of the history has ended
        plan = await _claim_plan(store, conn)
    counts = [
        n
        for n in _nodes(plan)
        if n.get("Index Name") == "outbox_deliveries_in_flight_idx"
        and "locked_until >" in n.get("Index Cond", "")
    ]
    assert counts, "the count in flight does not read the in-flight index by lease end"
    # Pages per endpoint's count: an index descent, none of the history's 250 dead entries
    # (their versions are invisible, so they never show in the rows: a review's find).
    pages = sum(n["Shared Hit Blocks"] + n["Shared Read Blocks"] for n in counts)
    assert pages <= 4 * sum(n["Actual Loops"] for n in counts), (pages, counts)


async def test_the_claims_count_in_flight_steps_over_its_own_relays_entries(
    db_url: str, stores: tuple[DeliveryStore, asyncpg.Connection]
) -> None:
    """Within a lease (30 s here) of 2,000 deliveries recorded under a held snapshot, their
    dead running versions still look in flight by their lease. The count read each one in
    the table (250 per endpoint and claim; 24,000 a claim at 800 deliveries/s): it now counts
    only other relays' rows, by two ranges of the index's locked_by key around this relay's,
    and this relay's own entries are passed in the index (it knows what it holds)."""
    store, conn = stores
    async with held_snapshot(db_url):
        assert await _round(store, conn, 250) == 250 * ENDPOINTS
        plan = await _claim_plan(store, conn)
    counts = [n for n in _nodes(plan) if n.get("Index Name") == "outbox_deliveries_in_flight_idx"]
    assert counts, "the count in flight does not read the in-flight index"
    pages = sum(n["Shared Hit Blocks"] + n["Shared Read Blocks"] for n in counts)
    loops = sum(n["Actual Loops"] for n in counts)
    # The index pages of 250 entries an endpoint, not the table pages of their versions.
    assert pages <= 6 * loops, (pages, loops)


@pytest.mark.parametrize("stores", [1.0], indirect=True)  # a lease of 1 s
async def test_a_bounded_reap_reads_only_leases_that_ended_within_its_bound(
    db_url: str, stores: tuple[DeliveryStore, asyncpg.Connection]
) -> None:
    """The reaper's pass after a complete one reads the lease index only from its bound on:
    the dead running version of each delivery recorded under a held snapshot keeps the end
    its lease would have had, and a pass over every ended lease read all of them (2,000 here,
    a pass a second for the snapshot's whole life)."""
    store, conn = stores
    sql = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + render_ops(dq.DELIVERY_REAP, "public")
    read: dict[float | None, int] = {}  # pages the pass reads
    async with held_snapshot(db_url):
        assert await _round(store, conn, 250) == 250 * ENDPOINTS
        await asyncio.sleep(1.5)  # every lease of the history has ended, over 0.5 s ago
        for within in (None, 0.5):
            tx = conn.transaction()
            await tx.start()
            try:
                raw = await conn.fetchval(sql, 10, 5000, [DESTINATION], [10], within)
            finally:
                await tx.rollback()  # EXPLAIN ANALYZE ran the reap
            plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
            read[within] = int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])
    assert read[0.5] <= 10, read  # an index descent
    assert read[None] >= 10 * read[0.5], read  # what an unbounded pass reads: every entry


@pytest.mark.parametrize("stores", [1.0], indirect=True)  # a lease of 1 s
async def test_a_bounded_reap_takes_the_leases_that_ended_within_it_and_a_full_one_the_rest(
    stores: tuple[DeliveryStore, asyncpg.Connection],
) -> None:
    """A dead relay's deliveries (claimed, never recorded): a pass bounded to the last
    0.5 s after their leases ended takes them; ended 2 s before, only a full pass does."""
    store, conn = stores
    await add_events(conn, 1, TENANT)
    held = sorted((r[0], r[1]) for r in await conn.fetch(PROBE_CLAIM_ALL, RELAY))
    await store.fan_out(held, "no endpoint matched")
    got, _, _ = await store.claim([DESTINATION], [ROOM], [ROOM], 2000, [], 1000, None, {})
    assert len(got) == ENDPOINTS
    await asyncio.sleep(1.2)  # their leases ended 0.2 s ago
    assert await store.reap(10, {}, within=0.5) == ENDPOINTS
    got, _, _ = await store.claim([DESTINATION], [ROOM], [ROOM], 2000, [], 1000, None, {})
    assert len(got) == ENDPOINTS  # claimed again, and left to die
    await asyncio.sleep(3.0)  # their leases ended 2 s ago
    assert await store.reap(10, {}, within=0.5) == 0
    assert await store.reap(10, {}) == ENDPOINTS
