"""How the relay's statements are prepared and planned on its connections.

`bench fanout --scenario drain` (2026-12-07, pg_stat_statements with track_planning): every
statement is planned at every call (the pool forces custom plans: relay/db/pool.py); the
delivery claim, 16 KB of text, over asyncpg's 15 KB limit for statements it keeps prepared,
was also parsed again at every call.
"""

from __future__ import annotations

import importlib.resources

import asyncpg

from outbox.dburl import to_asyncpg_dsn
from outbox.sql import parse
from relay.db.pool import STATEMENT_CACHE_BYTES, connection, create_pool
from relay.db.queries.render import render_ops
from relay.db.store import Store
from relay.sinks.endpoints.store import DeliveryStore
from relay.tools.bench.fanout_setup import add_events
from tests.support.fan_outs import (  # noqa: F401  (fixtures)
    LEASE,
    conn_fixture,
    endpoints_fixture,
)
from tests.test_delivery_lanes import _claim_all, _hold

LONGEST_SCHEMA = "s" * 56  # the longest schema name `migrate` takes


def test_every_statement_of_the_relay_is_kept_prepared() -> None:
    """asyncpg prepares a statement anew at every call when its text is longer than the
    pool's limit: none of ours is, in the longest schema name."""
    queries = importlib.resources.files("relay.db.queries")
    sizes = {}
    for f in queries.iterdir():
        if f.name.endswith(".sql"):
            for name, sql in parse(f.read_text(), f.name).items():
                sizes[f"{f.name}:{name}"] = len(render_ops(sql, LONGEST_SCHEMA).encode())
    assert len(sizes) > 50
    largest = max(sizes, key=lambda k: sizes[k])
    assert sizes[largest] < STATEMENT_CACHE_BYTES, (largest, sizes[largest])
    assert sizes["deliveries.sql:delivery_claim"] > 15 * 1024  # asyncpg's default limit


# The statements looked for, by their first line.
FIRST_LINES = {"fan_out": "WITH serial AS MATERIALIZED", "delivery_claim": "WITH RECURSIVE waits"}


async def _plans(store: DeliveryStore) -> dict[str, tuple[int, int]]:
    """FAN_OUT's and DELIVERY_CLAIM's prepared statements on the store's connection, each
    (generic plans, custom plans); each must be prepared once."""
    async with connection(store.store.pool) as conn:
        rows = await conn.fetch(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
        )
    out: dict[str, tuple[int, int]] = {}
    for r in rows:
        for name, first in FIRST_LINES.items():
            if r[0].lstrip().startswith(first):
                assert name not in out, rows
                out[name] = (r[1], r[2])
    return out


async def test_statements_stay_prepared_and_are_planned_at_each_call(
    db_url: str, conn: asyncpg.Connection, endpoints: list[int]
) -> None:
    """Parsed once a connection, planned for each call's values (a generic plan made while
    the tables were small reads them whole once they fill: FAN_OUT's, made on empty tables,
    read 50,000 events by the primary key and each endpoint's deliveries whole, 68 ms for 10
    events; docs/performance.md)."""
    # One connection: every statement below is prepared on it.
    pool = await create_pool(to_asyncpg_dsn(db_url), "lanes", 1)
    store = DeliveryStore(Store(pool, "public", "lanes", LEASE))
    try:
        assert await _claim_all(store) == []  # its floors read, as a relay's first claim does
        a, b, _ = endpoints
        for _ in range(3):
            await add_events(conn, 5)
            await store.fan_out_claiming(await _hold(conn, "lanes"), "none", {a: 100, b: 100})
            await _claim_all(store)
        await add_events(conn, 5)
        await store.fan_out_claiming(await _hold(conn, "lanes"), "none", {})  # no room
        plans = await _plans(store)
        assert plans["fan_out"] == (0, 4), plans
        # The claim, 16 KB of text, is prepared too (asyncpg's default limit is 15 KB).
        generic, custom = plans["delivery_claim"]
        assert generic == 0 and custom >= 4, plans
    finally:
        await pool.close()
