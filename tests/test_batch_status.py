"""`status` (and the console, which shows what it reads) counts the rows in flight under batch
leases (relay.claims = "batch") as running, with their relay and lease, although the table
shows them pending: their claim wrote nothing to them."""

from __future__ import annotations

import asyncpg

from outbox.dburl import to_asyncpg_dsn
from outbox.status import Status
from relay.db.store import Record, Store
from relay.ops.status import status


async def test_status_counts_a_batchs_rows_running_until_they_are_recorded(db_url: str) -> None:
    pool = await asyncpg.create_pool(to_asyncpg_dsn(db_url), min_size=1, max_size=2)
    assert pool is not None
    try:
        await pool.execute(
            "INSERT INTO outbox (destination, payload) "
            "SELECT 'd', '\\x00'::bytea FROM generate_series(1, 50)"
        )
        store = Store(pool, "public", "relay-b", 60.0, batched={"d"})
        envs = await store.claim("d", 20)
        assert len(envs) == 20 and all(e.token < 0 for e in envs)
        async with pool.acquire() as conn:
            report = await status(conn, "public")
        (d,) = report.destinations
        assert (d.pending, d.due_now, d.running) == (30, 30, 20)
        assert [(lease.relay, lease.rows) for lease in d.in_flight] == [("relay-b", 20)]
        assert d.in_flight[0].lease_left_s is not None and d.in_flight[0].lease_left_s > 50
        # Recorded: no longer in flight.
        await store.record([Record(e.id, e.token, Status.DELIVERED, 1, 0.0, None) for e in envs])
        async with pool.acquire() as conn:
            report = await status(conn, "public")
        (d,) = report.destinations
        assert (d.pending, d.running, d.delivered, d.in_flight) == (30, 0, 20, [])
    finally:
        await pool.close()
