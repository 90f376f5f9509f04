"""Batch leases (relay.claims = "batch") and what the relays share: the rows of destinations
no relay serves, and the registry. A row in flight in a batch is pending and unattempted in the
table (claims = 0) until its outcome; what looks at pending rows must not take it for one that
nobody serves."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from relay.db.store import Store

LEASE = 60.0


@pytest.fixture
async def pool(db_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(to_asyncpg_dsn(db_url), min_size=1, max_size=4)
    assert p is not None
    try:
        yield p
    finally:
        await p.close()


async def insert(pool: asyncpg.Pool, n: int, destination: str = "d") -> list[int]:
    rows = await pool.fetch(
        "INSERT INTO outbox (destination, payload) "
        "SELECT $1, '\\x00'::bytea FROM generate_series(1, $2) RETURNING id",
        destination,
        n,
    )
    return [r[0] for r in rows]


async def test_rows_in_flight_in_a_live_batch_are_not_failed_as_unknown(
    pool: asyncpg.Pool,
) -> None:
    """Relay A (not in the registry, or not seen for a while) holds a live batch of d. Relay B,
    serving only e with unknown_destinations = "fail", failed A's rows in flight as of an
    unknown destination: they look pending and unattempted. A's outcomes were then refused
    (the rows no longer fresh) and `retry` would have sent them again. The rows of d in no
    live batch are failed, as before."""
    await insert(pool, 6)
    a = Store(pool, "public", "relay-a", LEASE, batched={"d"})
    taken = await a.claim("d", 4)
    assert len(taken) == 4 and all(e.token < 0 for e in taken)
    b = Store(pool, "public", "relay-b", LEASE)
    failed = await b.fail_unknown_destinations(["e"], 600.0, 0.0)
    rows = await pool.fetch("SELECT id, status FROM outbox ORDER BY id")
    in_flight = {e.id for e in taken}
    assert [r["id"] for r in rows if r["status"] == "failed"] == [
        r["id"] for r in rows if r["id"] not in in_flight
    ]
    assert len(failed) == 2
    # An ended batch (reaped: relay NULL) spares nothing.
    await pool.execute("UPDATE outbox_batches SET relay = NULL")
    assert len(await b.fail_unknown_destinations(["e"], 600.0, 0.0)) == 4
