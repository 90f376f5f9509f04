"""The statements that write a whole batch by (id, token) pairs do work in proportion to the
batch, whatever the planner believes about running rows.

Statistics are usually taken while rows are pending (autovacuum's ANALYZE, or the relay's
prefill here), so the planner expects almost no running rows. A plan that loops over the
batch once per running row it finds is then chosen as cheap, and is quadratic: with retention
0, recording 500 outcomes took 80-160 ms instead of 5 (bench drain ran at a sixth of its
speed). Each statement runs here under EXPLAIN ANALYZE after exactly that history.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from relay.db import queries
from relay.db.store import Store, create_pool
from relay.sinks.endpoints.fairness import UNCAPPED
from relay.sinks.endpoints.store import DeliveryStore
from relay.tools.bench.fanout import _delivered
from tests.support.lanes import lane_args

N = 500
RELAY = "r1"


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


def _whole_table(node: dict[str, Any]) -> bool:
    """A read of a whole table (a Seq Scan, or what it feeds: a Hash, a Result projecting it):
    priced by the table's real
    size, which the planner takes when the batch is a large part of a small table, and never
    once per row of the batch (a loop's rows are checked apart)."""
    if node["Node Type"] in ("Hash", "Result"):
        children = node.get("Plans", [])
        return len(children) == 1 and _whole_table(children[0])
    return node["Node Type"] == "Seq Scan" and node.get("Actual Loops", 1) == 1


def _assert_linear(raw: Any, n: int, table_rows: int = 0) -> None:
    """Every node reads at most a few rows per row of the batch, but for a read of the whole
    table where the batch is a tenth of it or more (``table_rows`` 0: any table)."""
    plan = json.loads(raw) if isinstance(raw, str) else raw
    small = n * 10 >= table_rows
    for node in _nodes(plan[0]["Plan"]):
        visited = node.get("Actual Rows", 0) * node.get("Actual Loops", 1)
        # EXPLAIN gives rows and rows removed per loop.
        removed = (
            node.get("Rows Removed by Join Filter", 0) + node.get("Rows Removed by Filter", 0)
        ) * node.get("Actual Loops", 1)
        where = f"{node['Node Type']} {node.get('Relation Name') or node.get('CTE Name') or ''}"
        if small and _whole_table(node):
            continue  # what it reads and drops, once, is the small table
        assert visited <= 3 * n, f"{where} produced {visited} rows for a batch of {n}"
        assert removed <= 3 * n, f"{where} read and dropped {removed} rows for a batch of {n}"


async def _extended_and_running(conn: asyncpg.Connection, table: str) -> tuple[int, int]:
    """Rows whose lease a heartbeat of 600 s extended, and rows running: the lease statements
    did their job, not only cheaply."""
    row = await conn.fetchrow(
        f"SELECT count(*) FILTER (WHERE locked_until > now() + interval '500 seconds'), "
        f"count(*) FILTER (WHERE status = 'running') FROM {table}"
    )
    return (row[0], row[1])


async def _connect(db_url: str) -> asyncpg.Connection:
    # The relay's own session settings (relay/db/pool.py create_pool).
    return await asyncpg.connect(
        to_asyncpg_dsn(db_url), server_settings={"plan_cache_mode": "force_custom_plan"}
    )


async def _claimed_events(
    conn: asyncpg.Connection, table_rows: int = 30_000, n: int = N
) -> tuple[list[int], list[int]]:
    await conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")
    await conn.execute(
        "INSERT INTO outbox (destination, key, payload) "
        "SELECT 'd', 'k' || (i % 50), '\\x00'::bytea FROM generate_series(1, $1) AS i",
        table_rows,
    )
    # Statistics taken while rows were pending, database-wide as vacuumdb or autovacuum leave
    # them: the endpoint tables of a Kafka-only deployment are empty, and known to be.
    await conn.execute("VACUUM ANALYZE")
    rows = await conn.fetch(
        queries.render_ops(queries.CLAIM, "public"), "d", n, RELAY, 60.0, 0, 2**62, 0
    )
    rows = rows[:-1]  # the last row carries the next cursor
    assert len(rows) == n
    return [r[0] for r in rows], [r[8] for r in rows]


# Plans change with the table's size and the batch's: up to Completer.max_batch (5000).
SHAPES = [(5_000, 500), (30_000, 5_000)]


@pytest.mark.parametrize(("table_rows", "n"), [*SHAPES, (100_000, 1_500)])
@pytest.mark.parametrize(
    ("statement", "status"),
    [
        ("RECORD", "delivered"),
        ("RECORD", "pending"),
        ("RECORD", "mixed"),
        ("RECORD_DELETING", "delivered"),
        ("RECORD_DELETING", "pending"),
        ("RECORD_DELETING", "mixed"),
    ],
)
async def test_recording_outcomes_is_linear(
    db_url: str, statement: str, status: str, table_rows: int, n: int
) -> None:
    conn = await _connect(db_url)
    try:
        ids, tokens = await _claimed_events(conn, table_rows, n)
        statuses = (
            [("delivered", "pending")[i % 2] for i in range(n)]
            if status == "mixed"
            else [status] * n
        )
        sql = queries.render_ops(getattr(queries, statement), "public")
        args: list[Any] = [ids, tokens, statuses, [1] * n, [1.0] * n, [None] * n, RELAY]
        if statement == "RECORD_DELETING":  # the delivered pairs again (Store.record)
            delivered = [
                (i, t) for i, t, st in zip(ids, tokens, statuses, strict=True) if st == "delivered"
            ]
            args += [[i for i, _ in delivered], [t for _, t in delivered]]
        raw = await conn.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, *args)
        _assert_linear(raw, n, table_rows)
        # And the statement did its job: every row left running.
        assert await conn.fetchval("SELECT count(*) FROM outbox WHERE status = 'running'") == 0
    finally:
        await conn.close()


@pytest.mark.parametrize("statement", ["HEARTBEAT", "RELEASE"])
async def test_lease_statements_are_linear(db_url: str, statement: str) -> None:
    conn = await _connect(db_url)
    try:
        ids, tokens = await _claimed_events(conn)
        sql = queries.render_ops(getattr(queries, statement), "public")
        heartbeat = statement == "HEARTBEAT"
        args: tuple[Any, ...] = (ids, tokens, RELAY, 600.0) if heartbeat else (RELAY, ids, tokens)
        _assert_linear(await conn.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, *args), N)
        assert await _extended_and_running(conn, "outbox") == ((N, N) if heartbeat else (0, 0))
    finally:
        await conn.close()


@pytest.mark.parametrize(("table_rows", "n"), SHAPES)
@pytest.mark.parametrize("statement", ["RECORD_DELIVERED", "RECORD_DELIVERED_DELETING"])
async def test_recording_plain_deliveries_is_linear(
    db_url: str, statement: str, table_rows: int, n: int
) -> None:
    conn = await _connect(db_url)
    try:
        ids, tokens = await _claimed_events(conn, table_rows, n)
        sql = queries.render_ops(getattr(queries, statement), "public")
        raw = await conn.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, ids, tokens, RELAY)
        _assert_linear(raw, n)
        assert await conn.fetchval("SELECT count(*) FROM outbox WHERE status = 'running'") == 0
    finally:
        await conn.close()


async def _claimed_deliveries(conn: asyncpg.Connection) -> tuple[list[int], list[int]]:
    endpoint = await conn.fetchval(
        "INSERT INTO outbox_endpoints (destination, url, secret) "
        "VALUES ('hooks', 'http://127.0.0.1:9/', 'whsec_x') RETURNING id"
    )
    await conn.execute(
        "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination) "
        "SELECT i, $1, 'hooks' FROM generate_series(1, 5000) AS i",
        endpoint,
    )
    await conn.execute("VACUUM ANALYZE outbox_deliveries")
    rows = await conn.fetch(
        "UPDATE outbox_deliveries SET status = 'running', locked_by = $1, "
        "locked_until = now() + interval '1 minute', claims = claims + 1 "
        "WHERE id IN (SELECT id FROM outbox_deliveries ORDER BY id LIMIT $2) "
        "RETURNING id, claims",
        RELAY,
        N,
    )
    return [r[0] for r in rows], [r[1] for r in rows]


async def test_recording_deliveries_is_linear(db_url: str) -> None:
    conn = await _connect(db_url)
    try:
        ids, tokens = await _claimed_deliveries(conn)
        sql = queries.render_ops(queries.DELIVERY_RECORD, "public")
        raw = await conn.fetchval(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + sql,
            ids,
            tokens,
            ["delivered"] * N,
            [1] * N,
            [0.0] * N,
            [None] * N,
            [204] * N,
            list(range(1, N + 1)),
            [1] * N,
            [1.0] * N,
            [None] * N,
            [False] * N,
            RELAY,
        )
        _assert_linear(raw, N)
        running = "SELECT count(*) FROM outbox_deliveries WHERE status = 'running'"
        assert await conn.fetchval(running) == 0
    finally:
        await conn.close()


@pytest.mark.parametrize("statement", ["DELIVERY_HEARTBEAT", "DELIVERY_RELEASE"])
async def test_delivery_lease_statements_are_linear(db_url: str, statement: str) -> None:
    conn = await _connect(db_url)
    try:
        ids, tokens = await _claimed_deliveries(conn)
        sql = queries.render_ops(getattr(queries, statement), "public")
        heartbeat = statement == "DELIVERY_HEARTBEAT"
        args: tuple[Any, ...] = (ids, tokens, RELAY, 600.0) if heartbeat else (RELAY, ids, tokens)
        _assert_linear(await conn.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, *args), N)
        expected = (N, N) if heartbeat else (0, 0)
        assert await _extended_and_running(conn, "outbox_deliveries") == expected
    finally:
        await conn.close()


@pytest.mark.parametrize("park", [False, True])
async def test_ordered_claim_reads_only_its_destinations_rows_in_flight(
    db_url: str, park: bool
) -> None:
    """The ordered claim reads the keys in flight from its own destination's running rows,
    never from every destination's (many relays' batches of other destinations in flight),
    and reads no table scan, whatever the statistics say about running rows; it compares
    each key walked with the keys in flight by hash, never with each of them (with
    statistics that expect few running rows, a plan looped over them per key: 375,250 rows
    read for a batch of 500 when the destination parks poison rows)."""
    conn = await _connect(db_url)
    try:
        await conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")
        await conn.execute(
            "INSERT INTO outbox (destination, key, payload) "
            "SELECT CASE WHEN i <= 20000 THEN 'x' ELSE 'd' END, 'k' || (i % 1000), "
            "'\\x00'::bytea FROM generate_series(1, 50000) AS i"
        )
        await conn.execute("VACUUM ANALYZE")  # taken while every row was pending
        # Another destination's 20,000 rows in flight, and half of this one's keys.
        await conn.execute(
            "UPDATE outbox SET status = 'running', locked_by = 'other', claims = 1, "
            "locked_until = now() + interval '1 minute' "
            "WHERE destination = 'x' OR (id BETWEEN 20001 AND 20500)"
        )
        safe = await conn.fetchval("SELECT max(id) FROM outbox")
        sql = queries.render_ops(queries.CLAIM_ORDERED, "public")
        async with conn.transaction():
            # The plan a planner expecting few running rows may take (it did, for a reviewer,
            # and not here): the keys in flight must not be joined, by any join, key by key.
            await conn.execute("SET LOCAL enable_hashjoin = off")
            await conn.execute("SET LOCAL enable_mergejoin = off")
            args = ("d", N, RELAY, 60.0, 2000, park, None, safe, None)
            raw = await conn.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, *args)
            claimed = await conn.fetch(
                "SELECT id, key FROM outbox WHERE status = 'running' AND locked_by = $1", RELAY
            )
    finally:
        await conn.close()
    busy = {f"k{i % 1000}" for i in range(20001, 20501)}
    # Every key not in flight had its head claimed (as many as the batch holds), none other.
    assert len(claimed) == N and not {r["key"] for r in claimed} & busy
    assert all(r["id"] <= 21000 for r in claimed)  # each key's lowest waiting row
    plan = json.loads(raw) if isinstance(raw, str) else raw
    scans = [
        n.get("Relation Name") for n in _nodes(plan[0]["Plan"]) if n["Node Type"] == "Seq Scan"
    ]
    assert not scans, scans
    # The walk passes at most every key (1,000) and the in-flight read 500 rows.
    _assert_linear(plan, 1000)


def _keys(*spans: tuple[int, int]) -> list[str]:
    return [f"k{i:04}" for a, b in spans for i in range(a, b + 1)]


@pytest.mark.parametrize(
    ("cursor", "origin", "expected", "next_cursor"),
    [
        (None, None, _keys((0, 99)), "k0099"),  # from the first key
        ("k0500", None, _keys((501, 600)), "k0600"),  # on from a cursor, towards the last key
        ("k0500", "k0550", _keys((501, 550)), None),  # up to the end of a round
        ("k1950", "k1950", _keys((1951, 1999), (0, 50)), "k0050"),  # round to the first key
        ("k1950", "k0020", _keys((1951, 1999), (0, 20)), None),  # ... up to the round's end
    ],
)
@pytest.mark.parametrize("indexes", ["0011", "before 0011"])
async def test_ordered_claim_keeps_its_rounds_bounds_in_the_index(
    db_url: str,
    cursor: str | None,
    origin: str | None,
    expected: list[str],
    next_cursor: str | None,
    indexes: str,
) -> None:
    """Each part of the ordered claim's walk keeps its bounds in the index scan: a bound read
    as a filter would read every waiting row past it (here 10 per key, 2,000 keys) at the
    step that ends the round. The same on the indexes from before migration 0011 (the key
    index with running rows, the lease index without the destination), which a relay rolled
    out before the migration runs on (docs/deploying.md)."""
    conn = await _connect(db_url)
    try:
        if indexes == "before 0011":
            await conn.execute(
                "DROP INDEX outbox_key_idx; DROP INDEX outbox_lease_idx;"
                " CREATE INDEX outbox_key_idx ON outbox (destination, key, id)"
                " WHERE status IN ('pending', 'running', 'failed') AND key IS NOT NULL;"
                " CREATE INDEX outbox_lease_idx ON outbox (locked_until) WHERE status = 'running'"
            )
        await conn.execute(
            "INSERT INTO outbox (destination, key, payload) "
            "SELECT 'd', 'k' || lpad((i % 2000)::text, 4, '0'), '\\x00'::bytea "
            "FROM generate_series(0, 19999) AS i"
        )
        await conn.execute("VACUUM ANALYZE outbox")
        sql = queries.render_ops(queries.CLAIM_ORDERED, "public")
        args = ("d", 100, RELAY, 60.0, 400, False, cursor, 10**9, origin)
        raw = await conn.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, *args)
        claimed = await conn.fetch("SELECT id, key FROM outbox WHERE status = 'running'")
        await conn.execute("UPDATE outbox SET status = 'pending' WHERE status = 'running'")
        result = await conn.fetch(sql, *args)
    finally:
        await conn.close()
    _assert_linear(raw, 100)
    assert "Seq Scan" not in json.dumps(raw if not isinstance(raw, str) else json.loads(raw))
    assert sorted(r["key"] for r in claimed) == sorted(expected)
    assert all(r["id"] <= 2000 for r in claimed)  # each key's head
    assert result[-1]["key"] == next_cursor


async def test_retention_examines_each_kept_event_once_per_run(db_url: str) -> None:
    """Events kept for an open delivery (their endpoint failing or disabled) are the oldest
    delivered rows. A retention run examines each once, resuming each batch after the last
    row the previous one examined, instead of walking all of them again in every batch (as
    PURGE_DELIVERED's filter does: 3,000 rows read and dropped per batch of 500 here)."""
    from relay.db.store import Store, create_pool

    kept, doomed, batch = 3000, 2000, 500
    conn = await _connect(db_url)
    try:
        await conn.execute(
            "INSERT INTO outbox (destination, payload, status, attempts, delivered_at) "
            "SELECT 'c', '\\x00'::bytea, 'delivered', 1, now() - interval '2 hours' "
            "  - make_interval(secs => $1 - i) FROM generate_series(1, $1) AS i",
            kept + doomed,
        )
        await conn.execute(
            "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination) "
            "SELECT id, 1, 'c' FROM outbox ORDER BY delivered_at LIMIT $1",
            kept,
        )
        await conn.execute("VACUUM ANALYZE")
        sql = queries.render_ops(queries.RETENTION_DELIVERED, "public")
        trial = conn.transaction()
        await trial.start()
        raw = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", 60.0, batch, None, None)
        await trial.rollback()
        _assert_linear(raw, batch)
    finally:
        await conn.close()
    pool = await create_pool(to_asyncpg_dsn(db_url), RELAY, 2)
    try:
        store = Store(pool, "public", RELAY, 30.0)
        batches, deleted, cursor = 0, 0, None
        while True:
            done = await store.delete_finished(60.0, batch, 30 * 86400.0, cursor)
            assert done is not None
            batches += 1
            deleted += done.deleted
            if not done.more:
                break
            cursor = done.cursor
            assert batches < 50, "the run does not end"
    finally:
        await pool.close()
    assert deleted == doomed
    assert batches <= (kept + doomed) // batch + 1
    left = await _connect(db_url)
    try:
        assert await left.fetchval("SELECT count(*) FROM outbox") == kept
    finally:
        await left.close()


async def _batch_claimed(
    conn: asyncpg.Connection, table_rows: int, n: int, analyze: bool = True
) -> tuple[list[int], list[int]]:
    """``n`` fresh rows taken by a batch lease (queries.CLAIM_BATCH) of a table of
    ``table_rows`` pending rows, statistics taken while every row was fresh (or none, as in a
    database where autovacuum is off or has not come by yet)."""
    await conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")
    await conn.execute(
        "INSERT INTO outbox (destination, key, payload) "
        # Payloads of 200 bytes, as bench drain's: the table's size in pages prices a read of
        # it whole against a read of the batch's rows by id.
        "SELECT 'd', 'k' || (i % 50), convert_to(repeat('x', 200), 'UTF8') "
        "FROM generate_series(1, $1) AS i",
        table_rows,
    )
    # No statistics: the table vacuumed, never analyzed (bench drain's prefill; autovacuum off
    # or not yet by): the planner knows its size, not what its rows hold.
    await conn.execute("VACUUM ANALYZE" if analyze else "VACUUM")
    epoch = await conn.fetchval(
        "SELECT pg_relation_filenode(pg_get_serial_sequence('outbox', 'id')::regclass)::bigint"
    )
    rows = await conn.fetch(
        queries.render_ops(queries.CLAIM_BATCH, "public"), "d", n, RELAY, 60.0, 2**62, epoch
    )
    assert len(rows) == n and all(r[8] < 0 for r in rows)
    return [r[0] for r in rows], [r[8] for r in rows]


# A batch a small part of a large table: a drain's (bench drain --claims batch, 100,000 rows,
# no statistics). The fences' CASE hid the rows' ids from the planner, which then read the
# whole table into a hash for each record of three batches of 500 (the completer records them
# at once): 19k events/s instead of 53k.
BATCH_SHAPES = [(*shape, True) for shape in SHAPES] + [
    (100_000, 1_500, False),
    (100_000, 1_500, True),
]


@pytest.mark.parametrize(("table_rows", "n", "analyze"), BATCH_SHAPES)
@pytest.mark.parametrize(
    "statement",
    [
        "RECORD_BATCH",
        "RECORD_BATCH_DELETING",
        "RECORD_BATCH_DELIVERED",
        "RECORD_BATCH_DELIVERED_DELETING",
        "RELEASE_BATCH",
    ],
)
async def test_batch_statements_are_linear(
    db_url: str, statement: str, table_rows: int, n: int, analyze: bool
) -> None:
    """The statements on a batch's rows read each row by its key, never the fresh rows of the
    destination (every row of the table, here) that their fence names."""
    conn = await _connect(db_url)
    try:
        ids, tokens = await _batch_claimed(conn, table_rows, n, analyze)
        sql = queries.render_ops(getattr(queries, statement), "public")
        args: list[Any]
        if statement == "RELEASE_BATCH":
            args = [RELAY, ids, tokens]
        elif statement.startswith("RECORD_BATCH_DELIVERED"):
            args = [ids, tokens, RELAY]
        else:
            args = [ids, tokens, ["delivered"] * n, [1] * n, [1.0] * n, [None] * n, RELAY]
            if statement == "RECORD_BATCH_DELETING":
                args += [ids, tokens]
        raw = await conn.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, *args)
        _assert_linear(raw, n, table_rows)
        # And the statement did its job: none of the batch's rows is fresh any more.
        fresh = await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE id = ANY($1::bigint[]) "
            "AND status = 'pending' AND claims = 0 AND run_after <= created_at",
            ids,
        )
        assert fresh == 0
    finally:
        await conn.close()


@pytest.mark.parametrize("analyze", [False, True])
async def test_settled_reads_its_rows_by_id_among_many_delivered(
    db_url: str, analyze: bool
) -> None:
    """queries.SETTLED (the rows a heartbeat missed, 1,500 of them: a relay that stalled) on a
    table of 100,000 delivered rows kept by retention, statistics taken before they were
    delivered or none: its status test named outbox_delivered_idx, and the planner hashed every
    delivered row of the table."""
    conn = await _connect(db_url)
    try:
        ids, tokens = await _claimed_events(conn, 101_500, 1_500)
        await conn.execute(
            "UPDATE outbox SET status = 'delivered', delivered_at = now(), finished_at = now() "
            "WHERE status = 'pending'"
        )
        await conn.execute("VACUUM ANALYZE outbox" if analyze else "VACUUM outbox")
        sql = queries.render_ops(queries.SETTLED, "public")
        raw = await conn.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, ids, tokens)
        _assert_linear(raw, 1_500, 101_500)
        await conn.execute("UPDATE outbox SET status = 'delivered' WHERE id = $1", ids[0])
        assert [r[0] for r in await conn.fetch(sql, ids, tokens)] == [ids[0]]
    finally:
        await conn.close()


async def test_the_delivery_claims_walk_reads_the_claim_index_beside_a_delivered_history(
    db_url: str,
) -> None:
    """DELIVERY_CLAIM walks the endpoints with pending deliveries (a loose scan, one probe
    each). Ordered by endpoint_id alone, that probe could be served by the endpoint index
    (endpoint_id, id), which holds every delivery ever made: once the table had statistics
    (autovacuum's ANALYZE) from a drain under way, the planner took it, and each probe stepped
    over all of an endpoint's delivered rows to its first pending one (18,000 pages and 20 ms
    a claim after 128,000 deliveries). The walk reads the claim index (pending rows only).
    (Reproduced here with the statistics of a drain a fifth done.)"""
    pool = await create_pool(to_asyncpg_dsn(db_url), RELAY, 1)
    conn = await _connect(db_url)
    try:
        endpoints = [
            await conn.fetchval(
                "INSERT INTO outbox_endpoints (destination, url, secret) "
                "VALUES ('hooks', 'http://127.0.0.1:9/', 'whsec_x') RETURNING id"
            )
            for _ in range(8)
        ]
        # 2,000 events fanned out to 8 endpoints, then claimed and recorded delivered 32 at a
        # time by the relay's own statements, until 3,200 are done.
        for first in range(1, 2001, 500):  # as FAN_OUT writes them: 500 events a statement
            await conn.execute(
                "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination) "
                "SELECT i, e, 'hooks' "
                "FROM generate_series($2::int, $2 + 499) AS i, unnest($1::bigint[]) AS e",
                endpoints,
                first,
            )
        store = DeliveryStore(Store(pool, "public", RELAY, 30.0))
        cursor = None
        for _ in range(100):
            got, cursor, _ = await store.claim(["hooks"], [4], [4], 2000, [], 1000, cursor, {})
            await store.record([_delivered(c) for c in got])
        await conn.execute("ANALYZE outbox_deliveries")
        sql = queries.render_ops(queries.DELIVERY_CLAIM, "public")
        limits = json.dumps({str(e): UNCAPPED for e in endpoints})
        args = (["hooks"], [4], 2000, RELAY, limits, 1000, None, 30.0, [], [4], 4, UNCAPPED, 2000)
        explain = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql
        lanes = await lane_args(conn)
        raw = await conn.fetchval(explain, *args, True, *lanes)  # True: a sweep, whole walk
        plan = json.loads(raw) if isinstance(raw, str) else raw
        used = {n.get("Index Name") for n in _nodes(plan[0]["Plan"])}
        assert "outbox_deliveries_endpoint_idx" not in used, used
        # 16 for each endpoint, each one's next floor, and the cursor
        assert plan[0]["Plan"]["Actual Rows"] == 16 * 8 + 8 + 1
    finally:
        await conn.close()
        await pool.close()
