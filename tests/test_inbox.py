"""The consumer's inbox against a real database: the mark commits with the effect, or not at all,
on every connection type; concurrent copies of one event; validation; another schema;
retention in bounded batches."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta

import asyncpg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import outbox
from outbox import OutboxError, OutboxValidationError
from outbox.dburl import to_asyncpg_dsn, to_sqlalchemy_async_url
from outbox.inbox import Inbox, mark, mark_sync, purge_inbox, purge_inbox_sync
from outbox.migrate import migrate

EFFECTS = "CREATE TABLE IF NOT EXISTS effects (event_id text NOT NULL, amount int NOT NULL)"


@pytest.fixture
async def conn(db_url: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(to_asyncpg_dsn(db_url))
    await c.execute(EFFECTS)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def aengine(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    async with engine.begin() as c:
        await c.execute(text(EFFECTS))
    yield engine
    await engine.dispose()


@pytest.fixture
def sengine(db_url: str) -> Iterator[Engine]:
    engine = create_engine("postgresql+psycopg://" + db_url.partition("://")[2])
    with engine.begin() as c:
        c.execute(text(EFFECTS))
    yield engine
    engine.dispose()


async def fetch(db_url: str, sql: str) -> list[tuple[object, ...]]:
    c = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        return [tuple(r) for r in await c.fetch(sql)]
    finally:
        await c.close()


async def effects(db_url: str) -> list[tuple[object, ...]]:
    return await fetch(db_url, "SELECT event_id, amount FROM effects ORDER BY event_id, amount")


async def marks(db_url: str, schema: str = "public") -> list[tuple[object, ...]]:
    return await fetch(
        db_url, f'SELECT consumer, event_id FROM "{schema}".outbox_inbox ORDER BY 1, 2'
    )


class Boom(Exception):
    pass


# --- the mark and the effect commit together ------------------------------------------------


async def test_asyncpg_applies_each_event_once_and_a_rollback_undoes_the_mark(
    conn: asyncpg.Connection, db_url: str
) -> None:
    async def consume(event_id: str, amount: int, crash: bool = False) -> bool:
        async with conn.transaction():
            new = await mark(conn, consumer="billing", event_id=event_id)
            if new:
                await conn.execute("INSERT INTO effects VALUES ($1, $2)", event_id, amount)
            if crash:
                raise Boom
        return new

    assert await consume("1", 10) is True
    assert await consume("1", 10) is False  # the redelivery changes nothing
    with pytest.raises(Boom):
        await consume("2", 20, crash=True)  # effect written, then a crash before the commit
    assert await marks(db_url) == [("billing", "1")]  # the mark went with the effect
    assert await consume("2", 20) is True  # so the redelivery applies it
    assert await consume("2", 20) is False
    # Another consumer of the same events keeps marks of its own.
    async with conn.transaction():
        assert await mark(conn, consumer="audit", event_id="1") is True
    assert await effects(db_url) == [("1", 10), ("2", 20)]
    assert await marks(db_url) == [("audit", "1"), ("billing", "1"), ("billing", "2")]


async def test_sqlalchemy_async_session_and_connection(aengine: AsyncEngine, db_url: str) -> None:
    async with AsyncSession(aengine) as session:
        async with session.begin():
            assert await mark(session, consumer="c", event_id=7) is True  # an int id: "7"
            await session.execute(text("INSERT INTO effects VALUES ('7', 1)"))
        async with session.begin():
            assert await mark(session, consumer="c", event_id="7") is False
        with pytest.raises(Boom):
            async with session.begin():
                assert await mark(session, consumer="c", event_id="8") is True
                raise Boom
    async with aengine.begin() as c:
        assert await mark(c, consumer="c", event_id="8") is True
        assert await mark(c, consumer="c", event_id="8") is False  # seen in its own transaction
    assert await marks(db_url) == [("c", "7"), ("c", "8")]
    assert await effects(db_url) == [("7", 1)]


def test_sqlalchemy_sync_session_and_connection(sengine: Engine) -> None:
    with Session(sengine) as session, session.begin():
        assert mark_sync(session, consumer="c", event_id="a") is True
    with sengine.begin() as c:
        assert mark_sync(c, consumer="c", event_id="a") is False
        assert mark_sync(c, consumer="c", event_id="b") is True
    with pytest.raises(Boom), sengine.begin() as c:
        assert mark_sync(c, consumer="c", event_id="z") is True
        raise Boom
    with sengine.connect() as c:
        got = c.execute(text("SELECT event_id FROM outbox_inbox ORDER BY 1")).scalars().all()
    assert got == ["a", "b"]


# --- refused outside a transaction ----------------------------------------------------------


async def test_refused_outside_a_transaction(
    conn: asyncpg.Connection, aengine: AsyncEngine, sengine: Engine, db_url: str
) -> None:
    with pytest.raises(OutboxError, match=r"inside the transaction .*conn\.transaction\(\)"):
        await mark(conn, consumer="c", event_id="1")
    auto = aengine.execution_options(isolation_level="AUTOCOMMIT")
    async with auto.connect() as c:
        with pytest.raises(OutboxError, match="AUTOCOMMIT"):
            await mark(c, consumer="c", event_id="1")
    async with AsyncSession(auto) as session:
        with pytest.raises(OutboxError, match="AUTOCOMMIT"):
            await mark(session, consumer="c", event_id="1")
    with sengine.execution_options(isolation_level="AUTOCOMMIT").connect() as sc:
        with pytest.raises(OutboxError, match="AUTOCOMMIT"):
            mark_sync(sc, consumer="c", event_id="1")
        with pytest.raises(TypeError, match="mark_sync takes a SQLAlchemy Session"):
            mark_sync(conn, consumer="c", event_id="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="use mark_sync for a sync Session"):
        await mark(object(), consumer="c", event_id="1")
    assert await marks(db_url) == []


# --- concurrent copies of one event ---------------------------------------------------------


@pytest.mark.parametrize("first_commits", [True, False])
async def test_a_concurrent_copy_waits_for_the_first_and_follows_its_outcome(
    db_url: str, first_commits: bool
) -> None:
    """Two consumers get the same event at once: the second mark waits on the first's row,
    then is a duplicate if the first committed, or new if it rolled back."""
    a = await asyncpg.connect(to_asyncpg_dsn(db_url))
    b = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = a.transaction()
        await tx.start()
        assert await mark(a, consumer="c", event_id="42") is True

        async def second() -> bool:
            async with b.transaction():
                return await mark(b, consumer="c", event_id="42")

        waiting = asyncio.create_task(second())
        await asyncio.sleep(0.3)
        assert not waiting.done()  # blocked on the first transaction's row
        await (tx.commit() if first_commits else tx.rollback())
        assert await asyncio.wait_for(waiting, 5) is (not first_commits)
    finally:
        await a.close()
        await b.close()
    assert await marks(db_url) == [("c", "42")]


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("consumer", "event_id", "field", "message"),
    [
        ("", "1", "consumer", "non-empty"),
        ("   ", "1", "consumer", "non-empty"),
        (None, "1", "consumer", "got NoneType"),
        ("a\nb", "1", "consumer", "control character"),
        ("x" * 256, "1", "consumer", "above the limit of 255 bytes"),
        ("c", "", "event_id", "non-empty"),
        ("c", None, "event_id", "got NoneType"),
        ("c", True, "event_id", "got bool"),
        ("c", b"1", "event_id", "got bytes"),
        ("c", "a\x00b", "event_id", "NUL"),
        ("c", "é" * 513, "event_id", "1026 bytes"),
    ],
)
async def test_consumer_and_event_id_are_validated_before_any_sql(
    conn: asyncpg.Connection, consumer: object, event_id: object, field: str, message: str
) -> None:
    async with conn.transaction():
        with pytest.raises(OutboxValidationError, match=message) as err:
            await mark(conn, consumer=consumer, event_id=event_id)  # type: ignore[arg-type]
        assert err.value.field == field
        # The transaction is intact: nothing reached the server.
        assert await mark(conn, consumer="c", event_id="x" * 1024) is True


# --- another schema, and the lazy name ------------------------------------------------------


async def test_inbox_of_another_schema(empty_db_url: str) -> None:
    await migrate(empty_db_url, schema="Consumer Side")
    inbox = Inbox(schema="Consumer Side")
    assert repr(inbox) == "Inbox(schema='Consumer Side')"
    c = await asyncpg.connect(to_asyncpg_dsn(empty_db_url))
    try:
        async with c.transaction():
            assert await inbox.mark(c, consumer="c", event_id="1") is True
            assert await inbox.mark(c, consumer="c", event_id="1") is False
        async with c.transaction():  # the default inbox is public's, which is not there
            with pytest.raises(asyncpg.UndefinedTableError):
                await mark(c, consumer="c", event_id="1")
    finally:
        await c.close()
    assert await marks(empty_db_url, "Consumer Side") == [("c", "1")]
    with pytest.raises(ValueError, match="schema name"):
        Inbox(schema="a:b")
    assert outbox.inbox.mark is mark  # reached lazily from the package


# --- retention ------------------------------------------------------------------------------


async def _seed(db_url: str, old: int, recent: int) -> None:
    c = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await c.execute(
            "INSERT INTO outbox_inbox (consumer, event_id, received_at) "
            "SELECT 'c', 'old-' || i, now() - interval '8 days' - i * interval '1 second' "
            "FROM generate_series(1, $1) AS i",
            old,
        )
        await c.execute(
            "INSERT INTO outbox_inbox (consumer, event_id, received_at) "
            "SELECT 'c', 'new-' || i, now() - interval '6 days' FROM generate_series(1, $1) i",
            recent,
        )
    finally:
        await c.close()


async def _left(db_url: str) -> tuple[int, int]:
    [(old, new)] = await fetch(
        db_url,
        "SELECT count(*) FILTER (WHERE event_id LIKE 'old-%'), "
        "count(*) FILTER (WHERE event_id LIKE 'new-%') FROM outbox_inbox",
    )
    return int(old), int(new)  # type: ignore[call-overload]


async def test_purge_deletes_old_marks_in_bounded_batches(db_url: str) -> None:
    week = timedelta(days=7)
    await _seed(db_url, old=25, recent=5)
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    try:
        # 25 old marks, 7 per batch: four transactions, all of them deleted.
        assert await purge_inbox(engine, older_than=week, batch_size=7) == 25
        assert await _left(db_url) == (0, 5)
        assert await purge_inbox(engine, older_than=week) == 0
        await _seed(db_url, old=10, recent=0)
        async with engine.connect() as c:  # a connection outside a transaction
            assert await purge_inbox(c, older_than=week, batch_size=3) == 10
            await c.begin()
            with pytest.raises(OutboxError, match="commits each batch on its own"):
                await purge_inbox(c, older_than=week)
    finally:
        await engine.dispose()
    await _seed(db_url, old=12, recent=0)
    pool = await asyncpg.create_pool(to_asyncpg_dsn(db_url), min_size=1, max_size=2)
    try:
        assert await purge_inbox(pool, older_than=week, batch_size=5) == 12
        async with pool.acquire() as c, c.transaction():
            with pytest.raises(OutboxError, match="commits each batch on its own"):
                await purge_inbox(c, older_than=week)
    finally:
        await pool.close()
    await _seed(db_url, old=4, recent=0)
    sync = create_engine("postgresql+psycopg://" + db_url.partition("://")[2])
    try:
        assert purge_inbox_sync(sync, older_than=week, batch_size=3) == 4
        # A shorter window reaches the recent marks too.
        assert purge_inbox_sync(sync, older_than=timedelta(days=5)) == 5
    finally:
        sync.dispose()
    assert await _left(db_url) == (0, 0)


async def test_purge_arguments_are_checked(db_url: str) -> None:
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    try:
        with pytest.raises(OutboxValidationError, match="older_than"):
            await purge_inbox(engine, older_than=timedelta(0))
        with pytest.raises(OutboxValidationError, match="older_than"):
            await purge_inbox(engine, older_than=3600)  # type: ignore[arg-type]
        with pytest.raises(OutboxValidationError, match="batch_size"):
            await purge_inbox(engine, older_than=timedelta(days=1), batch_size=0)
        with pytest.raises(TypeError, match="purge_inbox_sync for a sync Engine"):
            await purge_inbox(object(), older_than=timedelta(days=1))
    finally:
        await engine.dispose()


async def test_purge_reads_the_age_index(db_url: str) -> None:
    """With many marks, retention finds the old ones through outbox_inbox_received_idx
    rather than a scan of the whole table."""
    c = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await c.execute(
            "INSERT INTO outbox_inbox (consumer, event_id, received_at) "
            "SELECT 'c', i::text, now() - (i % 1000) * interval '1 minute' "
            "FROM generate_series(1, 50000) AS i"
        )
        await c.execute("ANALYZE outbox_inbox")
        plan = await c.fetchval(
            "EXPLAIN (FORMAT JSON) " + Inbox()._purge_pg, timedelta(hours=16).total_seconds(), 100
        )
    finally:
        await c.close()
    assert "outbox_inbox_received_idx" in str(plan)
