"""relay.db.pool.transaction: a transaction whose BEGIN goes with its first statements in one
round trip (the fan-outs' and delivery claims' in-flight lock). A connection must go back to
the pool outside any transaction: asyncpg would roll it back at release, but reports it as an
error to the event loop ("Resetting connection with an active transaction"), which the relay
logs. One connection in the pool, so each test sees what the next user of that connection
would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from relay.db import queries
from relay.db.pool import create_pool, transaction

LOCK = "BEGIN; SELECT pg_advisory_xact_lock(4242, 7)"


@pytest.fixture
async def pool(db_url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await create_pool(to_asyncpg_dsn(db_url), "transaction-test", 1)
    async with pool.acquire() as conn:
        await conn.execute("CREATE TABLE IF NOT EXISTS tx_probe (n int)")
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def loop_errors() -> list[str]:
    """What is reported to the event loop's exception handler meanwhile."""
    seen: list[str] = []

    def handler(_: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        seen.append(str(context.get("message")))

    asyncio.get_running_loop().set_exception_handler(handler)
    return seen


async def _next_user_sees(pool: asyncpg.Pool) -> tuple[bool, int]:
    async with pool.acquire() as conn:
        return conn.is_in_transaction(), await conn.fetchval("SELECT count(*) FROM tx_probe")


async def test_it_commits_and_holds_the_first_statements_lock_until_then(
    pool: asyncpg.Pool, admin: asyncpg.Connection
) -> None:
    async with transaction(pool, LOCK) as conn:
        assert conn.is_in_transaction()
        await conn.execute("INSERT INTO tx_probe VALUES (1)")
        assert await admin.fetchval("SELECT count(*) FROM tx_probe") == 0  # not yet committed
        # Taken by the BEGIN's own round trip, held by the transaction.
        assert not await admin.fetchval("SELECT pg_try_advisory_xact_lock(4242, 7)")
    assert await admin.fetchval("SELECT count(*) FROM tx_probe") == 1
    assert await admin.fetchval("SELECT pg_try_advisory_lock(4242, 7)")  # released at commit
    assert await _next_user_sees(pool) == (False, 1)


async def test_a_statement_that_fails_inside_is_rolled_back_before_the_pool_has_it_again(
    pool: asyncpg.Pool, loop_errors: list[str]
) -> None:
    with pytest.raises(asyncpg.DivisionByZeroError):
        async with transaction(pool, LOCK) as conn:
            await conn.execute("INSERT INTO tx_probe VALUES (1)")
            await conn.execute("SELECT 1 / 0")
    # Not in the aborted transaction ("current transaction is aborted, commands ignored"):
    # the insert is gone and the connection answers.
    assert await _next_user_sees(pool) == (False, 0)
    assert loop_errors == []  # rolled back here, not by the pool's release


async def test_first_statements_that_fail_leave_no_transaction_open(
    pool: asyncpg.Pool, loop_errors: list[str]
) -> None:
    with pytest.raises(asyncpg.DivisionByZeroError):
        async with transaction(pool, "BEGIN; SELECT 1 / 0") as conn:
            await conn.execute("INSERT INTO tx_probe VALUES (1)")
    assert await _next_user_sees(pool) == (False, 0)
    assert loop_errors == []


async def test_an_error_of_the_callers_own_leaves_nothing_behind(pool: asyncpg.Pool) -> None:
    with pytest.raises(RuntimeError):
        async with transaction(pool, LOCK) as conn:
            await conn.execute("INSERT INTO tx_probe VALUES (1)")
            raise RuntimeError("the caller's own")
    # Not a plain SQL error: the connection is closed, as any other such (pool.connection).
    assert await _next_user_sees(pool) == (False, 0)


def test_the_lock_key_is_written_in() -> None:
    lock = queries.render_ops(queries.FAN_OUT_LOCK, "public")
    begin = queries.begin_locked(lock, -123)
    assert begin.startswith("BEGIN; ")
    assert "$1" not in begin and begin.count("(-123)::int") == lock.count("$1")
    with pytest.raises(ValueError):
        queries.begin_locked("SELECT pg_advisory_xact_lock($1, $2)", 1)
    with pytest.raises(ValueError):
        queries.begin_locked("SELECT 1", 1)


async def test_the_lowest_lock_key_is_written_so_that_postgresql_reads_it(
    pool: asyncpg.Pool,
) -> None:
    """Found by review: ``-2147483648::int`` is ``-(2147483648::int)``, out of range. A
    schema whose CRC-32 is 0x80000000 (this one) had every fan-out that sends at once and
    every delivery claim fail, as the bound parameter never did."""
    schema = "outbox_aaaaccaccaacacaaaaaccccaacaaaaccaaaaaaaa"
    key = queries.serial_key(schema)
    assert key == -(2**31)
    for lock in (queries.FAN_OUT_LOCK, queries.DELIVERY_CLAIM_LOCK):
        begin = queries.begin_locked(queries.render_ops(lock, "public"), key)
        async with transaction(pool, begin) as conn:
            assert conn.is_in_transaction()


async def test_a_cancel_that_comes_during_the_rollback_is_not_lost(
    pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: cancelled while it rolled back after an SQL error, the task raised
    the SQL error: the cancel was swallowed, and a caller that catches database errors (the
    fan-outs do) went on as if nothing had asked it to stop."""
    execute = asyncpg.Connection.execute
    rolling_back = asyncio.Event()

    async def slow_rollback(self: asyncpg.Connection, query: str, *args: Any, **kw: Any) -> Any:
        if query == "ROLLBACK":
            rolling_back.set()
            await asyncio.sleep(30)
        return await execute(self, query, *args, **kw)

    monkeypatch.setattr(asyncpg.Connection, "execute", slow_rollback)

    async def run() -> None:
        async with transaction(pool, LOCK) as conn:
            await conn.fetchval("SELECT 1 / 0")

    task = asyncio.create_task(run())
    await asyncio.wait_for(rolling_back.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _waiting_for_a_lock(conn: asyncpg.Connection, app: str) -> int:
    n: int = await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE application_name = $1 AND wait_event_type = 'Lock'",
        app,
    )
    return n


@pytest.mark.parametrize("how", ["cancelled", "command_timeout"])
async def test_a_wait_for_the_lock_cut_short_leaves_no_backend_waiting_for_it(
    db_url: str, admin: asyncpg.Connection, how: str
) -> None:
    """Found by review: cancelled (or timed out, command_timeout) while BEGIN and the lock
    waited, the connection was closed at once, and with it asyncpg's cancel request, never
    sent: the backend stayed in the lock's queue until it had the lock (behind an
    application's open replay, for as long as that lasts; one more at each timeout).
    asyncpg's own transaction rolled back first, which waits for the cancel."""
    app = f"tx-cut-{how}"
    pool = await create_pool(
        to_asyncpg_dsn(db_url), app, 1, command_timeout=0.5 if how == "command_timeout" else None
    )
    app = f"outbox-relay:{app}"
    await admin.execute("SELECT pg_advisory_lock(4242, 7)")
    try:

        async def run() -> None:
            async with transaction(pool, LOCK):
                pass

        task = asyncio.create_task(run())
        for _ in range(50):
            await asyncio.sleep(0.05)
            if await _waiting_for_a_lock(admin, app):
                break
        assert await _waiting_for_a_lock(admin, app) == 1
        if how == "cancelled":
            task.cancel()
        with pytest.raises(asyncio.CancelledError if how == "cancelled" else TimeoutError):
            await task
        for _ in range(20):
            if not await _waiting_for_a_lock(admin, app):
                break
            await asyncio.sleep(0.05)
        assert await _waiting_for_a_lock(admin, app) == 0
    finally:
        await admin.execute("SELECT pg_advisory_unlock_all()")
        await pool.close()


async def test_a_transaction_is_begun_by_its_first_statement(pool: asyncpg.Pool) -> None:
    with pytest.raises(ValueError, match="BEGIN"):
        async with transaction(pool, "SELECT pg_advisory_xact_lock(4242, 7)"):
            pass
    assert await _next_user_sees(pool) == (False, 0)
