"""The unordered claim's two lanes (migration 0012, queries.CLAIM): fresh rows are walked from
where the previous claim ended, so a held snapshot's dead entries are not walked again, and yet
no row is ever passed over: a transaction that commits late, another relay's claim that rolls
back, a row due later, a row retried, a table truncated under a running relay."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

import outbox
from outbox.dburl import to_asyncpg_dsn
from relay.db import queries
from relay.db.claims import FENCE_REUSE
from relay.db.store import Record, Store, create_pool
from tests.support import pg


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[Store]:
    pool = await create_pool(to_asyncpg_dsn(db_url), "lanes", 4)
    try:
        yield Store(pool, "public", "lanes", 30.0)
    finally:
        await pool.close()


@pytest.fixture
async def conn(db_url: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        yield c
    finally:
        await c.close()


async def add(conn: asyncpg.Connection, n: int, **fields: Any) -> list[int]:
    async with conn.transaction():
        return await outbox.enqueue_many(
            conn, [{"destination": "d", "payload": {"n": i}, **fields} for i in range(n)]
        )


async def claim_all(store: Store) -> list[int]:
    return [e.id for e in await store.claim("d", 100)]


async def deliver(store: Store, ids_tokens: list[tuple[int, int]]) -> None:
    await store.record([Record(i, t, "delivered", 1, 0.0, None, "d") for i, t in ids_tokens])


@contextlib.asynccontextmanager
async def held_snapshot(db_url: str) -> AsyncIterator[None]:
    """A snapshot held for the block, as a pg_dump or a report holds one."""
    holder = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await holder.fetchval("SELECT count(*) FROM outbox")
        yield
    finally:
        await holder.close()


async def churn(store: Store, conn: asyncpg.Connection, rounds: int = 6, n: int = 500) -> None:
    """Rows enqueued, claimed and delivered: under a held snapshot, dead entries kept."""
    for _ in range(rounds):
        await add(conn, n)
        claimed = await store.claim("d", n)
        assert len(claimed) == n
        await deliver(store, [(e.id, e.token) for e in claimed])


async def test_a_transaction_that_commits_late_is_not_passed_over(
    db_url: str, store: Store, conn: asyncpg.Connection
) -> None:
    """Ids are drawn at insert, rows seen at commit: the claim takes the rows committed after
    an open insert, and the cursor stays below the open one's ids, which come next."""
    late = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = late.transaction()
        await tx.start()
        (early_id,) = await outbox.enqueue_many(late, [{"destination": "d", "payload": {}}])
        later = await add(conn, 3)
        assert await claim_all(store) == later
        # The cursor passed the open insert's id, and its key is among those held.
        lane = store.unordered.cursors["d"]
        assert early_id < lane.cursor and any(
            int(k.rsplit("/", 1)[1]) < early_id for k in lane.held
        )
        await tx.commit()
    finally:
        await late.close()
    assert await claim_all(store) == [early_id]


async def test_another_relays_claim_that_rolls_back_leaves_its_rows_claimable(
    store: Store, conn: asyncpg.Connection
) -> None:
    ids = await add(conn, 10)
    other = conn.transaction()
    await other.start()
    # Another relay's claim in progress: it holds the first five rows' locks.
    await conn.execute("SELECT id FROM outbox WHERE id = ANY($1) FOR UPDATE", ids[:5])
    assert await claim_all(store) == ids[5:]
    assert store.fresh_cursor("d") < ids[0]
    await other.rollback()
    assert await claim_all(store) == ids[:5]


async def test_rows_due_later_and_retried_rows_come_back_after_the_cursor_passed(
    store: Store, conn: asyncpg.Connection
) -> None:
    (delayed,) = await add(conn, 1, run_after=datetime.now(UTC) + timedelta(seconds=1.5))
    fresh = await add(conn, 3)
    claimed = await store.claim("d", 100)
    assert [e.id for e in claimed] == fresh
    assert store.fresh_cursor("d") >= fresh[-1]
    # One of them fails and is retried at once; the others are delivered.
    await store.record([Record(fresh[0], claimed[0].token, "pending", 1, 0.0, "503", "d")])
    await deliver(store, [(e.id, e.token) for e in claimed[1:]])
    assert await claim_all(store) == [fresh[0]]
    await asyncio.sleep(1.6)
    assert await claim_all(store) == [delayed]


async def test_a_table_truncated_with_restart_identity_is_claimed_from_the_start(
    store: Store, conn: asyncpg.Connection
) -> None:
    await add(conn, 5)
    assert len(await claim_all(store)) == 5
    await conn.execute("TRUNCATE outbox RESTART IDENTITY")
    again = await add(conn, 2)
    assert again == [1, 2]
    got = await claim_all(store)  # this one finds the cursor ahead of every id
    got += await claim_all(store)
    assert got == again


async def test_a_full_claim_leaves_the_rest_for_the_next(
    store: Store, conn: asyncpg.Connection
) -> None:
    ids = await add(conn, 7)
    assert [e.id for e in await store.claim("d", 3)] == ids[:3]
    assert [e.id for e in await store.claim("d", 3)] == ids[3:6]
    assert [e.id for e in await store.claim("d", 3)] == ids[6:]


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


async def fresh_pages(conn: asyncpg.Connection, lane: Any, claimable: int, limit: int = 100) -> int:
    """The pages of outbox_fresh_idx a claim of "d" from ``lane`` (a store's, or None: from the
    start) reads, in a transaction rolled back (nothing claimed); ``claimable``: the rows it
    must find."""
    claim = queries.render_ops(queries.CLAIM, "public")
    cursor, above, recheck = (0, 0, 0) if lane is None else (lane.cursor, lane.top, lane.recheck)
    tx = conn.transaction()
    await tx.start()
    try:
        raw = await conn.fetchval(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + claim,
            "d",
            limit,
            "x",
            30.0,
            cursor,
            above,
            recheck,
        )
    finally:
        await tx.rollback()
    plan = json.loads(raw) if isinstance(raw, str) else raw
    (update,) = [n for n in _nodes(plan[0]["Plan"]) if n["Node Type"] == "ModifyTable"]
    assert update["Actual Rows"] == claimable
    return sum(
        int(n["Shared Hit Blocks"] + n["Shared Read Blocks"])
        for n in _nodes(plan[0]["Plan"])
        if n.get("Index Name") == "outbox_fresh_idx"
    )


async def test_under_a_held_snapshot_the_claim_walks_only_what_came_since_the_last(
    db_url: str, store: Store, conn: asyncpg.Connection
) -> None:
    """A snapshot held while 3,000 rows are claimed and delivered keeps their dead entries in
    the fresh lane; the next claim from the cursor reads a few pages, from the start of the
    range every dead entry's."""
    async with held_snapshot(db_url):
        await churn(store, conn)
        await add(conn, 10)
        from_cursor = await fresh_pages(conn, store.unordered.cursors["d"], 10)
        from_start = await fresh_pages(conn, None, 10)
        assert from_cursor < 20 and from_cursor * 6 < from_start, (from_cursor, from_start)


async def test_under_a_held_snapshot_the_reaper_passes_over_recent_leases_only(
    db_url: str, store: Store, conn: asyncpg.Connection
) -> None:
    """Every claimed row leaves a dead entry in outbox_lease_idx with its lease's end: a
    bounded pass (leases ended in the last seconds) reads a few pages, a full pass all of them;
    both reap the row whose lease just expired."""
    async with held_snapshot(db_url):
        await add(conn, 10_000)
        # Claimed and delivered long ago (their leases ended an hour back), as a held
        # snapshot keeps them.
        claimed = await store.claim("d", 10_000)
        await conn.execute("UPDATE outbox SET locked_until = now() - interval '1 hour'")
        await deliver(store, [(e.id, e.token) for e in claimed])
        (stuck,) = await add(conn, 1)
        await store.claim("d", 10)
        await conn.execute(
            "UPDATE outbox SET locked_until = now() - interval '1 s' WHERE id = $1", stuck
        )
        reap = queries.render_ops(queries.REAP, "public")

        async def pages_read(within: float | None) -> int:
            tx = conn.transaction()
            await tx.start()
            try:
                raw = await conn.fetchval(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + reap,
                    25,
                    5000,
                    [],
                    [],
                    None,
                    [],
                    within,
                )
            finally:
                await tx.rollback()
            plan = json.loads(raw) if isinstance(raw, str) else raw
            top = plan[0]["Plan"]
            assert top["Node Type"] == "ModifyTable" and top["Actual Rows"] == 1  # the stuck row
            return int(top["Shared Hit Blocks"] + top["Shared Read Blocks"])

        # The relay serves "d" (in the registry, or as the statement's own destinations).
        await conn.execute("INSERT INTO outbox_relays (relay_id, destinations) VALUES ('r', '{d}')")
        bounded, full = await pages_read(11.0), await pages_read(None)
        assert bounded * 4 < full, (bounded, full)


class _Watching(Store):
    """A store that notes the bound of each reaper pass."""

    passes: list[float | None]

    async def reap(self, *args: Any, within: float | None = None, **kw: Any) -> Any:
        self.passes.append(within)
        return await super().reap(*args, within=within, **kw)


async def test_the_reaper_bounds_its_passes_after_a_complete_one_and_goes_full_now_and_then(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.maintenance import reaper as reaper_module
    from relay.obs.metrics import Metrics

    margin = reaper_module.MARGIN  # before it is patched below
    pool = await create_pool(to_asyncpg_dsn(db_url), "lanes", 2)
    try:
        store = _Watching(pool, "public", "lanes", 30.0)
        store.passes = []
        reaper = reaper_module.Reaper(store, 25, {"d": 25}, Metrics(), lambda: None)
        await reaper()
        await asyncio.sleep(0.3)
        await reaper()
        monkeypatch.setattr(reaper_module, "FULL_EVERY", 0.0)
        await reaper()
        # A pass that reaps as many rows as it may is not complete: the next one still
        # reaches back to the last complete pass, where the rows it left behind are.
        monkeypatch.setattr(reaper_module, "FULL_EVERY", 300.0)
        monkeypatch.setattr(reaper_module, "REAP_LIMIT", 2)
        monkeypatch.setattr(reaper_module, "MARGIN", 0.2)
        async with pool.acquire() as c:
            await c.execute(
                "INSERT INTO outbox (destination, payload, status, locked_by, locked_until, "
                "claims) SELECT 'd', '\\x00', 'running', 'gone', now() - interval '0.1 s', 1 "
                "FROM generate_series(1, 3)"
            )
        await asyncio.sleep(1.0)
        await reaper()  # two of the three
        await reaper()  # the third, though its lease ended before this pass's margin
        async with pool.acquire() as c:
            left = await c.fetchval("SELECT count(*) FROM outbox WHERE status = 'running'")
    finally:
        await pool.close()
    first, second, third, *limited = store.passes
    assert first is None and third is None
    # The bound reaches back to when the previous pass began, and the margin before it.
    assert second is not None and margin + 0.3 <= second < margin + 5
    assert len(limited) == 2 and all(w is not None and w >= 1.2 for w in limited)
    assert left == 0


# The claim of the release before migration 0012 (one lane, outbox_claim_idx), as relays not yet
# upgraded run it during a rolling upgrade.
CLAIM_BEFORE_0012 = """
WITH picked AS (
    SELECT id FROM {table}
    WHERE status = 'pending' AND run_after <= now() AND destination = $1
    ORDER BY run_after, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS o
SET status = 'running', locked_by = $3, locked_until = now() + make_interval(secs => $4),
    claims = o.claims + 1
WHERE o.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING o.id, o.destination, o.key, o.payload, o.content_type, o.headers::text,
          o.attempts, extract(epoch FROM o.created_at)::float8, o.claims, o.event_type
"""


async def test_relays_of_both_releases_share_a_table_each_row_claimed_once(
    db_url: str, store: Store, conn: asyncpg.Connection
) -> None:
    """A rolling upgrade: a relay of the earlier release claims with its one-lane statement
    while a new relay claims with the lanes; rows come in, go back for a retry, and each
    claim of a row is one relay's, never both."""
    old_claim = queries.render_ops(CLAIM_BEFORE_0012, "public")
    old = await asyncpg.connect(to_asyncpg_dsn(db_url))
    old_store = Store(store.pool, "public", "old", 30.0)
    claims: dict[int, int] = {}
    taken: Counter[str] = Counter()
    try:
        ids = await add(conn, 200)
        for round_ in range(30):
            if round_ % 3 == 0:
                ids += await add(conn, 50)
            # At once, on two connections: SKIP LOCKED between the two releases' claims.
            new_rows, old_rows = await asyncio.gather(
                store.claim("d", 20), old.fetch(old_claim, "d", 20, "old", 30.0)
            )
            assert len(new_rows) <= 20 and len(old_rows) <= 20
            taken["new"] += len(new_rows)
            taken["old"] += len(old_rows)
            for i, token in [(e.id, e.token) for e in new_rows] + [(r[0], r[8]) for r in old_rows]:
                assert claims.get(i, 0) < token, f"row {i} claimed twice under one token"
                claims[i] = token
            # Every fifth row goes back for a retry, the rest are delivered; each relay
            # records its own (the outcome statement is the same in both releases).
            for relay, rows in (
                (store, [(e.id, e.token) for e in new_rows]),
                (old_store, [(r[0], r[8]) for r in old_rows]),
            ):
                await relay.record(
                    [
                        Record(
                            i,
                            t,
                            "pending" if i % 5 == 0 and t == 1 else "delivered",
                            1,
                            0.0,
                            None,
                            "d",
                        )
                        for i, t in rows
                    ]
                )
        for _ in range(20):
            more = await store.claim("d", 100)
            await store.record(
                [Record(e.id, e.token, "delivered", 1, 0.0, None, "d") for e in more]
            )
            if not more:
                break
    finally:
        await old.close()
    left = await conn.fetchval("SELECT count(*) FROM outbox WHERE status <> 'delivered'")
    assert left == 0 and set(claims) == set(ids)
    assert taken["old"] >= 200 and taken["new"] >= 200, taken
    assert {i for i, t in claims.items() if t == 2} >= {i for i in ids if i % 5 == 0}


async def test_a_relay_refuses_a_schema_without_the_lanes(
    db_url: str, conn: asyncpg.Connection, store: Store
) -> None:
    assert await store.missing_tables() == []
    await conn.execute("DROP INDEX outbox_fresh_idx")
    assert await store.missing_tables() == ['"public"."outbox_fresh_idx" (migration 0012)']


async def naive_pending(conn: asyncpg.Connection) -> dict[str, int]:
    rows = await conn.fetch(
        "SELECT destination, count(*) FROM outbox WHERE status = 'pending' GROUP BY destination"
    )
    return {r[0]: r[1] for r in rows}


async def gauges(store: Store) -> dict[str, int]:
    stats = await store.pending_stats()
    assert stats is not None
    return {d: n for d, (n, _) in stats.items()}


async def test_the_pending_gauges_count_from_their_floors_what_a_full_count_counts(
    db_url: str, store: Store, conn: asyncpg.Connection
) -> None:
    """Rows claimed and delivered, retried, due later, of destinations served or not, of a
    transaction that commits late, of a table truncated: the gauges, counted from the floors
    the previous count left, agree with a count of every pending row."""
    await conn.execute("INSERT INTO outbox_relays (relay_id, destinations) VALUES ('r', '{b}')")

    async def put(destination: str, n: int, **fields: Any) -> list[int]:
        async with conn.transaction():
            return await outbox.enqueue_many(
                conn, [{"destination": destination, "payload": {}, **fields} for _ in range(n)]
            )

    await put("a", 5)
    await put("b", 3)
    await put("zz", 2)  # nobody serves it
    assert await gauges(store) == await naive_pending(conn) == {"a": 5, "b": 3, "zz": 2}
    claimed = await store.claim("a", 4)
    await store.record([Record(claimed[0].id, claimed[0].token, "pending", 1, 60.0, "x", "a")])
    await deliver(store, [(e.id, e.token) for e in claimed[1:]])
    await put("a", 2, run_after=datetime.now(UTC) + timedelta(hours=1))
    await put("c", 1)
    late = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = late.transaction()
        await tx.start()
        await outbox.enqueue_many(late, [{"destination": "a", "payload": {}}])
        await put("a", 2)
        assert await gauges(store) == await naive_pending(conn)
        await tx.commit()
    finally:
        await late.close()
    assert await gauges(store) == await naive_pending(conn) == {"a": 7, "b": 3, "c": 1, "zz": 2}
    await conn.execute("TRUNCATE outbox RESTART IDENTITY")
    await put("b", 1)
    assert await gauges(store) == {"b": 1}


async def test_under_a_held_snapshot_the_pending_gauges_read_only_past_their_floors(
    db_url: str, store: Store, conn: asyncpg.Connection
) -> None:
    async with held_snapshot(db_url):
        assert await gauges(store) == {}
        await add(conn, 5000)
        claimed = await store.claim("d", 5000)
        await deliver(store, [(e.id, e.token) for e in claimed])
        await add(conn, 3)
        assert await gauges(store) == {"d": 3}  # this count walks the dead entries once
        pending = queries.render_ops(queries.PENDING_BY_DESTINATION, "public")
        fence = await conn.fetchval(queries.render_ops(queries.FENCE, "public"), "outbox", 0)

        async def pages_read(floors: dict[str, int]) -> int:
            raw = await conn.fetchval(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + pending,
                list(floors),
                list(floors.values()),
                fence,
            )
            plan = json.loads(raw) if isinstance(raw, str) else raw
            return int(plan[0]["Plan"]["Shared Hit Blocks"] + plan[0]["Plan"]["Shared Read Blocks"])

        floors = store.gauges.floors
        assert floors["d"] > claimed[-1].id
        from_floor, from_start = await pages_read(floors), await pages_read({"d": 0})
        assert from_floor * 4 < from_start, (from_floor, from_start)


# --- review (i27-review): tests that fail on the code as it stands -------------------------


async def _claim_until_empty(store: Store, rounds: int = 5) -> list[int]:
    got: list[int] = []
    for _ in range(rounds):
        more = await store.claim("d", 100)
        await deliver(store, [(e.id, e.token) for e in more])
        got += [e.id for e in more]
    return got


async def test_ids_handed_out_again_after_a_truncate_are_claimed_though_past_the_cursor(
    store: Store, conn: asyncpg.Connection
) -> None:
    """TRUNCATE … RESTART IDENTITY while the destination is not being claimed (paused, its
    circuit open, the relay reconnecting): by its next claim the new ids have passed the old
    cursor. The table's new file tells the relay to walk from the start again (a failover's
    new server likewise: FENCE's epoch). Found by a review: every id at or below the old
    cursor stayed pending."""
    first = await add(conn, 50)
    assert await _claim_until_empty(store) == first
    cursor = store.fresh_cursor("d")
    assert cursor >= 50
    await conn.execute("TRUNCATE outbox RESTART IDENTITY")
    again = await add(conn, 60)  # ids 1..60, more than the cursor, before the next claim
    got = await _claim_until_empty(store)
    pending = await conn.fetchval("SELECT count(*) FROM outbox WHERE status = 'pending'")
    assert got == again and pending == 0, (len(got), pending, cursor)


async def test_ids_handed_out_again_by_a_sequence_set_back_are_found_by_the_sweep(
    store: Store, conn: asyncpg.Connection
) -> None:
    """A sequence set back by hand (rows 41..50 gone, their ids handed out again) leaves no
    mark on the table or the server: the sweep (every 30 minutes) finds the fresh rows below
    the cursor and the claims walk from them again. Found by a review: they stayed pending."""
    ids = await add(conn, 50)
    assert await _claim_until_empty(store) == ids
    await conn.execute("DELETE FROM outbox WHERE id > 40")
    await conn.execute("SELECT setval(pg_get_serial_sequence('outbox', 'id'), 40)")
    new = await add(conn, 20)  # ids 41..60
    got = await _claim_until_empty(store)
    assert await store.sweep() == 1
    got += await _claim_until_empty(store)
    assert sorted(got) == new, sorted(set(new) - set(got))
    assert await store.sweep() == 0


async def test_an_open_inserting_transaction_holds_back_the_fence_not_the_cursor(
    db_url: str, store: Store, conn: asyncpg.Connection
) -> None:
    """An application transaction that inserted an outbox row and stays open (idle in
    transaction) holds both the xmin horizon and the fence. Found by a review: the cursor
    could not pass the fence, so each claim walked every dead entry claimed since it began,
    as before migration 0012."""
    holder = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = holder.transaction()
        await tx.start()
        await outbox.enqueue_many(holder, [{"destination": "other", "payload": {}}])
        await churn(store, conn)
        await add(conn, 10)
        blocks = await fresh_pages(conn, store.unordered.cursors["d"], 10)
        # Before: the fresh CTE and the next cursor's subquery each walked 3,000 dead entries.
        assert blocks < 15, (store.unordered.cursors["d"], blocks)
    finally:
        await holder.close()


async def test_rows_due_again_do_not_go_ahead_of_an_older_fresh_row(
    store: Store, conn: asyncpg.Connection
) -> None:
    """Both lanes are read and their rows claimed in run_after order. Found by a review: the
    waiting lane went first, whatever its run_after, so with a sink that has a few free slots
    per claim and a steady supply of due retries, a fresh row was never claimed."""
    (fresh,) = await add(conn, 1)
    await asyncio.sleep(0.05)
    await add(conn, 3, run_after=datetime.now(UTC) + timedelta(seconds=0.2))
    await asyncio.sleep(0.3)
    order = []
    for _ in range(4):
        order += [e.id for e in await store.claim("d", 1)]
    assert order[0] == fresh, order


async def test_a_claim_cut_by_its_limit_while_an_insert_is_open_leaves_its_row_for_later(
    db_url: str, store: Store, conn: asyncpg.Connection
) -> None:
    late = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = late.transaction()
        await tx.start()
        (early,) = await outbox.enqueue_many(late, [{"destination": "d", "payload": {}}])
        later = await add(conn, 5)
        got = [e.id for e in await store.claim("d", 2)]
        got += [e.id for e in await store.claim("d", 2)]
        await tx.commit()
    finally:
        await late.close()
    for _ in range(4):
        got += [e.id for e in await store.claim("d", 2)]
    assert sorted(got) == sorted([early, *later])


async def test_a_claim_takes_at_most_its_limit_from_both_lanes(
    store: Store, conn: asyncpg.Connection
) -> None:
    await add(conn, 3, run_after=datetime.now(UTC) + timedelta(seconds=0.1))
    await asyncio.sleep(0.2)
    await add(conn, 3)
    assert len(await store.claim("d", 2)) == 2
    assert len(await store.claim("d", 5)) == 4


async def test_a_relay_refuses_a_lane_left_invalid_by_an_interrupted_build(
    conn: asyncpg.Connection, store: Store
) -> None:
    await conn.execute(
        "UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'outbox_waiting_idx'::regclass"
    )
    assert await store.missing_tables() == ['"public"."outbox_waiting_idx" (migration 0012)']


async def flush_stats(pool: asyncpg.Pool) -> None:
    """Make every connection of ``pool`` send its statistics now (they wait up to 10 s)."""
    conns = [await pool.acquire() for _ in range(pool.get_size())]
    try:
        for c in conns:
            await c.execute("SELECT pg_stat_force_next_flush()")
    finally:
        for c in conns:
            await pool.release(c)


async def test_under_a_held_snapshot_the_relays_claims_read_what_came_since_the_last(
    db_url: str, store: Store, conn: asyncpg.Connection
) -> None:
    """Through the store, as the relay claims: the index entries its claim reads, counted by
    PostgreSQL (idx_tup_read), are a few from its cursor and thousands from the start."""
    read = "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'outbox_fresh_idx'"
    async with held_snapshot(db_url):
        await churn(store, conn)

        async def entries_read() -> int:
            await add(conn, 10)
            await flush_stats(store.pool)
            before = await conn.fetchval(read)
            assert len(await store.claim("d", 100)) == 10
            await flush_stats(store.pool)
            return int(await conn.fetchval(read) - before)

        from_cursor = await entries_read()
        store.unordered.cursors.clear()  # as after a restart
        from_start = await entries_read()
        assert from_cursor < 100 < 3000 < from_start, (from_cursor, from_start)


# --- second review (i27-review2): tests that fail on a72004a --------------------------------


async def test_a_late_commit_is_claimed_while_another_insert_holds_the_fence(
    db_url: str, store: Store, conn: asyncpg.Connection
) -> None:
    """Commit order is not id order: row x commits after x + 1, which the claim took, so the
    cursor passed x. An application session left idle in transaction after an outbox insert of
    another destination holds the fence below x; the late lane reads only up to the fence, so
    x waits for that unrelated session to end (for ever, with no idle timeout). Before 0012 the
    unordered claim took it at once."""
    idle = await asyncpg.connect(to_asyncpg_dsn(db_url))
    slow = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await idle.execute("BEGIN")
        await outbox.enqueue_many(idle, [{"destination": "other", "payload": {}}])
        tx = slow.transaction()
        await tx.start()
        (x,) = await outbox.enqueue_many(slow, [{"destination": "d", "payload": {}}])
        (after,) = await add(conn, 1)
        assert await claim_all(store) == [after]
        await tx.commit()
        got: list[int] = []
        for _ in range(3):
            got += await claim_all(store)
        assert got == [x], (got, store.unordered.cursors["d"])
    finally:
        await idle.close()
        await slow.close()


async def test_with_retention_zero_an_empty_table_sends_no_claim_through_dead_entries(
    db_url: str, conn: asyncpg.Connection
) -> None:
    """retention = 0 deletes delivered rows as they are recorded: a relay that has caught up
    polls an empty table. Found by a review: FENCE's max(id) was then 0, the mark of rows seen
    fell to 0, and the next claim re-read (0, cursor]: every dead entry a held snapshot kept,
    after every idle poll, as before migration 0012."""
    read = "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'outbox_fresh_idx'"
    pool = await create_pool(to_asyncpg_dsn(db_url), "lanes", 4)
    store = Store(pool, "public", "lanes", 30.0, delete_delivered=True)
    try:
        async with held_snapshot(db_url):
            await churn(store, conn)
            assert await conn.fetchval("SELECT count(*) FROM outbox") == 0
            assert await store.claim("d", 100) == []  # an idle poll
            await add(conn, 10)
            await flush_stats(pool)
            before = await conn.fetchval(read)
            assert len(await store.claim("d", 100)) == 10
            await flush_stats(pool)
            entries = int(await conn.fetchval(read) - before)
            assert entries < 100, (entries, store.unordered.cursors["d"])
    finally:
        await pool.close()


class _Paused(Store):
    """A store whose claim statement waits for ``go`` once it has read its cursor."""

    go: asyncio.Event
    entered: asyncio.Event

    async def _call(self, method: str, sql: str, *args: Any) -> Any:
        if sql in (self.unordered.claim_late, self.unordered.claim_fresh) and not self.go.is_set():
            self.entered.set()
            await self.go.wait()
        return await super()._call(method, sql, *args)


async def test_a_sweep_that_runs_during_a_claim_is_not_undone_by_it(
    db_url: str, conn: asyncpg.Connection
) -> None:
    """The sweep is a job of its own, beside the claim loop. Found by a review: a claim in
    flight when the sweep rewound a destination wrote back the cursor it computed from the old
    one, and the rows the sweep found waited for the next sweep, though it logged "claiming
    them now". The sweep's rewind now applies after the claim."""
    pool = await create_pool(to_asyncpg_dsn(db_url), "lanes", 4)
    store = _Paused(pool, "public", "lanes", 30.0)
    store.go, store.entered = asyncio.Event(), asyncio.Event()
    store.go.set()
    try:
        ids = await add(conn, 50)
        assert await _claim_until_empty(store) == ids
        await conn.execute("DELETE FROM outbox WHERE id > 40")
        await conn.execute("SELECT setval(pg_get_serial_sequence('outbox', 'id'), 40)")
        new = await add(conn, 5)  # ids 41..45, below `seen`
        store.go.clear()
        store.entered.clear()
        claiming = asyncio.create_task(store.claim("d", 100))
        await store.entered.wait()
        assert await store.sweep() == 1
        store.go.set()
        got = [e.id for e in await claiming]
        got += await _claim_until_empty(store)
        assert sorted(got) == new, (got, store.unordered.cursors["d"])
    finally:
        await pool.close()


async def test_a_waiting_lane_built_by_the_first_0012_is_refused(
    conn: asyncpg.Connection, store: Store
) -> None:
    """0012 was edited in place (claims > 0 became claims <> 0); a schema migrated by the first
    version keeps its index (the migration is recorded, never run again), which the claim's
    predicate cannot use. Found by a review: the relay started anyway, and its waiting lane
    read outbox_claim_idx. It refuses now, saying how to rebuild it."""
    await conn.execute("DROP INDEX outbox_waiting_idx")
    await conn.execute(
        "CREATE INDEX outbox_waiting_idx ON outbox (destination, run_after, id) "
        "WHERE status = 'pending' AND (claims > 0 OR run_after > created_at)"
    )
    (missing,) = await store.missing_tables()
    assert "as migration 0012 builds it now" in missing and "DROP INDEX CONCURRENTLY" in missing


async def test_with_retention_zero_the_fence_of_an_idle_poll_reads_few_entries(
    db_url: str, conn: asyncpg.Connection
) -> None:
    """FENCE's max(id) reads the primary key from the highest id it saw before. Found by a
    review: read from the end, with retention = 0 and a held snapshot, a caught-up relay's
    every poll walked back over every deleted row's entry to find the table empty."""
    read = "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'outbox_pkey'"
    pool = await create_pool(to_asyncpg_dsn(db_url), "lanes", 4)
    store = Store(pool, "public", "lanes", 30.0, delete_delivered=True)
    try:
        async with held_snapshot(db_url):
            await churn(store, conn)
            await flush_stats(pool)
            before = await conn.fetchval(read)
            assert await store.claim("d", 100) == []  # an idle poll
            await flush_stats(pool)
            entries = int(await conn.fetchval(read) - before)
            assert entries < 100, entries
    finally:
        await pool.close()


async def test_late_rows_the_claim_does_not_take_are_read_again(
    db_url: str, store: Store, conn: asyncpg.Connection
) -> None:
    """Late commits the claim's late lane does not take (its limit, another relay's claim in
    progress that rolls back) must keep `seen` below them. No earlier test has a late row the
    claim leaves: with the next `seen` taken as least(fence, cursor) every test still passes."""
    slow = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = slow.transaction()
        await tx.start()
        early = await outbox.enqueue_many(
            slow, [{"destination": "d", "payload": {"n": i}} for i in range(3)]
        )
        later = await add(conn, 2)
        assert await claim_all(store) == later
        await tx.commit()
    finally:
        await slow.close()
    other = conn.transaction()
    await other.start()
    # Another relay's claim in progress holds the last late row.
    await conn.execute("SELECT id FROM outbox WHERE id = $1 FOR UPDATE", early[2])
    got = [e.id for e in await store.claim("d", 1)]  # the late lane's limit cuts it
    got += [e.id for e in await store.claim("d", 1)]
    await other.rollback()
    for _ in range(3):
        got += await claim_all(store)
    assert got == early, (got, store.unordered.cursors["d"])


async def test_a_late_commit_is_claimed_while_an_insert_that_began_with_it_stays_open(
    db_url: str, store: Store, conn: asyncpg.Connection
) -> None:
    """Two inserts that begin before either draws an id hold the same fence key: the one that
    ends (after the claim passed its row) is news though the other stays open."""
    first = await asyncpg.connect(to_asyncpg_dsn(db_url))
    second = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        t1, t2 = first.transaction(), second.transaction()
        await t1.start()
        await t2.start()
        last = "SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('outbox', 'id')), 0)"
        key = await first.fetchval(last)
        (x,) = await outbox.enqueue_many(first, [{"destination": "d", "payload": {}}])
        # The second took the same key before the first drew its id (the trigger's lock of
        # migration 0004, taken here by hand: the race is not the test's to win).
        await second.execute(
            "SELECT pg_advisory_xact_lock_shared(4611686018427387904"
            " + ((1 + mod('outbox'::regclass::oid::bigint, 16383)) << 48) + $1)",
            key,
        )
        later = await add(conn, 2)
        assert await claim_all(store) == later  # the cursor passes x
        await t1.commit()
        got = [*await claim_all(store), *await claim_all(store)]
        assert got == [x], (got, store.unordered.cursors["d"])
        await t2.rollback()
    finally:
        await first.close()
        await second.close()


async def test_a_late_commit_is_claimed_while_another_insert_holds_an_equal_key(
    db_url: str, store: Store, conn: asyncpg.Connection
) -> None:
    """Two inserts whose triggers read the sequence before either draws take the same key
    (any two concurrent inserts can; here a third session holds that key exclusively for a
    moment so that both triggers read it first). `ended` is a difference of key *values*: when
    the short insert commits, the long one (an unrelated session left idle in transaction,
    another destination) still holds the value, so the short insert's row, which the cursor
    passed, is not read again until the long one ends (or the sweep, every 30 minutes)."""
    await add(conn, 1)  # the sequence has a value
    key = await conn.fetchval(
        "SELECT 4611686018427387904 + ((1 + mod('outbox'::regclass::oid::bigint, 16383)) << 48)"
        " + pg_sequence_last_value(pg_get_serial_sequence('outbox', 'id')::regclass)"
    )
    gate = await asyncpg.connect(to_asyncpg_dsn(db_url))
    idle = await asyncpg.connect(to_asyncpg_dsn(db_url))
    slow = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await gate.execute("SELECT pg_advisory_lock($1::bigint)", key)
        await idle.execute("BEGIN")
        await slow.execute("BEGIN")
        held = asyncio.ensure_future(
            outbox.enqueue_many(idle, [{"destination": "other", "payload": {}}])
        )
        short = asyncio.ensure_future(
            outbox.enqueue_many(slow, [{"destination": "d", "payload": {}}])
        )
        for _ in range(100):  # both triggers have read the sequence and wait for the key
            waiting = await conn.fetchval(pg.UNGRANTED_ADVISORY)
            if waiting == 2:
                break
            await asyncio.sleep(0.05)
        assert waiting == 2
        await gate.execute("SELECT pg_advisory_unlock($1::bigint)", key)
        await held
        (x,) = await short
        (after,) = await add(conn, 1)
        got = await claim_all(store)
        assert after in got and x not in got
        await slow.execute("COMMIT")
        got = []
        for _ in range(3):
            got += await claim_all(store)
        assert got == [x], (got, store.unordered.cursors["d"])
    finally:
        await gate.close()
        await idle.close()
        await slow.close()


# --- a drain's claims go on one FENCE reading (Store.claim, FENCE_REUSE) --------------------


async def test_a_drains_claims_read_the_fence_once_while_its_rows_were_visible_then(
    store: Store, conn: asyncpg.Connection
) -> None:
    """FENCE before every claim was about a twentieth of a drain's database time (planning,
    mostly). A claim that follows a full batch goes on the previous reading while the cursor
    is below the highest id that reading saw, and reads it again past it."""
    first = await add(conn, 1000)
    got = await claim_all(store)
    read = store.statements["fence"]  # the first claim reads twice (it learns the epoch)
    for _ in range(9):
        got += await claim_all(store)
    assert got == first
    assert store.statements["fence"] == read, store.statements
    assert store.statements["claim"] == 10
    # Rows written since: the cursor has reached the reading's highest id, so the next
    # claim reads the fence again (or the late range would reach from that id onwards).
    second = await add(conn, 50)
    assert await claim_all(store) == second
    assert store.statements["fence"] == read + 1, store.statements


async def test_a_partial_batch_ends_the_drain_and_the_next_claim_reads_the_fence(
    store: Store, conn: asyncpg.Connection
) -> None:
    await add(conn, 150)
    assert len(await claim_all(store)) == 100
    read = store.statements["fence"]
    assert len(await claim_all(store)) == 50  # went on the first reading
    assert store.statements["fence"] == read
    await add(conn, 10)
    assert len(await claim_all(store)) == 10
    assert store.statements["fence"] == read + 1, store.statements


async def test_an_old_reading_is_not_reused(
    store: Store, conn: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    await add(conn, 300)
    assert len(await claim_all(store)) == 100
    read = store.statements["fence"]
    monkeypatch.setattr("relay.db.claims.FENCE_REUSE", 0.0)
    assert len(await claim_all(store)) == 100
    assert store.statements["fence"] == read + 1, store.statements


async def test_a_late_commit_during_a_drain_on_one_reading_is_claimed(
    db_url: str, store: Store, conn: asyncpg.Connection
) -> None:
    """An insert open while a drain's claims go on one reading, and committing in the middle:
    the reading still counts it as open, so its end is seen at the next reading, and its row,
    which the cursor passed, is claimed then, once."""
    slow = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = slow.transaction()
        await tx.start()
        (x,) = await outbox.enqueue_many(slow, [{"destination": "d", "payload": {}}])
        rest = await add(conn, 500)
        got = await claim_all(store)
        assert got == rest[:100] and store.fresh_cursor("d") > x
        read = store.statements["fence"]
        await tx.commit()
        got += await claim_all(store)
        # This claim went on the reading that counts the insert as open: x waits for the next.
        assert store.statements["fence"] == read and x not in got
        for _ in range(8):
            got += await claim_all(store)
        assert store.statements["fence"] > read
        assert sorted(got) == sorted([x, *rest]), (len(got), x in got)
        assert Counter(got).most_common(1)[0][1] == 1
    finally:
        await slow.close()


async def test_the_claim_without_a_late_range_is_the_claim_with_an_empty_one(
    store: Store, conn: asyncpg.Connection
) -> None:
    """CLAIM_FRESH is CLAIM without the read of late commits, for claims whose late range
    ($7, $5] is empty; both answer alike there, the marker row included."""
    ids = await add(conn, 30)
    args = ("d", 10, "lanes", 30.0, ids[4], ids[-1])
    answers = []
    lanes = store.unordered
    async with store.pool.acquire() as c:
        for sql, extra in ((lanes.claim_fresh, ()), (lanes.claim_late, (ids[4],))):
            tx = c.transaction()
            await tx.start()
            try:
                answers.append([tuple(r) for r in await c.fetch(sql, *args, *extra)])
            finally:
                await tx.rollback()
    fresh, full = answers
    assert fresh == full
    assert [r[0] for r in fresh[:-1]] == ids[5:15]
    assert fresh[-1][0] == -1 and int(fresh[-1][2]) == ids[14] and int(fresh[-1][4]) == ids[14]


async def test_a_row_updated_while_the_claim_runs_is_claimed_not_passed_over(
    db_url: str, conn: asyncpg.Connection
) -> None:
    """Found by a review of a version whose UPDATE found the chosen rows by ctid: a fresh row
    updated by the application or an operator after the claim's snapshot and before its lock
    was locked in its new version, whose ctid the statement's snapshot cannot see: the UPDATE
    missed it, and the cursor passed it (it was chosen), until the sweep. By id, the update
    follows the row to its new version. The window is widened with a now() that sleeps once,
    resolved through this database's search_path."""
    await conn.execute(
        """
        CREATE TABLE slow_flag(x int);
        CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE plpgsql VOLATILE AS $$
        BEGIN
          IF EXISTS (SELECT 1 FROM public.slow_flag) THEN
            DELETE FROM public.slow_flag;
            PERFORM pg_sleep(0.7);
          END IF;
          RETURN pg_catalog.now();
        END $$;
        """
    )
    db = await conn.fetchval("SELECT current_database()")
    await conn.execute(f'ALTER DATABASE "{db}" SET search_path = public, pg_catalog')
    pool = await create_pool(to_asyncpg_dsn(db_url), "lanes", 4)
    store = Store(pool, "public", "lanes", 30.0)
    try:
        ids = await add(conn, 3)
        await conn.execute("INSERT INTO slow_flag VALUES (1)")
        claim = asyncio.ensure_future(store.claim("d", 100))
        await asyncio.sleep(0.3)  # the claim is past its snapshot, in its fresh lane
        await conn.execute("UPDATE outbox SET headers = headers WHERE id = $1", ids[1])
        got = [e.id for e in await claim]
        for _ in range(3):
            got += await claim_all(store)
        assert sorted(got) == ids, (got, store.fresh_cursor("d"))
    finally:
        await pool.close()


class _FailsItsSecondFence(Store):
    fail = False

    async def _call(self, method: str, sql: str, *args: Any) -> Any:
        if self.fail and sql == self.unordered.fence and args[-1] == 0:
            self.fail = False
            raise asyncpg.QueryCanceledError("canceling statement due to statement timeout")
        return await super()._call(method, sql, *args)


async def test_a_failed_reading_of_a_new_epoch_leaves_no_reading_to_reuse(
    db_url: str, conn: asyncpg.Connection
) -> None:
    """Found by a review: after a TRUNCATE the first reading (its highest id capped by the old
    epoch's) was kept before the epoch's own reading; when that second reading failed, the
    claimer's retry went on the first one, and an insert that began after it, with ids below
    the old highest id, was never read again behind the cursor."""
    pool = await create_pool(to_asyncpg_dsn(db_url), "lanes", 4)
    store = _FailsItsSecondFence(pool, "public", "lanes", 30.0)
    slow = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await add(conn, 300)
        assert len(await claim_all(store)) == 100  # a full batch
        await asyncio.sleep(FENCE_REUSE + 0.1)  # the next claim reads afresh
        await conn.execute("TRUNCATE outbox RESTART IDENTITY")
        store.fail = True
        with pytest.raises(asyncpg.QueryCanceledError):
            await store.claim("d", 100)
        tx = slow.transaction()
        await tx.start()
        (x,) = await outbox.enqueue_many(slow, [{"destination": "d", "payload": {}}])
        rest = await add(conn, 10)
        got = await claim_all(store)  # the claimer's retry
        assert got == rest and store.fresh_cursor("d") > x
        await tx.commit()
        for _ in range(3):
            got += await claim_all(store)
        assert x in got, (x, got, store.fresh_cursor("d"))
    finally:
        await slow.close()
        await pool.close()
