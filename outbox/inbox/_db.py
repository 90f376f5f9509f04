"""One transaction from whatever database handle an application has, for the helpers that run
a handler in a transaction of their own (Kafka consumers, the FastAPI dependency)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

try:  # asyncpg is a dependency, but keep the import failure readable if it is stripped out
    import asyncpg
except ImportError:  # pragma: no cover
    asyncpg = None

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
