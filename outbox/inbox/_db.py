"""One transaction from whatever database handle an application has, for the helpers that run
a handler in a transaction of their own (Kafka consumers, the FastAPI dependency); and whether
that transaction can still commit once the handler is done.

A statement that fails inside a transaction aborts all of it, and PostgreSQL answers its COMMIT
with ROLLBACK, without an error: a handler that catches the error (``try: INSERT … except
UniqueViolation: pass``) leaves a transaction whose effect and mark are rolled back while every
driver reports a successful commit. So the helpers ask, after the handler, whether the
transaction can commit (:func:`ensure_committable`), and count an event applied, commit its
offset or answer 2xx only then.

Why not a savepoint around the handler instead: it would detect the same (its RELEASE fails)
at two round trips instead of one, and rolling back to it would keep the mark while dropping
the effect, which is the lost event this prevents. The whole transaction is the unit: a handler
that expects a statement to fail puts that statement in a savepoint of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import structlog
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from outbox import queries
from outbox.errors import OutboxError

try:  # asyncpg is a dependency, but keep the import failure readable if it is stripped out
    import asyncpg
except ImportError:  # pragma: no cover
    asyncpg = None

log = structlog.get_logger("outbox.inbox")

# PostgreSQL's "current transaction is aborted, commands ignored until end of transaction block".
IN_FAILED_TRANSACTION = "25P02"

WHAT_TO_DO = (
    "a handler must not catch a database error and carry on in the same transaction (the "
    "failed statement aborts it, and PostgreSQL turns its COMMIT into a ROLLBACK): write the "
    "statement so that it cannot fail (INSERT … ON CONFLICT DO NOTHING), or run it in a "
    "savepoint of its own (async with session.begin_nested(): / async with conn.transaction():) "
    "and catch the error outside that, or let the error propagate"
)

# An AsyncEngine, an async_sessionmaker, an asyncpg Pool or Connection.
Database = AsyncEngine | async_sessionmaker[AsyncSession] | Any


def check_database(db: object) -> None:
    """TypeError unless ``db`` is a handle ``transaction`` takes (checked up front, at set-up)."""
    if isinstance(db, AsyncEngine | async_sessionmaker):
        return
    if asyncpg is not None and isinstance(db, asyncpg.Pool | asyncpg.Connection):
        return
    raise TypeError(
        "the database must be a SQLAlchemy AsyncEngine or async_sessionmaker, or an asyncpg "
        f"Pool or Connection; got {type(db).__name__}"
    )


def is_one_connection(db: object) -> bool:
    """An asyncpg Connection: one transaction at a time, so not for concurrent requests."""
    return asyncpg is not None and isinstance(db, asyncpg.Connection)


@asynccontextmanager
async def transaction(db: Database) -> AsyncIterator[Any]:
    """A new transaction, committed when the block ends and rolled back if it raises.

    Yields what the handler writes with: an ``AsyncConnection`` (engine), an ``AsyncSession``
    (session maker), an asyncpg ``Connection`` (pool or connection).
    """
    if isinstance(db, AsyncEngine):
        async with db.begin() as conn:
            yield conn
    elif isinstance(db, async_sessionmaker):
        async with db() as session, session.begin():
            yield session
    elif asyncpg is not None and isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn, conn.transaction():
            yield conn
    elif asyncpg is not None and isinstance(db, asyncpg.Connection):
        async with db.transaction():
            yield db
    else:
        check_database(db)  # raises, naming what is taken


class TransactionAborted(OutboxError):
    """The handler's transaction cannot commit: a statement in it failed (and the handler caught
    the error), or it was ended inside the handler. Nothing of it was committed, neither the
    effect nor the mark, so the event is not applied and must be delivered again: the Kafka
    helper commits no offset for it and raises this, the FastAPI dependency answers
    ``status_code`` (500), so the sender retries.

    ``consumer``, ``event_id`` and ``problem`` say which event and what happened; the message
    also says what to change in the handler.
    """

    status_code = 500

    def __init__(self, *, consumer: str, event_id: str, problem: str) -> None:
        super().__init__(
            f"event {event_id!r} was not applied by consumer {consumer!r}: {problem}; its "
            f"transaction (the effect and the mark) is rolled back and the event will be "
            f"delivered again. To fix: {WHAT_TO_DO}"
        )
        self.consumer = consumer
        self.event_id = event_id
        self.problem = problem

    @property
    def answer(self) -> str:
        """What a response may say: enough for the sender's log, nothing of the receiver's."""
        return (
            f"event {self.event_id} not applied: the receiver's transaction was aborted by a "
            "failed statement; send it again (the receiver's log says more)"
        )


_FAILED_STATEMENT = (
    "a statement failed inside the handler and the error was caught, which aborted the "
    f"transaction (SQLSTATE {IN_FAILED_TRANSACTION})"
)
_ENDED = "the transaction was ended (committed or rolled back) inside the handler"
_ORM_ROLLED_BACK = (
    "a flush failed inside the handler and the error was caught; SQLAlchemy rolled the "
    "session's transaction back"
)


def _failed_transaction(exc: BaseException) -> bool:
    """Whether ``exc`` is PostgreSQL refusing a statement of an aborted transaction, as any
    driver raises it (asyncpg's own errors, or a SQLAlchemy error wrapping the driver's)."""
    if isinstance(exc, DBAPIError):
        return getattr(exc.orig, "sqlstate", None) == IN_FAILED_TRANSACTION
    return getattr(exc, "sqlstate", None) == IN_FAILED_TRANSACTION


async def committable_problem(tx: Any) -> str | None:
    """Why ``tx``'s transaction cannot commit, or None when its COMMIT would commit.

    Takes what the helpers hand a handler (an ``AsyncConnection``, an ``AsyncSession``, an
    asyncpg ``Connection``). One round trip: PostgreSQL is asked, since no driver says whether
    the transaction is aborted (asyncpg keeps it private; SQLAlchemy does not track it). Other
    errors (a lost connection, a flush of pending objects that fails here) propagate.
    """
    try:
        if isinstance(tx, AsyncSession):
            problem = _session_problem(tx.sync_session)
            if problem is not None:
                return problem
            await tx.flush()  # pending objects now: the COMMIT would flush them first
            tx = await tx.connection()
        if isinstance(tx, AsyncConnection):
            if not _connection_active(tx.sync_connection):
                return _ENDED
            await tx.exec_driver_sql(queries.INBOX_CAN_COMMIT)
        else:
            if not tx.is_in_transaction():  # an asyncpg Connection
                return _ENDED
            await tx.execute(queries.INBOX_CAN_COMMIT)
    except Exception as exc:
        if _failed_transaction(exc):
            return _FAILED_STATEMENT
        raise
    return None


def committable_problem_sync(tx: Session | Connection) -> str | None:
    """:func:`committable_problem` for a SQLAlchemy ``Session`` or ``Connection``."""
    try:
        if isinstance(tx, Session):
            problem = _session_problem(tx)
            if problem is not None:
                return problem
            tx.flush()
            tx = tx.connection()
        if not _connection_active(tx):
            return _ENDED
        tx.exec_driver_sql(queries.INBOX_CAN_COMMIT)
    except DBAPIError as exc:
        if _failed_transaction(exc):
            return _FAILED_STATEMENT
        raise
    return None


def _session_problem(session: Session) -> str | None:
    current = session.get_transaction()
    if current is None:
        return _ENDED
    # A flush that failed rolls the session's transaction back at once; the ``begin()`` block
    # around it then ends without an error, having committed nothing.
    return None if current.is_active else _ORM_ROLLED_BACK


def _connection_active(conn: Connection | None) -> bool:
    current = conn.get_transaction() if conn is not None else None
    return current is not None and current.is_active


def aborted(consumer: str, event_id: str, problem: str, **where: object) -> TransactionAborted:
    """The error for an event whose transaction cannot commit, logged (``where``: the
    record's or request's coordinates, for the log line)."""
    log.error(
        "inbox.handler.aborted",
        consumer=consumer,
        event_id=event_id,
        problem=problem,
        hint=WHAT_TO_DO,
        **where,
    )
    return TransactionAborted(consumer=consumer, event_id=event_id, problem=problem)


async def ensure_committable(tx: Any, *, consumer: str, event_id: str, **where: object) -> None:
    """Raise (and log) :class:`TransactionAborted` unless ``tx``'s transaction can commit."""
    problem = await committable_problem(tx)
    if problem is not None:
        raise aborted(consumer, event_id, problem, **where)
