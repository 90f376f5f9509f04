"""Marking an event as applied, in the consumer's own transaction; and retention.

``mark`` adds one ``INSERT … ON CONFLICT DO NOTHING RETURNING`` to the caller's open
transaction and says whether the event is new. Nothing here commits or opens a transaction:
the mark commits exactly when the consumer's effect does, so an event is applied once even
when it arrives many times (at-least-once delivery) and a crash can strike at any point.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from outbox import queries
from outbox.errors import OutboxError, OutboxValidationError
from outbox.message import _text

try:  # asyncpg is a dependency, but keep the import failure readable if it is stripped out
    import asyncpg
except ImportError:  # pragma: no cover
    asyncpg = None

AsyncTarget = AsyncSession | AsyncConnection | Any  # Any: an asyncpg Connection
SyncTarget = Session | Connection

INBOX_TABLE = "outbox_inbox"
# Both in the primary key's btree entries (a few KiB at most for the two together), and both
# text that logs and headers carry: bounded, and the consumer name without control characters.
MAX_CONSUMER_BYTES = 255
MAX_EVENT_ID_BYTES = 1024
DEFAULT_PURGE_BATCH = 10_000
MAX_PURGE_BATCH = 100_000


def check_consumer(consumer: object) -> str:
    """``consumer`` if it can name a consumer, else OutboxValidationError saying why."""
    name = _text("consumer", consumer, MAX_CONSUMER_BYTES)
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in name):
        raise OutboxValidationError("consumer", "contains a control character")
    return name


def check_event_id(event_id: object, field: str = "event_id") -> str:
    """The event id as stored: a non-empty str (an int is taken as its decimal form)."""
    if isinstance(event_id, int) and not isinstance(event_id, bool):
        return str(event_id)
    return _text(field, event_id, MAX_EVENT_ID_BYTES, kind="a non-empty str (or an int)")


class Inbox:
    """The inbox table of one schema. The module-level functions use ``Inbox()`` (schema
    public); pass ``Inbox(schema=...)`` to the helpers when the table is elsewhere."""

    def __init__(self, schema: str = "public") -> None:
        queries.check_schema(schema)
        self.schema = schema
        self.table = queries.qualified_table(schema, INBOX_TABLE)
        self._mark_sa = text(queries.render(queries.INBOX_MARK_SA, self.table))
        self._mark_pg = queries.render(queries.INBOX_MARK_PG, self.table)
        self._purge_sa = text(queries.render(queries.INBOX_PURGE_SA, self.table))
        self._purge_pg = queries.render(queries.INBOX_PURGE_PG, self.table)

    def __repr__(self) -> str:
        return f"Inbox(schema={self.schema!r})"

    # --- marking ---------------------------------------------------------------------------

    async def mark(self, conn: AsyncTarget, *, consumer: str, event_id: str | int) -> bool:
        """Record that ``consumer`` applies ``event_id``, in ``conn``'s open transaction.

        True the first time: apply the effect in the same transaction, and both commit
        together. False when the event was marked before (a redelivery): change nothing.
        Call it first in the transaction: a concurrent copy of the same event then waits on
        this row instead of doing the work twice, and finds it marked once this commits.

        Takes a SQLAlchemy ``AsyncSession`` or ``AsyncConnection`` (not in AUTOCOMMIT), or
        an asyncpg ``Connection`` inside ``conn.transaction()``.
        """
        name, eid = check_consumer(consumer), check_event_id(event_id)
        if isinstance(conn, AsyncSession | AsyncConnection):
            sa = await conn.connection() if isinstance(conn, AsyncSession) else conn
            _refuse_autocommit(sa.sync_connection, "mark")
            result = await conn.execute(self._mark_sa, {"consumer": name, "event_id": eid})
            return result.scalar() is not None
        _require_asyncpg_transaction(conn, "mark")
        return await conn.fetchval(self._mark_pg, name, eid) is not None

    def mark_sync(self, conn: SyncTarget, *, consumer: str, event_id: str | int) -> bool:
        """``mark`` for a SQLAlchemy ``Session`` or ``Connection``."""
        name, eid = check_consumer(consumer), check_event_id(event_id)
        if not isinstance(conn, Session | Connection):
            raise TypeError(
                "mark_sync takes a SQLAlchemy Session or Connection; got "
                f"{type(conn).__name__} (use `await mark(...)` for async connections)"
            )
        _refuse_autocommit(conn.connection() if isinstance(conn, Session) else conn, "mark")
        result = conn.execute(self._mark_sa, {"consumer": name, "event_id": eid})
        return result.scalar() is not None

    # --- retention -------------------------------------------------------------------------

    async def purge(
        self,
        db: AsyncEngine | AsyncConnection | Any,
        *,
        older_than: timedelta,
        batch_size: int = DEFAULT_PURGE_BATCH,
    ) -> int:
        """Delete marks older than ``older_than``, ``batch_size`` rows per transaction, until
        none is left; returns how many were deleted.

        Each batch commits on its own, so ``db`` is an ``AsyncEngine``, an asyncpg ``Pool``,
        or a connection (SQLAlchemy ``AsyncConnection`` or asyncpg) outside any transaction.
        An event redelivered after its mark is purged is applied again: keep marks longer
        than any redelivery or replay you expect.
        """
        seconds, limit = _purge_args(older_than, batch_size)
        binds = {"older_than": seconds, "batch_size": limit}
        total = 0
        while True:
            if isinstance(db, AsyncEngine):
                async with db.begin() as c:
                    deleted = (await c.execute(self._purge_sa, binds)).rowcount
            elif isinstance(db, AsyncConnection):
                if db.in_transaction():
                    raise OutboxError(_PURGE_IN_TRANSACTION)
                deleted = (await db.execute(self._purge_sa, binds)).rowcount
                await db.commit()
            elif asyncpg is not None and isinstance(db, asyncpg.Pool | asyncpg.Connection):
                if isinstance(db, asyncpg.Connection) and db.is_in_transaction():
                    raise OutboxError(_PURGE_IN_TRANSACTION)
                status = await db.execute(self._purge_pg, seconds, limit)
                deleted = int(status.split()[-1])
            else:
                raise TypeError(
                    "purge_inbox takes a SQLAlchemy AsyncEngine or AsyncConnection, or an "
                    f"asyncpg Pool or Connection; got {type(db).__name__} (use "
                    "purge_inbox_sync for a sync Engine or Connection)"
                )
            total += deleted
            if deleted < limit:
                return total

    def purge_sync(
        self,
        db: Engine | Connection,
        *,
        older_than: timedelta,
        batch_size: int = DEFAULT_PURGE_BATCH,
    ) -> int:
        """``purge`` for a SQLAlchemy ``Engine``, or a ``Connection`` outside a transaction."""
        seconds, limit = _purge_args(older_than, batch_size)
        binds = {"older_than": seconds, "batch_size": limit}
        total = 0
        while True:
            if isinstance(db, Engine):
                with db.begin() as c:
                    deleted = c.execute(self._purge_sa, binds).rowcount
            elif isinstance(db, Connection):
                if db.in_transaction():
                    raise OutboxError(_PURGE_IN_TRANSACTION)
                deleted = db.execute(self._purge_sa, binds).rowcount
                db.commit()
            else:
                raise TypeError(
                    "purge_inbox_sync takes a SQLAlchemy Engine or Connection; got "
                    f"{type(db).__name__}"
                )
            total += deleted
            if deleted < limit:
                return total


_PURGE_IN_TRANSACTION = (
    "purge_inbox commits each batch on its own, so it cannot run inside an open transaction: "
    "pass the engine (or pool), or a connection outside `begin()` / `transaction()`"
)


def _purge_args(older_than: object, batch_size: object) -> tuple[float, int]:
    if not isinstance(older_than, timedelta) or older_than <= timedelta(0):
        raise OutboxValidationError("older_than", "must be a positive datetime.timedelta")
    if (
        not isinstance(batch_size, int)
        or isinstance(batch_size, bool)
        or not 1 <= batch_size <= MAX_PURGE_BATCH
    ):
        raise OutboxValidationError(
            "batch_size", f"must be an int from 1 to {MAX_PURGE_BATCH}, got {batch_size!r}"
        )
    return older_than.total_seconds(), batch_size


def _require_asyncpg_transaction(conn: Any, what: str) -> None:
    if asyncpg is None or not isinstance(conn, asyncpg.Connection):
        raise TypeError(
            f"{what} takes a SQLAlchemy AsyncSession or AsyncConnection, or an asyncpg "
            f"Connection; got {type(conn).__name__} (use {what}_sync for a sync Session)"
        )
    if not conn.is_in_transaction():
        raise OutboxError(
            f"{what} must run inside the transaction of the consumer's effect: wrap both in "
            "`async with conn.transaction():` so they commit together, or not at all"
        )


def _refuse_autocommit(conn: Connection | None, what: str) -> None:
    """In AUTOCOMMIT each statement commits at once: the mark would commit without the
    effect, and a crash in between would lose the event for good. Checked on the driver's
    own connection, which tells whatever set it (execution options, the engine, the driver)."""
    if conn is None:
        return
    driver = conn.connection.dbapi_connection
    if getattr(driver, "autocommit", False) is True or conn._is_autocommit_isolation():
        raise OutboxError(
            f"{what} needs the transaction of the consumer's effect, but this connection is in "
            "AUTOCOMMIT mode (isolation_level='AUTOCOMMIT'): the mark would commit alone, and a "
            "crash before the effect would lose the event. Use a connection without "
            "AUTOCOMMIT, inside `with session.begin():` / `with conn.begin():`"
        )


_default = Inbox()
mark = _default.mark
mark_sync = _default.mark_sync
purge_inbox = _default.purge
purge_inbox_sync = _default.purge_sync
