"""The relay's book of held rows: what it renews, what it let go, what waits for a record."""

from __future__ import annotations

import dataclasses
from collections import Counter

from relay.obs.metrics import Metrics
from relay.pipeline.leases import Leases
from tests.webhook_helpers import envelope


async def test_rows_let_go_leave_no_trace() -> None:
    """Rows whose hand-off failed and which the relay then let go (forget) are neither held
    nor remembered as waiting for the completer: a thousand failed hand-offs leak nothing."""
    leases = Leases(Metrics(), Counter())
    envs = [envelope() for _ in range(1000)]
    leases.claimed(envs)
    leases.handed(envs)
    assert leases.capacity.is_set()  # rows left their sink: the claim may take more
    leases.forget(envs)
    assert len(leases) == 0
    assert leases.tokens() == []
    assert leases._handed == {}


async def test_a_row_claimed_again_replaces_its_earlier_claim() -> None:
    leases = Leases(Metrics(), Counter())
    first = envelope(id=42)
    leases.claimed([first])
    again = dataclasses.replace(envelope(id=42), token=2)
    leases.claimed([again])
    assert leases.tokens() == [(42, 2)]
    assert 42 in first.lease.lost  # the earlier claim can no longer send or record


async def test_a_row_its_sink_recorded_is_not_lost_to_a_heartbeat(db_url: str) -> None:
    """The endpoints sink records an event in its fan-out's statement, before the relay has
    handed the outcome over: a heartbeat in between must not take the row for one reaped
    (relay.lease.lost, the metric) while a row reaped meanwhile still is."""
    import asyncpg

    from outbox.dburl import to_asyncpg_dsn
    from relay.db.store import Store, create_pool

    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(
            "INSERT INTO outbox (destination, payload) SELECT 'd', '\\x00'::bytea "
            "FROM generate_series(1, 3)"
        )
    finally:
        await conn.close()
    pool = await create_pool(to_asyncpg_dsn(db_url), "r1", 2)
    try:
        store = Store(pool, "public", "r1", 30.0)
        recorded, reaped, kept = await store.claim("d", 10)
        conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
        try:
            # As FAN_OUT records an event, and as the reaper of another relay takes one back.
            await conn.execute(
                "UPDATE outbox SET status = 'delivered', delivered_at = now(), locked_by = NULL,"
                " locked_until = NULL WHERE id = $1",
                recorded.id,
            )
            await conn.execute(
                "UPDATE outbox SET status = 'pending', locked_by = NULL, locked_until = NULL "
                "WHERE id = $1",
                reaped.id,
            )
        finally:
            await conn.close()
        stats: Counter[str] = Counter()
        leases = Leases(Metrics(), stats)
        leases.claimed([recorded, reaped, kept])
        await leases.heartbeat(store, 30.0)
        assert recorded.id not in recorded.lease.lost
        assert reaped.id in reaped.lease.lost and stats["lease_lost"] == 1
        assert leases.tokens() == sorted([(recorded.id, recorded.token), (kept.id, kept.token)])
    finally:
        await pool.close()
