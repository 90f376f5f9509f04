"""The suite's workers (pytest-xdist) share one PostgreSQL server: what a test reads of the
server as a whole (pg_locks, pg_stat_activity) must be its own database's part of it."""

from __future__ import annotations

import asyncio

import asyncpg

from outbox.dburl import to_asyncpg_dsn
from tests.support import pg


async def test_a_lock_waited_on_in_another_database_is_not_counted(
    db_url: str, empty_db_url: str
) -> None:
    holder = await asyncpg.connect(to_asyncpg_dsn(empty_db_url))
    waiter = await asyncpg.connect(to_asyncpg_dsn(empty_db_url))
    mine = await asyncpg.connect(to_asyncpg_dsn(db_url))
    blocked = None
    try:
        # What another worker's test does meanwhile (test_claim_lanes' gate, the completer of
        # test_no_stranded_rows held on lock 4242): an advisory lock waited on elsewhere.
        await holder.execute("SELECT pg_advisory_lock(4242)")
        blocked = asyncio.ensure_future(waiter.execute("SELECT pg_advisory_lock(4242)"))
        for _ in range(200):
            if await holder.fetchval(pg.UNGRANTED_ADVISORY) == 1:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the other database's waiter never waited")
        assert await mine.fetchval(pg.UNGRANTED_ADVISORY) == 0
    finally:
        await holder.execute("SELECT pg_advisory_unlock(4242)")
        if blocked is not None:
            await blocked
        for c in (holder, waiter, mine):
            await c.close()
