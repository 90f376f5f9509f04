"""The relay's connections: its pool, how a connection is taken from it (and dropped when a
statement leaves it unusable), and the connection an ordered destination's owner holds apart
from it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg

from relay.db.errors import SESSION_STALE, is_plain_sql_error
from relay.db.session import SESSION_SETTINGS

# asyncpg prepares a statement once a connection and keeps it, but by default only up to 15 KB
# of text: the delivery claim (16 KB) was parsed and analysed again at every call. Every
# statement of relay/db/queries is shorter than this (tests/test_statement_plans.py).
STATEMENT_CACHE_BYTES = 64 * 1024

# How long a transaction's ROLLBACK may take after a statement failed or was cut short: then
# the connection is closed instead.
ROLLBACK_WAIT = 5.0

# How the store's parts run a statement on the pool: ``call(method, sql, *args)`` runs the
# connection's ``method`` ("fetch", "fetchval", …) in a connection of its own (Store._call).
Call = Callable[..., Awaitable[Any]]


async def _no_reset(conn: asyncpg.Connection) -> None:
    """The relay never changes session state on pooled connections (no SET, no LISTEN, only
    transaction-scoped advisory locks), so skip asyncpg's reset round trip on every release."""


@contextlib.asynccontextmanager
async def connection(pool: asyncpg.Pool) -> AsyncIterator[asyncpg.Connection]:
    """A pooled connection. One that fails in the middle of a statement is closed rather
    than returned to the pool: it may be left mid-protocol (the pool skips its reset, see
    ``_no_reset``), and every later use of it would fail."""
    async with pool.acquire() as conn:
        try:
            yield conn
        except BaseException as exc:
            if not is_plain_sql_error(exc) or isinstance(exc, SESSION_STALE):
                # A connection the server closed is already detached from the pool.
                with contextlib.suppress(asyncpg.InterfaceError):
                    conn.terminate()
            raise


@contextlib.asynccontextmanager
async def transaction(pool: asyncpg.Pool, begin: str) -> AsyncIterator[asyncpg.Connection]:
    """A pooled connection in a transaction begun by ``begin``: BEGIN and the statements
    after it, without parameters (one simple query, e.g. queries.begin_locked); committed at
    the end and rolled back on a plain SQL error (any other error closes the connection,
    see ``connection``). asyncpg's own transaction sends BEGIN alone, a round trip of its
    own: at 4,000 deliveries a second each round trip waits about 3 ms for its turn in the
    relay's busy event loop, and the fan-outs, one at a time, paid it every time."""
    if not begin.lstrip().upper().startswith("BEGIN"):
        raise ValueError("a transaction's first statement is its BEGIN")
    async with connection(pool) as conn:
        try:
            await conn.execute(begin)
            yield conn
            await conn.execute("COMMIT")
        except BaseException as exc:
            plain = is_plain_sql_error(exc) and not isinstance(exc, SESSION_STALE)
            # A statement cut short (the task cancelled, a timeout): asyncpg asks the server
            # to cancel it, and its next statement waits for that. Closed at once (as
            # ``connection`` does), the request was never sent: the backend went on waiting
            # for the lock, in its queue, until it had it (asyncpg's own transaction rolled
            # back first, which waited).
            cut = isinstance(exc, asyncio.CancelledError | TimeoutError)
            if not conn.is_closed() and (cut or (plain and conn.is_in_transaction())):
                try:
                    async with asyncio.timeout(ROLLBACK_WAIT):
                        await conn.execute("ROLLBACK")
                except BaseException as failed:
                    conn.terminate()  # never back in the pool inside a transaction
                    if isinstance(failed, asyncio.CancelledError) and failed is not exc:
                        raise  # cancelled meanwhile: the caller's cancel is not lost
                    raise exc from None
            raise


async def dedicated(pool: asyncpg.Pool) -> asyncpg.Connection:
    """A connection like the pool's (its server, settings and statement timeout) outside it:
    one held for as long as the relay owns ordered destinations must not hold up the pool's
    close, nor take one of its connections for good."""
    args: tuple[Any, ...] = pool._connect_args
    kwargs: dict[str, Any] = dict(pool._connect_kwargs)
    # A client gone without a word (a network cut, a frozen host) must not keep its session
    # lock until the kernel's keepalives give up (two hours by default): the stand-bys could
    # not take over. The server probes an idle connection after 10 s, and ends it after 3
    # unanswered probes 5 s apart.
    kwargs["server_settings"] = {
        **kwargs.get("server_settings", {}),
        "tcp_keepalives_idle": "10",
        "tcp_keepalives_interval": "5",
        "tcp_keepalives_count": "3",
    }
    return await asyncpg.connect(*args, **kwargs)


async def create_pool(
    dsn: str, relay_id: str, size: int, command_timeout: float | None = None
) -> asyncpg.Pool:
    """The relay's pool. ``command_timeout`` bounds every statement, so a connection that
    hangs (a partition, a frozen server) fails its statement instead of the task waiting on
    it for ever; the connection is then discarded."""
    return await asyncpg.create_pool(
        dsn,
        min_size=1,
        max_size=size,
        command_timeout=command_timeout,
        reset=_no_reset,
        max_cacheable_statement_size=STATEMENT_CACHE_BYTES,
        server_settings={
            "application_name": f"outbox-relay:{relay_id}"[:63],
            # A plan cached while the table was empty turns into a seq scan + sort once it
            # fills up; plan every claim against current statistics instead. (So does the
            # fan-out's, tried generic: made on empty tables, it read 50,000 events whole
            # once they were there; tests/test_statement_plans.py.)
            "plan_cache_mode": "force_custom_plan",
            **SESSION_SETTINGS,
        },
    )
