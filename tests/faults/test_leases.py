"""A dead relay's rows are claimable again within one lease and one poll interval."""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from tests.support.faults import Writer, all_delivered, fetchval
from tests.support.relays import running, settings, wait_until

pytestmark = pytest.mark.slow


async def test_expired_leases_are_reaped_within_a_poll_interval(
    db_url: str, kafka_bootstrap: str
) -> None:
    """The reaper used to run every lease / 2: a row could stay `running` half a lease past
    its expiry (15 s with the default 30 s lease). It now runs every poll interval."""
    ids = await Writer(db_url, 20).run()
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        # A relay that died holding rows whose lease runs out 1.5 s from now.
        await conn.execute(
            "UPDATE outbox SET status = 'running', locked_by = 'dead-relay', "
            "locked_until = now() + interval '1.5 seconds' WHERE id = ANY($1)",
            ids,
        )
        s = settings(
            db_url,
            kafka_bootstrap,
            topic=f"reap-{uuid.uuid4().hex[:8]}",
            relay={"lease": 10, "poll_interval": 0.2},
        )
        async with running(s):
            expiry = await conn.fetchval("SELECT max(locked_until) FROM outbox")

            async def reaped() -> bool:
                return not await conn.fetchval(
                    "SELECT count(*) FROM outbox WHERE status = 'running'"
                )

            await wait_until(reaped, timeout=15, interval=0.02, what="rows reaped")
            returned_at = await conn.fetchval("SELECT clock_timestamp()")
            await wait_until(lambda: all_delivered(db_url, 20), what="delivered by the relay")
    finally:
        await conn.close()
    overrun = (returned_at - expiry).total_seconds()
    assert overrun < 0.2 * 1.1 + 0.6, f"rows stayed running {overrun:.2f}s past their lease"
    # The lost attempt counts, then the delivery.
    assert await fetchval(db_url, "SELECT array_agg(DISTINCT attempts) FROM outbox") == [2]


async def test_reaping_keeps_its_pace_with_a_long_poll_interval(
    db_url: str, kafka_bootstrap: str
) -> None:
    """A long poll interval does not stretch the lease: reaping is at most every lease / 2."""
    s = settings(
        db_url,
        kafka_bootstrap,
        topic=f"reap-{uuid.uuid4().hex[:8]}",
        relay={"lease": 2, "poll_interval": 60},
    )
    ids = await Writer(db_url, 5).run()
    await fetchval(
        db_url,
        "UPDATE outbox SET status = 'running', locked_by = 'dead-relay', "
        "locked_until = now() + interval '0.5 seconds' WHERE id = ANY($1)",
        ids,
    )
    async with running(s):
        started = time.monotonic()
        await wait_until(lambda: all_delivered(db_url, 5), timeout=15, what="reaped, delivered")
        await asyncio.sleep(0)
    # Expired after 0.5 s, reaped within lease / 2 (1 s) and claimed at once (the reaper
    # wakes the claim loop rather than leaving it to the 60 s poll).
    assert time.monotonic() - started < 0.5 + 1.1 + 1.0
