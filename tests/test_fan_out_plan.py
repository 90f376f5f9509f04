"""FAN_OUT's look at each fast endpoint's lanes reads that endpoint's entries only.

`bench fanout --scenario drain` with a slow and a dead endpoint (2026-12-07): every fan-out
took about 100 ms, and PostgreSQL 370 µs a delivery against 80-120 without those two. The
plan (auto_explain) read the fresh lane's index whole, once per fast endpoint: its check
"none of the endpoint's fresh deliveries waits" had become an anti join whose inner index
scan was not parameterized by the endpoint (the statistics, never analysed under a backlog,
said the lane was all but empty), so the slow endpoint's 22,000 waiting deliveries were read
8 times a fan-out.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from relay.db.pool import create_pool
from relay.db.queries import deliveries as dq
from relay.db.queries.render import render_ops
from relay.db.store import Store
from relay.sinks.endpoints.store import DeliveryStore
from relay.tools.bench.fanout_setup import add_events, register
from relay.tools.bench.fanout_sql import PROBE_CLAIM_ALL
from tests.test_held_snapshot_deliveries import _nodes, _RollBack

RELAY = "plan-probe"
FAST = 8
BACKLOG = 3000  # events whose delivery to the slow endpoint waits


async def _fan_out_plan(
    store: DeliveryStore, conn: asyncpg.Connection, held: list[tuple[int, int]], room: list[int]
) -> dict[str, Any]:
    """FAN_OUT's plan (EXPLAIN ANALYZE, rolled back) for the events ``held``, claiming 16 of
    each ``room`` endpoint's deliveries as it writes them."""
    sql = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + render_ops(dq.FAN_OUT, "public")
    args = [
        [i for i, _ in held],
        [t for _, t in held],
        RELAY,
        "no endpoint matched",
        store._serial,
        room,
        [16] * len(room),
        [store.lanes.seen] * len(room),
        30.0,
    ]
    try:
        async with conn.transaction():
            raw = await conn.fetchval(sql, *args)
            raise _RollBack((json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"])
    except _RollBack as r:
        return r.plan


def _index_reads(plan: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Per index of the deliveries: (entries read, scans)."""
    read: dict[str, tuple[int, int]] = {}
    for n in _nodes(plan):
        name = n.get("Index Name", "")
        if name.startswith("outbox_deliveries_"):
            rows, loops = read.get(name, (0, 0))
            loops += n.get("Actual Loops", 1)
            read[name] = (rows + n.get("Actual Rows", 0) * n.get("Actual Loops", 1), loops)
    return read


@pytest.fixture
async def setup(db_url: str) -> AsyncIterator[tuple[DeliveryStore, asyncpg.Connection, list[int]]]:
    dsn = to_asyncpg_dsn(db_url)
    conn = await asyncpg.connect(dsn)
    pool = await create_pool(dsn, RELAY, 1)
    try:
        # Statistics taken while the tables are empty, as a new deployment's are.
        await conn.execute("ANALYZE")
        urls = [f"http://127.0.0.1:{9000 + i}/" for i in range(FAST + 1)]
        ids = await register(conn, urls)
        store = DeliveryStore(Store(pool, "public", RELAY, 30.0))
        await add_events(conn, BACKLOG)
        held = sorted((r[0], r[1]) for r in await conn.fetch(PROBE_CLAIM_ALL, RELAY))
        await store.fan_out(held, "no endpoint matched")
        # The fast endpoints kept up; the slow one's deliveries all wait.
        await conn.execute(
            "UPDATE outbox_deliveries SET status = 'delivered' WHERE endpoint_id <> $1", ids[-1]
        )
        await conn.execute("VACUUM outbox_deliveries")
        yield store, conn, ids[:FAST]
    finally:
        await pool.close()
        await conn.close()


async def test_the_fast_endpoints_lanes_are_read_by_endpoint_not_whole(
    setup: tuple[DeliveryStore, asyncpg.Connection, list[int]],
) -> None:
    store, conn, fast = setup
    await add_events(conn, 10)
    held = sorted((r[0], r[1]) for r in await conn.fetch(PROBE_CLAIM_ALL, RELAY))
    plan = await _fan_out_plan(store, conn, held, fast)
    read = _index_reads(plan)
    fresh = read.get("outbox_deliveries_fresh_idx", (0, 0))[0]
    # At most the first entry of each fast endpoint (none of theirs waits), never the slow
    # endpoint's backlog.
    assert fresh <= FAST, (read, json.dumps(plan)[:3000])
    sent = await conn.fetchval(
        "SELECT count(*) FROM outbox_deliveries WHERE status = 'running' AND event_id = ANY($1)",
        [i for i, _ in held],
    )
    assert sent == 0  # rolled back: nothing was claimed for good


async def test_only_the_endpoints_a_fan_out_writes_to_are_looked_at(
    setup: tuple[DeliveryStore, asyncpg.Connection, list[int]],
) -> None:
    """The relay passes every fast endpoint it knows as room (10,000 registered, as many in
    the scale bench): FAN_OUT probes the lanes of those its events match, not of all."""
    store, conn, fast = setup
    others = await register(conn, [f"http://127.0.0.1:{10000 + i}/" for i in range(300)], "else")
    await add_events(conn, 10)
    held = sorted((r[0], r[1]) for r in await conn.fetch(PROBE_CLAIM_ALL, RELAY))
    plan = await _fan_out_plan(store, conn, held, fast + others)
    scans = {name: loops for name, (_, loops) in _index_reads(plan).items()}
    # Four probes of each of the 8 matched endpoints at most (two of the in-flight index, one
    # of each lane), none of the 300 others.
    assert sum(scans.values()) <= 4 * FAST, scans


async def test_the_settle_of_a_lost_fan_out_reads_its_events_deliveries_only(
    db_url: str,
) -> None:
    """FAN_OUT_SETTLE (after a fan-out whose answer was lost) looks its events' deliveries up
    by event id, not every delivery running under this relay's name (found by review: 27,000
    entries read for the 90 deliveries of 10 events)."""
    dsn = to_asyncpg_dsn(db_url)
    conn = await asyncpg.connect(dsn)
    pool = await create_pool(dsn, RELAY, 1)
    try:
        await conn.execute("ANALYZE")  # statistics of empty tables, as a new deployment's
        await register(conn, [f"http://127.0.0.1:{9000 + i}/" for i in range(9)])
        store = DeliveryStore(Store(pool, "public", RELAY, 30.0))
        await add_events(conn, 3000)
        held = sorted((r[0], r[1]) for r in await conn.fetch(PROBE_CLAIM_ALL, RELAY))
        await store.fan_out(held, "x")
        # 27,000 entries of this relay in the in-flight index (rows it holds, or the dead
        # running versions of rows it recorded, kept by a held snapshot).
        await conn.execute(
            "UPDATE outbox_deliveries SET status = 'running', locked_by = $1, claims = 2,"
            " locked_until = now() + interval '1 min'",
            RELAY,
        )
        await add_events(conn, 10)
        held = sorted((r[0], r[1]) for r in await conn.fetch(PROBE_CLAIM_ALL, RELAY))
        await store.fan_out(held, "x")
        sql = "EXPLAIN (ANALYZE, BUFFERS) " + render_ops(dq.FAN_OUT_SETTLE, "public")
        plan = [r[0] for r in await conn.fetch(sql, [i for i, _ in held], RELAY, [])]
        removed = sum(int(line.split(":")[1]) for line in plan if "Rows Removed by Filter" in line)
        assert removed <= 90, "\n".join(plan)  # the 10 events' 90 deliveries at most
    finally:
        await pool.close()
        await conn.close()
