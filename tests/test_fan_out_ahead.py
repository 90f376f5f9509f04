"""The look ahead (ENDPOINTS_AHEAD, FanOuts._look): which endpoints a destination's next
waiting events would reach. The events' claim is paced by the fast endpoints' room while
every other endpoint it reaches is down or sending; an endpoint it does not reach (10,000
registered, 10 matching, in the scale bench) must not stop the pace, and one it reaches must."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from outbox import endpoint_secrets
from outbox.dburl import to_asyncpg_dsn
from relay.db.queries import deliveries as dq
from relay.db.queries.render import render_ops
from tests.test_held_snapshot_deliveries import _nodes

DEST = "d"
RELAY = "ahead-probe"

ENDPOINT = (
    "INSERT INTO outbox_endpoints (destination, url, tenant, event_types, enabled, secret)"
    " VALUES ($1, $2, $3, $4, $5, $6) RETURNING id"
)
EVENT = (
    "INSERT INTO outbox (destination, payload, content_type, tenant, event_type, run_after,"
    " claims) VALUES ($1, '{}', 'application/json', $2, $3, now() + $4 * interval '1 s', $5)"
    " RETURNING id"
)
# What FAN_OUT writes a delivery for, said once more, plainly (the spec the look must keep).
REACHED = (
    "SELECT DISTINCT e.id FROM outbox AS o JOIN outbox_endpoints AS e"
    " ON e.enabled AND e.destination = o.destination"
    " AND (e.tenant = o.tenant OR e.tenant IS NULL)"
    " AND (cardinality(e.event_types) = 0 OR o.event_type = ANY(e.event_types))"
    " WHERE o.id = ANY($1::bigint[])"
)


@pytest.fixture
async def conn(db_url: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        yield c
    finally:
        await c.close()


async def _ahead(conn: asyncpg.Connection, after: int, n: int = 5000) -> set[int]:
    return set(await conn.fetchval(render_ops(dq.ENDPOINTS_AHEAD, "public"), DEST, after, n))


async def test_the_look_reaches_the_endpoints_a_fan_out_would(
    conn: asyncpg.Connection,
) -> None:
    """Random endpoints (of a tenant or every tenant, of some types or all, enabled or not, of
    this destination or another) and random waiting events (fresh, due again, not due yet,
    before the look's start): the look names exactly the endpoints that the events it should
    read reach."""
    rng = random.Random(29)
    secret = endpoint_secrets.generate()
    tenants = ["a", "b", None]
    types = ["x", "y", None]
    for i in range(60):
        await conn.execute(
            ENDPOINT,
            rng.choice([DEST, DEST, "other"]),
            f"http://127.0.0.1:9/{i}",
            rng.choice(tenants),
            rng.choice([[], ["x"], ["y"], ["x", "y"]]),
            rng.random() < 0.8,
            secret,
        )
    for _ in range(25):
        round_ = conn.transaction()  # each round on its own events
        await round_.start()
        try:
            before = await conn.fetchval(EVENT, DEST, "a", "x", 0, 0)
            read: list[int] = []
            for _ in range(rng.randint(1, 6)):
                kind = rng.choice(["fresh", "again", "later", "elsewhere"])
                tenant, etype = rng.choice(tenants), rng.choice(types)
                dest = "other" if kind == "elsewhere" else DEST
                delay, claims = {"fresh": (0, 0), "again": (-5, 1)}.get(kind, (60, 0))
                eid = await conn.fetchval(EVENT, dest, tenant, etype, delay, claims)
                if kind in ("fresh", "again"):
                    read.append(eid)
            want = {r[0] for r in await conn.fetch(REACHED, read)}
            got = await _ahead(conn, before)
            assert got == want, (read, got, want)
        finally:
            await round_.rollback()


async def test_the_look_reads_at_most_its_count_of_fresh_events(
    conn: asyncpg.Connection,
) -> None:
    """An event past the first ``n`` fresh ones is not read: the look costs the same whatever
    the backlog (its bound, AHEAD_EVENTS, is what docs/webhooks.md promises)."""
    secret = endpoint_secrets.generate()
    first = await conn.fetchval(ENDPOINT, DEST, "http://127.0.0.1:9/a", "a", [], True, secret)
    last = await conn.fetchval(ENDPOINT, DEST, "http://127.0.0.1:9/b", "b", [], True, secret)
    for _ in range(3):
        await conn.fetchval(EVENT, DEST, "a", None, 0, 0)
    await conn.fetchval(EVENT, DEST, "b", None, 0, 0)
    assert await _ahead(conn, 0, 3) == {first}
    assert await _ahead(conn, 0, 4) == {first, last}


async def test_the_look_starts_after_the_last_event_fanned_out_and_matches_by_index(
    db_url: str, conn: asyncpg.Connection
) -> None:
    """Statistics of empty tables (a new deployment's), 10,000 endpoints of other tenants and
    3,000 events fanned out while a snapshot was held (their entries stay in the fresh lane's
    index): the look reads that index from the last event fanned out on, and the endpoints of
    the events' tenant by the match index, not the table."""
    await conn.execute("ANALYZE")
    secret = endpoint_secrets.generate()
    await conn.execute(
        "INSERT INTO outbox_endpoints (destination, url, tenant, secret)"
        " SELECT $1, 'http://127.0.0.1:9/' || i, 'other-' || i, $2"
        " FROM generate_series(1, 10000) AS i",
        DEST,
        secret,
    )
    mine = [
        await conn.fetchval(ENDPOINT, DEST, f"http://127.0.0.1:9/m{i}", "m", [], True, secret)
        for i in range(10)
    ]
    holder = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        top = await conn.fetchval(
            "WITH e AS (INSERT INTO outbox (destination, payload, content_type, tenant)"
            " SELECT $1, '{}', 'application/json', 'm' FROM generate_series(1, 3000)"
            " RETURNING id) SELECT max(id) FROM e",
            DEST,
        )
        await conn.execute("UPDATE outbox SET status = 'delivered' WHERE id <= $1", top)
        for _ in range(5):
            await conn.fetchval(EVENT, DEST, "m", "x", 0, 0)
        sql = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + render_ops(dq.ENDPOINTS_AHEAD, "public")
        raw = await conn.fetchval(sql, DEST, top, 5000)
        plan: dict[str, Any] = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
        assert await _ahead(conn, top) == set(mine)
    finally:
        await holder.close()
    nodes = list(_nodes(plan))
    fresh = [n for n in nodes if n.get("Index Name") == "outbox_fresh_idx"]
    assert fresh and all("id >" in n.get("Index Cond", "") for n in fresh), json.dumps(plan)
    assert sum(n.get("Shared Hit Blocks", 0) for n in fresh) < 20, json.dumps(fresh)
    on_endpoints = [n for n in nodes if n.get("Relation Name") == "outbox_endpoints"]
    assert all(n["Node Type"] != "Seq Scan" for n in on_endpoints), json.dumps(plan)
    assert sum(n.get("Actual Rows", 0) * n.get("Actual Loops", 1) for n in on_endpoints) <= 10


async def test_a_failed_look_paces_nothing_until_it_may_look_again(db_url: str) -> None:
    """A look that fails (the database gone a moment) leaves no look: the pace then needs
    every other endpoint known, as without one, and no new look is started for AHEAD_FOR."""
    import time

    from tests.test_endpoint_source import served

    async with served(db_url) as s:
        source = s.source
        source._enabled = {DEST: {1: False, 2: False}}  # 2 not known here

        async def gone(destination: str, after: int, n: int) -> set[int]:
            raise asyncpg.exceptions.ConnectionDoesNotExistError("gone")

        source.store.ahead = gone  # type: ignore[method-assign]
        assert source._paceable(DEST, {1}, time.monotonic())  # a look under way
        await source._looking[DEST]
        assert DEST not in source._ahead and DEST not in source._looking
        assert not source._paceable(DEST, {1}, time.monotonic())
        assert DEST not in source._looking  # not again at once
