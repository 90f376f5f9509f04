"""Migration 0020 dropped outbox_deliveries_claim_idx (the claim's two lanes of 0018 hold its
rows) and outbox_attempts_at_idx (retention walks the message log by id): every delivery and
attempt writes one index entry fewer (issue #29). The statements that read those indexes read
the lanes or the primary key now; each keeps a plan that reads what it needs, never a table
whole, beside a history of delivered deliveries and logged attempts."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy import create_engine, text

from outbox import queries as outbox_queries
from outbox.dburl import to_asyncpg_dsn
from outbox.migrate import load_migrations
from relay.db.pool import create_pool
from relay.db.queries import DELIVERY_CLAIM, PURGE_ATTEMPTS
from relay.db.queries.render import render_ops
from relay.db.retention import Retention
from relay.sinks.endpoints.fairness import UNCAPPED
from relay.ui import queries as ui_queries
from tests.support.lanes import lane_args

DEST = "hooks"
RELAY = "diet-probe"


@pytest.fixture
async def conn(db_url: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        yield c
    finally:
        await c.close()


async def _explain(conn: asyncpg.Connection, sql: str, *args: object) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of ``sql``, whatever it writes rolled back."""
    tx = conn.transaction()
    await tx.start()
    try:
        raw = await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, *args)
    finally:
        await tx.rollback()
    return dict((json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"])


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found, stack = [], [plan]
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(node.get("Plans", []))
    return found


def _rows_read(plan: dict[str, Any], table: str) -> int:
    """Rows the plan's scans of ``table`` returned, every loop counted."""
    return sum(
        int(n["Actual Rows"] * n["Actual Loops"])
        for n in _nodes(plan)
        if n.get("Relation Name") == table and "Scan" in n["Node Type"]
    )


def _seq_scans(plan: dict[str, Any], table: str) -> list[dict[str, Any]]:
    return [
        n for n in _nodes(plan) if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == table
    ]


async def _endpoints(conn: asyncpg.Connection, n: int, destination: str = DEST) -> list[int]:
    return [
        await conn.fetchval(
            "INSERT INTO outbox_endpoints (destination, url, secret) "
            "VALUES ($1, 'http://127.0.0.1:9/', 'whsec_x') RETURNING id",
            destination,
        )
        for _ in range(n)
    ]


async def _history(conn: asyncpg.Connection, endpoints: list[int], per: int) -> None:
    """``per`` delivered deliveries of each endpoint, ended a day ago, each with its attempt."""
    await conn.execute(
        "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, status, attempts, "
        "claims, created_at, run_after, finished_at) "
        "SELECT g, e, $2, 'delivered', 1, 1, now() - interval '1 day', "
        "now() - interval '1 day', now() - interval '1 day' "
        "FROM generate_series(1, $3::int) AS g, unnest($1::bigint[]) AS e ORDER BY g, e",
        endpoints,
        DEST,
        per,
    )
    await conn.execute(
        "INSERT INTO outbox_attempts (delivery_id, event_id, endpoint_id, at, http_status) "
        "SELECT id, event_id, endpoint_id, finished_at, 200 FROM outbox_deliveries ORDER BY id"
    )


async def _log(conn: asyncpg.Connection, ages: list[str]) -> list[int]:
    """One attempt per age (an interval before now), logged in this order: ids ascending."""
    return [
        await conn.fetchval(
            "INSERT INTO outbox_attempts (delivery_id, event_id, endpoint_id, at) "
            "VALUES (1, 1, 1, now() - $1::text::interval) RETURNING id",
            age,
        )
        for age in ages
    ]


async def test_the_message_logs_retention_deletes_the_old_attempts_of_its_batch_by_id(
    conn: asyncpg.Connection,
) -> None:
    """The lowest ids first, :batch at a time: of those, every attempt old enough goes and
    every one not yet old enough stays (one logged before another but older, by a statement
    that began first and drew its id later, is not held back by it), and nothing younger than
    the retention is ever deleted. The statement says how many it deleted and examined."""
    sql = render_ops(PURGE_ATTEMPTS, "public")
    ids = await _log(conn, ["3 hours", "3 hours", "2 hours", "10 minutes", "2 hours", "1 hour"])
    assert tuple(await conn.fetchrow(sql, 3600.0 * 1.5, 1)) == (1, 1)
    # The 10-minute-old one stays; the 2-hour-old one logged after it goes.
    assert tuple(await conn.fetchrow(sql, 3600.0 * 1.5, 5)) == (3, 5)
    assert tuple(await conn.fetchrow(sql, 3600.0 * 1.5, 5)) == (0, 2)
    left = [r[0] for r in await conn.fetch("SELECT id FROM outbox_attempts ORDER BY id")]
    assert left == [ids[3], ids[5]]
    assert tuple(await conn.fetchrow(sql, 300.0, 5)) == (2, 2)  # once old enough, all go
    assert tuple(await conn.fetchrow(sql, 0.0, 5)) == (0, 0)  # an empty log


async def test_an_attempt_logged_under_a_clock_set_ahead_holds_back_no_other(
    db_url: str, conn: asyncpg.Connection
) -> None:
    """The server's clock was a day ahead when one attempt was logged, then set right: its
    `at` is a day in the future, below the ids of everything logged since. Retention keeps it
    (its age is unknown), and one run deletes every attempt past the retention behind it,
    batch after batch. Stopping at the first attempt not old enough, retention deleted
    nothing for a day (a year, had the clock been a year ahead) while the log grew."""
    [future] = await _log(conn, ["-1 day"])
    await _log(conn, ["3 hours"] * 25)
    pool = await create_pool(to_asyncpg_dsn(db_url), RELAY, 1)
    try:
        retention = Retention(pool, "public")
        for _ in range(10):  # bounded: a run is a few batches of 10
            batch = await retention.batch(86400.0, 3600.0, 10, None)
            assert batch is not None
            if not batch.more:
                break
        else:
            raise AssertionError("retention did not end its run")
    finally:
        await pool.close()
    assert [r[0] for r in await conn.fetch("SELECT id FROM outbox_attempts")] == [future]


async def test_the_message_logs_retention_reads_a_batch_by_the_primary_key(
    conn: asyncpg.Connection,
) -> None:
    """A batch of 1,000 beside 40,000 attempts: read from the primary key, the batch's rows
    and no more. Joined to its batch by id, the delete read the whole log (a hash join with a
    sequential scan of the attempts), batch after batch."""
    await _history(conn, await _endpoints(conn, 8), 5000)
    await conn.execute("VACUUM ANALYZE outbox_attempts")
    plan = await _explain(conn, render_ops(PURGE_ATTEMPTS, "public"), 3600.0, 1000)
    assert not _seq_scans(plan, "outbox_attempts"), plan
    assert _rows_read(plan, "outbox_attempts") <= 2 * 1000 + 10, _rows_read(plan, "outbox_attempts")
    deleted = [n for n in _nodes(plan) if n["Node Type"] == "ModifyTable"]
    assert deleted and deleted[0]["Plans"][0]["Actual Rows"] == 1000


async def _pending(conn: asyncpg.Connection, endpoint: int, fresh: int, waiting: int) -> None:
    """``fresh`` deliveries never claimed and ``waiting`` ones due again (claimed before,
    their run_after an hour ahead), of events past the history's."""
    start = await conn.fetchval("SELECT coalesce(max(event_id), 0) FROM outbox_deliveries")
    await conn.execute(
        "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, claims, run_after) "
        "SELECT $2::bigint + g, $1, $3, CASE WHEN g > $4::int THEN 1 ELSE 0 END, "
        "CASE WHEN g > $4::int THEN now() + interval '1 hour' ELSE now() END "
        "FROM generate_series(1, $4::int + $5::int) AS g",
        endpoint,
        start,
        DEST,
        fresh,
        waiting,
    )


async def test_the_consoles_endpoints_count_their_pending_deliveries_in_both_lanes(
    conn: asyncpg.Connection,
) -> None:
    """The console's endpoints page counts each endpoint's pending deliveries from the two
    lanes, together every one of them once, never from its whole history."""
    eps = await _endpoints(conn, 4)
    await _history(conn, eps, 5000)
    await _pending(conn, eps[1], 30, 12)
    await _pending(conn, eps[2], 0, 7)
    await conn.execute("VACUUM ANALYZE outbox_deliveries")
    sql = render_ops(ui_queries.ENDPOINTS, "public")
    rows = await conn.fetch(sql, None, 50, 0)
    assert [(r["id"], r["pending"]) for r in rows] == list(zip(eps, [0, 42, 7, 0], strict=True))
    plan = await _explain(conn, sql, None, 50, 0)
    used = {n.get("Index Name") for n in _nodes(plan)}
    assert {"outbox_deliveries_fresh_idx", "outbox_deliveries_waiting_idx"} <= used, used
    assert "outbox_deliveries_endpoint_idx" not in used, used
    # 49 pending (EXPLAIN rounds each loop's rows), none of the 20,000 delivered
    assert _rows_read(plan, "outbox_deliveries") <= 49 + 8, plan


async def test_enabling_an_endpoint_makes_its_backlog_due_from_the_waiting_lane(
    db_url: str, conn: asyncpg.Connection
) -> None:
    """endpoint_enable makes a disabled endpoint's backlog due (the deliveries waiting out a
    backoff): read from the waiting lane, which holds all of them, never from the endpoint's
    whole history; its fresh deliveries, due already, are left as they are."""
    [ep] = await _endpoints(conn, 1)
    await _history(conn, [ep], 20000)
    await _pending(conn, ep, 5, 9)
    await conn.execute("UPDATE outbox_endpoints SET enabled = false")
    await conn.execute("VACUUM ANALYZE outbox_deliveries")
    enable = outbox_queries.render_endpoints(outbox_queries.ENDPOINT_ENABLE, "public")
    engine = create_engine("postgresql+psycopg://" + db_url.partition("://")[2])
    try:
        with engine.begin() as c:
            raw = c.execute(text("EXPLAIN (FORMAT JSON) " + enable), {"id": ep}).scalar_one()
            plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
            c.execute(text(enable), {"id": ep})
    finally:
        engine.dispose()
    used = {n.get("Index Name") for n in _nodes(plan)}
    assert "outbox_deliveries_waiting_idx" in used, used
    assert "outbox_deliveries_endpoint_idx" not in used and not _seq_scans(
        plan, "outbox_deliveries"
    ), used
    due = await conn.fetchval(
        "SELECT count(*) FROM outbox_deliveries WHERE status = 'pending' AND run_after <= now()"
    )
    assert due == 14


async def test_the_claims_sweep_reads_only_the_stale_endpoints_pending_deliveries(
    conn: asyncpg.Connection,
) -> None:
    """The claim's sweep cancels the pending deliveries of an endpoint deleted (or moved to
    another destination) meanwhile: it reads that endpoint's from both lanes and locks them
    by id. Through the index of every pending delivery it read all of them (every endpoint's
    backlog); without it, the planner read the table."""
    eps = await _endpoints(conn, 6)
    await _history(conn, eps, 5000)
    for ep in eps[:2]:  # to be deleted and moved: 120 pending
        await _pending(conn, ep, 40, 20)
    for ep in eps[2:]:  # the others' backlogs: 2,400
        await _pending(conn, ep, 400, 200)
    await conn.execute("VACUUM ANALYZE outbox_deliveries")
    await conn.execute("DELETE FROM outbox_endpoints WHERE id = $1", eps[0])
    await conn.execute(
        "UPDATE outbox_endpoints SET destination = 'elsewhere' WHERE id = $1", eps[1]
    )
    args = [[DEST], [4], 2000, RELAY, "{}", 1000, None, 30.0, [], [4], 1, UNCAPPED, 2000]
    plan = await _explain(
        conn, render_ops(DELIVERY_CLAIM, "public"), *args, True, *await lane_args(conn)
    )
    assert not _seq_scans(plan, "outbox_deliveries"), plan
    [orphaned] = [n for n in _nodes(plan) if n.get("Subplan Name") == "CTE orphaned"]
    assert orphaned["Actual Rows"] == 2 * 60
    # The stale endpoints' 120 read three times (their lanes, locked by id, cancelled by
    # id), and the few rows of each other endpoint the claim takes and probes: never the
    # 30,000 delivered nor the other endpoints' 2,400 pending.
    assert _rows_read(plan, "outbox_deliveries") <= 3 * 120 + 200, plan


async def test_migration_0020_drops_the_two_indexes_and_can_run_again(
    conn: asyncpg.Connection,
) -> None:
    (m,) = [m for m in load_migrations() if m.version == 20]
    assert not m.transactional  # DROP INDEX CONCURRENTLY
    for statement in m.statements():  # run again (interrupted, say): nothing left to do
        await conn.execute(statement)
    names = ("outbox_deliveries_claim_idx", "outbox_attempts_at_idx", "outbox_deliveries_lease_idx")
    found = [await conn.fetchval("SELECT to_regclass($1)::text", n) for n in names]
    assert found == [None, None, "outbox_deliveries_lease_idx"]
