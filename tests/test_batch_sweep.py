"""The sweep below batched destinations' chains (queries.SWEEP_BATCHES, run by Store.sweep):
fresh rows at or below a chain's end that no live batch holds are moved to the waiting lane,
and the races it meets leave every row to whoever wrote it first."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from outbox.status import Status
from relay.db import queries
from relay.db.store import Record, Store
from relay.model import Envelope

LEASE = 60.0


def batch_store(pool: asyncpg.Pool, relay: str) -> Store:
    return Store(pool, "public", relay, LEASE, batched={"d"})


async def insert(pool: asyncpg.Pool, n: int) -> list[int]:
    rows = await pool.fetch(
        "INSERT INTO outbox (destination, payload) "
        "SELECT 'd', '\\x00'::bytea FROM generate_series(1, $1) RETURNING id",
        n,
    )
    return [r[0] for r in rows]


async def insert_at(pool: asyncpg.Pool, row_id: int) -> None:
    """A row given its id by hand (below the chain's end: the id of a row deleted)."""
    await pool.execute(
        "INSERT INTO outbox (id, destination, payload) OVERRIDING SYSTEM VALUE "
        "VALUES ($1, 'd', '\\x00')",
        row_id,
    )


async def fresh_ids(pool: asyncpg.Pool) -> list[int]:
    rows = await pool.fetch(
        "SELECT id FROM outbox WHERE status = 'pending' AND claims = 0 "
        "AND run_after <= created_at ORDER BY id"
    )
    return [r[0] for r in rows]


def delivered(envs: list[Envelope]) -> list[Record]:
    return [Record(e.id, e.token, Status.DELIVERED, 1, 0.0, None) for e in envs]


async def test_the_sweep_leaves_a_live_batchs_rows_to_it(pool: asyncpg.Pool) -> None:
    """Rows in flight under a live batch are fresh and below the chain's end: the sweep leaves
    them (before and after a heartbeat), and their outcomes are recorded."""
    ids = await insert(pool, 10)
    a = batch_store(pool, "relay-a")
    envs = await a.claim("d", 10)
    assert len(envs) == 10
    assert await a.sweep() == 0
    assert await a.heartbeat([(e.id, e.token) for e in envs])
    assert await a.sweep() == 0
    assert await fresh_ids(pool) == ids
    assert len(await a.record(delivered(envs))) == 10


async def test_an_id_given_by_hand_below_an_ended_chain_is_claimed_once(
    pool: asyncpg.Pool,
) -> None:
    """A row inserted with an explicit id below the end of a chain whose batches have all
    ended: moved to the waiting lane, claimed once; fresh rows above the chain stay the
    claims' (taken in a batch)."""
    await insert(pool, 10)
    a = batch_store(pool, "relay-a")
    assert len(await a.record(delivered(await a.claim("d", 10)))) == 10
    await pool.execute("UPDATE outbox_batches SET lease_until = now() - interval '1 s'")
    assert await a.reap_batches(5, {"d": 5}) == []
    await pool.execute("DELETE FROM outbox WHERE id = 5")
    await insert_at(pool, 5)
    above = await insert(pool, 3)
    assert await a.sweep() == 1
    assert await fresh_ids(pool) == above
    got = await batch_store(pool, "relay-b").claim("d", 10)
    assert sorted(e.id for e in got) == [5, *above]
    assert [e.token > 0 for e in got if e.id == 5] == [True]  # claimed as a row, not a batch
    assert await a.sweep() == 0


async def test_a_batch_added_while_the_sweep_runs_keeps_its_rows(pool: asyncpg.Pool) -> None:
    """A claim adds a batch its snapshot, older than the sweep's commit or not, cannot show
    the sweep: it covers only ids above the end the sweep read, which the sweep leaves."""
    await insert(pool, 10)
    a = batch_store(pool, "relay-a")
    assert len(await a.record(delivered(await a.claim("d", 10)))) == 10
    await pool.execute("UPDATE outbox_batches SET relay = NULL")  # ended, all recorded
    await pool.execute("DELETE FROM outbox WHERE id = 5")
    await insert_at(pool, 5)
    above = await insert(pool, 5)
    epoch = await pool.fetchval(
        "SELECT pg_relation_filenode(pg_get_serial_sequence('outbox', 'id')::regclass)::bigint"
    )
    claim = queries.render_ops(queries.CLAIM_BATCH, "public")
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        rows = await conn.fetch(claim, "d", 10, "relay-c", LEASE, 2**62, epoch)
        taken = sorted(r[0] for r in rows if r[8] < 0)
        assert taken == above  # the waiting lane is empty: 5 is still fresh
        assert await a.sweep() == 1  # row 5, below the end it reads (10)
        await tx.commit()
    assert await fresh_ids(pool) == above
    tokens = {r[0]: r[8] for r in rows}
    c = batch_store(pool, "relay-c")
    written = await c.record([Record(i, tokens[i], Status.DELIVERED, 1, 0.0, None) for i in above])
    assert len(written) == 5
    assert [e.id for e in await c.claim("d", 10)] == [5]


async def test_a_row_written_while_the_sweep_waits_keeps_what_was_written(
    pool: asyncpg.Pool,
) -> None:
    """The sweep reads a row as stranded while another transaction writes it (an outcome, a
    claim, an operator): it waits for that one, reads the row's new version, no longer
    fresh, and leaves it as written."""
    await insert(pool, 10)
    a = batch_store(pool, "relay-a")
    assert len(await a.record(delivered(await a.claim("d", 10)))) == 10
    await pool.execute("UPDATE outbox_batches SET relay = NULL")
    await pool.execute("DELETE FROM outbox WHERE id = 5")
    await insert_at(pool, 5)
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        await conn.execute(
            "UPDATE outbox SET status = 'delivered', attempts = 1, claims = 1, "
            "delivered_at = now(), finished_at = now() WHERE id = 5"
        )
        sweep = asyncio.create_task(a.sweep())
        for _ in range(200):  # until the sweep waits for the row's lock
            waiting = await pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE '%WITH chain AS MATERIALIZED%'"
            )
            if waiting:
                break
            await asyncio.sleep(0.05)
        assert waiting and not sweep.done()
        await tx.commit()
    assert await sweep == 0
    row = await pool.fetchrow("SELECT status, claims, attempts FROM outbox WHERE id = 5")
    assert tuple(row) == ("delivered", 1, 1)


# --- Found by a review of the sweep's rule for live batches (age of xmin) --------------------


@pytest.mark.parametrize(
    "rewrite",
    [
        # A rewrite that copies every row into a new version (as pg_repack's copy, or an
        # ALTER TABLE that changes a column's type, does): each row's xmin is the rewrite's.
        "ALTER TABLE outbox ALTER COLUMN attempts TYPE bigint",
        # A backfill that keeps the rows fresh (an application's migration of its headers).
        'UPDATE outbox SET headers = headers || \'{"x": "1"}\'::jsonb',
    ],
)
async def test_the_sweep_leaves_a_live_batchs_rows_to_it_after_their_xmin_changed(
    pool: asyncpg.Pool, rewrite: str
) -> None:
    """A live batch's rows whose versions were written after the batch (a table rewrite that
    gives every row a new xmin, which docs/deploying.md says leaves batches in flight as they
    are): the sweep took them for ids handed out again and moved them to the waiting lane,
    where any claim took them by row while relay A delivered them (twice), and A's outcomes
    were refused."""
    ids = await insert(pool, 10)
    a = batch_store(pool, "relay-a")
    envs = await a.claim("d", 10)
    assert len(envs) == 10
    await pool.execute(rewrite)
    assert await a.sweep() == 0
    assert await fresh_ids(pool) == ids
    assert await batch_store(pool, "relay-b").claim("d", 10) == []
    assert len(await a.record(delivered(envs))) == 10


async def test_an_id_given_by_hand_in_a_live_batchs_range_is_claimed_once(
    pool: asyncpg.Pool,
) -> None:
    """What the rule is for: a row given by hand the id of one that a live batch took and whose
    outcome was recorded (deleted since) is no row of that batch: the sweep moves it to the
    waiting lane, and it is claimed once, by row."""
    await insert(pool, 10)
    a = batch_store(pool, "relay-a")
    envs = await a.claim("d", 10)
    assert len(await a.record(delivered(envs))) == 10  # the batch is still live (its lease)
    await pool.execute("DELETE FROM outbox WHERE id = 5")
    await insert_at(pool, 5)
    assert await a.sweep() == 1
    assert await fresh_ids(pool) == []
    got = await batch_store(pool, "relay-b").claim("d", 10)
    assert [(e.id, e.token > 0) for e in got] == [(5, True)]


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


@pytest.mark.parametrize("statistics", [False, True])
async def test_the_sweep_reads_one_batch_per_row_in_flight(
    pool: asyncpg.Pool, statistics: bool
) -> None:
    """Rows in flight in live batches are below the chain's end, and the sweep looks for the
    live batch of each. It read the chain key from the destination's first batch kept up to
    the row's id, every ended batch of the last ten minutes (forget_batches) for each row in
    flight: with no statistics of outbox_batches yet, 2,000 rows in flight and 5,000 batches
    kept read 10 million index entries (5 s; at 3,000 events/s a relay keeps 18,000 batches and
    holds up to 2,000 rows). The batch that may hold a row is the one with the highest first
    id below it (a chain's ranges follow each other): one entry per row."""
    ended, in_flight = 3000, 600
    epoch = await pool.fetchval(
        "SELECT pg_relation_filenode(pg_get_serial_sequence('outbox', 'id')::regclass)::bigint"
    )
    # A history: ended batches of ten rows each, delivered and deleted (retention 0).
    await pool.execute("SELECT setval(pg_get_serial_sequence('outbox', 'id'), $1)", ended * 10)
    await pool.execute(
        "INSERT INTO outbox_batches (destination, epoch, first_id, last_id, relay, lease_until) "
        "SELECT 'd', $1, i * 10, i * 10 + 10, NULL, now() FROM generate_series(0, $2 - 1) AS i",
        epoch,
        ended,
    )
    await insert(pool, in_flight)
    a = batch_store(pool, "relay-a")
    held: list[Envelope] = []
    while len(held) < in_flight:
        held += await a.claim("d", 100)
    if statistics:
        await pool.execute("ANALYZE outbox_batches")
        await pool.execute("ANALYZE outbox")
    sql = queries.render_ops(queries.SWEEP_BATCHES, "public")
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        raw = await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, "d")
        await tx.rollback()
    plan = json.loads(raw) if isinstance(raw, str) else raw
    read = 0
    for node in _plan_nodes(plan[0]["Plan"]):
        if node.get("Relation Name") == "outbox_batches":
            per_loop = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
            read += per_loop * node.get("Actual Loops", 1)
    assert read <= 2 * in_flight + 10, f"{read} batches read for {in_flight} rows in flight"
    assert await a.sweep() == 0
    assert len(await a.record(delivered(held))) == in_flight
