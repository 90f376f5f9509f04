"""The enqueue API against a real database, with a business table in the same transaction."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import asyncpg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import outbox
from outbox import Outbox, OutboxError, OutboxValidationError
from outbox.dburl import to_asyncpg_dsn, to_sqlalchemy_async_url

BUSINESS = "CREATE TABLE orders (id bigint PRIMARY KEY, total numeric NOT NULL)"


@pytest.fixture
async def aengine(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    async with engine.begin() as c:
        await c.execute(text(BUSINESS))
    yield engine
    await engine.dispose()


@pytest.fixture
def sengine(db_url: str) -> Iterator[Engine]:
    engine = create_engine("postgresql+psycopg://" + db_url.partition("://")[2])
    with engine.begin() as c:
        c.execute(text(BUSINESS))
    yield engine
    engine.dispose()


async def rows(db_url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        return list(await conn.fetch("SELECT * FROM outbox ORDER BY id"))
    finally:
        await conn.close()


async def orders(db_url: str) -> list[int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        return [r[0] for r in await conn.fetch("SELECT id FROM orders ORDER BY id")]
    finally:
        await conn.close()


# --- each connection type: commit keeps both, rollback keeps neither ---------------------


async def test_async_session_commit_and_rollback(aengine: AsyncEngine, db_url: str) -> None:
    async with AsyncSession(aengine) as session, session.begin():
        await session.execute(text("INSERT INTO orders VALUES (1, 10)"))
        eid = await outbox.enqueue(
            session, destination="orders", key="1", payload={"type": "order.created"}
        )
    with pytest.raises(RuntimeError, match="boom"):
        async with AsyncSession(aengine) as session, session.begin():
            await session.execute(text("INSERT INTO orders VALUES (2, 20)"))
            await outbox.enqueue(session, destination="orders", payload={"id": 2})
            raise RuntimeError("boom")
    stored = await rows(db_url)
    assert [r["id"] for r in stored] == [eid]
    assert await orders(db_url) == [1]
    r = stored[0]
    assert r["destination"] == "orders" and r["key"] == "1"
    assert json.loads(r["payload"]) == {"type": "order.created"}
    assert r["content_type"] == "application/json"
    assert r["status"] == "pending" and r["attempts"] == 0


async def test_async_connection(aengine: AsyncEngine, db_url: str) -> None:
    async with aengine.begin() as conn:
        await conn.execute(text("INSERT INTO orders VALUES (1, 10)"))
        await outbox.enqueue(conn, destination="orders", payload=b"\x00\x01raw")
    async with aengine.connect() as conn:
        await conn.execute(text("INSERT INTO orders VALUES (2, 10)"))
        await outbox.enqueue(conn, destination="orders", payload=b"lost")
        await conn.rollback()
    stored = await rows(db_url)
    assert [bytes(r["payload"]) for r in stored] == [b"\x00\x01raw"]
    assert stored[0]["content_type"] == "application/octet-stream"
    assert await orders(db_url) == [1]


async def test_asyncpg_connection(db_url: str) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(BUSINESS)
        async with conn.transaction():
            await conn.execute("INSERT INTO orders VALUES (1, 10)")
            eid = await outbox.enqueue(
                conn, destination="orders", payload="hello", headers={"h": "v"}
            )
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                await conn.execute("INSERT INTO orders VALUES (2, 10)")
                await outbox.enqueue(conn, destination="orders", payload="lost")
                raise RuntimeError
        # Outside a transaction the event would commit on its own: refused, nothing written.
        with pytest.raises(OutboxError, match="transaction"):
            await outbox.enqueue(conn, destination="orders", payload="alone")
    finally:
        await conn.close()
    stored = await rows(db_url)
    assert [r["id"] for r in stored] == [eid]
    assert bytes(stored[0]["payload"]) == b"hello"
    assert stored[0]["content_type"] == "text/plain; charset=utf-8"
    assert json.loads(stored[0]["headers"]) == {"h": "v"}
    assert await orders(db_url) == [1]


def test_sync_session(sengine: Engine, db_url: str) -> None:
    with Session(sengine) as session, session.begin():
        session.execute(text("INSERT INTO orders VALUES (1, 10)"))
        eid = outbox.enqueue_sync(session, destination="orders", key="k", payload=[1, 2])
    with pytest.raises(RuntimeError), Session(sengine) as session, session.begin():
        session.execute(text("INSERT INTO orders VALUES (2, 10)"))
        outbox.enqueue_sync(session, destination="orders", payload=[3])
        raise RuntimeError
    import asyncio

    stored = asyncio.run(rows(db_url))
    assert [r["id"] for r in stored] == [eid]
    assert json.loads(stored[0]["payload"]) == [1, 2]


def test_sync_connection_and_many(sengine: Engine, db_url: str) -> None:
    when = datetime.now(UTC) + timedelta(hours=1)
    with sengine.begin() as conn:
        conn.execute(text("INSERT INTO orders VALUES (1, 10)"))
        ids = outbox.enqueue_many_sync(
            conn,
            [
                {"destination": "a", "payload": {"n": 1}},
                {"destination": "b", "payload": b"x", "key": "k2", "run_after": when},
                {"destination": "c", "payload": "s", "headers": {"x": "y"}},
            ],
        )
    import asyncio

    stored = asyncio.run(rows(db_url))
    assert [r["id"] for r in stored] == ids
    assert [r["destination"] for r in stored] == ["a", "b", "c"]
    assert stored[1]["key"] == "k2" and stored[1]["run_after"] == when
    assert json.loads(stored[2]["headers"]) == {"x": "y"}


async def test_enqueue_many_async_in_order(aengine: AsyncEngine, db_url: str) -> None:
    events: list[outbox.EventSpec] = [
        {"destination": "orders", "key": f"k{i % 7}", "payload": {"i": i}} for i in range(500)
    ]
    async with AsyncSession(aengine) as session, session.begin():
        ids = await outbox.enqueue_many(session, events)
    stored = await rows(db_url)
    assert len(ids) == 500 and ids == sorted(ids)
    by_id = {r["id"]: json.loads(r["payload"])["i"] for r in stored}
    assert [by_id[i] for i in ids] == list(range(500))
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            more = await outbox.enqueue_many(
                conn, [{"destination": "x", "payload": b"1"}, {"destination": "y", "payload": b"2"}]
            )
        assert await outbox.enqueue_many(conn, []) == []
    finally:
        await conn.close()
    assert len(more) == 2 and min(more) > max(ids)


async def test_custom_schema(pg_admin_url: str, empty_db_url: str) -> None:
    from outbox.migrate import migrate

    await migrate(empty_db_url, schema="events")
    box = Outbox("events")
    conn = await asyncpg.connect(to_asyncpg_dsn(empty_db_url))
    try:
        async with conn.transaction():
            await box.enqueue(conn, destination="d", payload=b"p")
        assert await conn.fetchval("SELECT count(*) FROM events.outbox") == 1
        assert await conn.fetchval("SELECT to_regclass('public.outbox')") is None
    finally:
        await conn.close()


# --- validation: refused before any SQL, with the field named ----------------------------


def nested(depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for _ in range(depth):
        out = {"a": out}
    return out


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"destination": ""}, "destination", "non-empty"),
        ({"destination": "   "}, "destination", "non-empty"),
        ({"destination": 5}, "destination", "non-empty"),
        ({"key": 5}, "key", "str or None"),
        ({"headers": {"a": 1}}, "headers", "must be a str"),
        ({"headers": {1: "a"}}, "headers", "non-empty str"),
        ({"headers": {"": "a"}}, "headers", "non-empty str"),
        ({"headers": ["a"]}, "headers", "mapping"),
        ({"payload": 3.5}, "payload", "unsupported type float"),
        ({"payload": None}, "payload", "unsupported type NoneType"),
        ({"payload": {"when": datetime.now(UTC)}}, "payload", "cannot be encoded as JSON"),
        ({"payload": {"x": float("nan")}}, "payload", "cannot be encoded as JSON"),
        ({"payload": b"{not json", "content_type": "application/json"}, "payload", "valid JSON"),
        ({"payload": b"\xff\xfe", "content_type": "application/json"}, "payload", "UTF-8"),
        ({"payload": "x" * 2000}, "payload", "above the limit of 1000 bytes"),
        ({"run_after": datetime(2030, 1, 1)}, "run_after", "timezone-aware"),
        ({"run_after": "tomorrow"}, "run_after", "datetime"),
        ({"content_type": ""}, "content_type", "non-empty"),
        # Values PostgreSQL or its indexes refuse would abort the caller's transaction.
        ({"destination": "ord\x00ers"}, "destination", "NUL"),
        ({"key": "k\x00"}, "key", "NUL"),
        ({"content_type": "text/plain\x00"}, "content_type", "NUL"),
        ({"content_type": "text/plain\r\nX-Evil: 1"}, "content_type", "control character"),
        ({"key": "k" * 3000}, "key", "above the limit of 1024 bytes"),
        ({"destination": "d" * 300}, "destination", "above the limit of 255 bytes"),
        ({"key": "\ud800"}, "key", "lone surrogate"),
        ({"destination": "a\udfff"}, "destination", "lone surrogate"),
        ({"payload": "text \udcff"}, "payload", "lone surrogate"),
        ({"payload": {"k": "v\ud800"}}, "payload", "lone surrogate"),
        ({"headers": {"h": "v\ud800"}}, "headers", "lone surrogate"),
        ({"headers": {"h": "x" * 20_000}}, "headers", "above the limit of 16384"),
        ({"payload": nested(100_000)}, "payload", "nested too deeply"),
        ({"payload": "not json at all", "content_type": "application/json"}, "payload", "JSON"),
        ({"content_type": "text/plain\x85"}, "content_type", "control character"),
        (
            {"run_after": datetime.min.replace(tzinfo=timezone(timedelta(hours=14)))},
            "run_after",
            "years 1 to 9999",
        ),
        (
            {"run_after": datetime.max.replace(tzinfo=timezone(timedelta(hours=-14)))},
            "run_after",
            "years 1 to 9999",
        ),
        (
            {"payload": b"[" * 100_000 + b"]" * 100_000, "content_type": "application/json"},
            "payload",
            "nested too deeply",
        ),
    ],
)
async def test_validation_errors(
    db_url: str, kwargs: dict[str, Any], field: str, message: str
) -> None:
    box = Outbox(max_payload_bytes=1000)
    args: dict[str, Any] = {"destination": "orders", "payload": {"ok": True}, **kwargs}
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            with pytest.raises(OutboxValidationError) as info:
                await box.enqueue(conn, **args)
            assert info.value.field == field
            assert message in str(info.value)
            # The caller's transaction is untouched and still usable.
            assert await conn.fetchval("SELECT 1") == 1
    finally:
        await conn.close()
    assert await rows(db_url) == []


async def test_enqueue_many_names_the_bad_event(db_url: str) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            with pytest.raises(OutboxValidationError) as info:
                await outbox.enqueue_many(
                    conn,
                    [{"destination": "a", "payload": b"1"}, {"destination": "", "payload": b"2"}],
                )
    finally:
        await conn.close()
    assert info.value.field == "events[1].destination"
    assert await rows(db_url) == []


def test_wrong_connection_types() -> None:
    import asyncio

    with pytest.raises(TypeError, match="enqueue_sync takes"):
        outbox.enqueue_sync(object(), destination="a", payload=b"")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="enqueue takes"):
        asyncio.run(outbox.enqueue(object(), destination="a", payload=b""))


def test_json_suffix_types_are_checked_and_bytes_kept() -> None:
    from outbox.message import build_message

    m = build_message(
        destination="d", payload=b'{"a":1}', content_type="application/cloudevents+json"
    )
    assert m.payload == b'{"a":1}'
    with pytest.raises(OutboxValidationError):
        build_message(destination="d", payload=b"{", content_type="application/vnd.x+json")
    avro = build_message(destination="d", payload=b"\x00\x02", content_type="avro/binary")
    assert avro.payload == b"\x00\x02" and avro.content_type == "avro/binary"


# --- AUTOCOMMIT: the event would commit alone -------------------------------------------------


def test_sync_autocommit_is_refused(sengine: Engine, db_url: str) -> None:
    import asyncio

    auto_engine = sengine.execution_options(isolation_level="AUTOCOMMIT")
    with auto_engine.connect() as conn:
        with pytest.raises(OutboxError, match="AUTOCOMMIT"):
            outbox.enqueue_sync(conn, destination="orders", payload=b"alone")
        with pytest.raises(OutboxError, match="AUTOCOMMIT"):
            outbox.enqueue_many_sync(conn, [{"destination": "orders", "payload": b"alone"}])
    with Session(auto_engine) as session:
        session.begin()  # looks like a transaction; every statement still commits at once
        with pytest.raises(OutboxError, match="AUTOCOMMIT"):
            outbox.enqueue_sync(session, destination="orders", payload=b"alone")
        session.rollback()
    engine = create_engine(
        "postgresql+psycopg://" + db_url.partition("://")[2], isolation_level="AUTOCOMMIT"
    )
    try:
        with engine.connect() as conn, pytest.raises(OutboxError, match="AUTOCOMMIT"):
            outbox.enqueue_sync(conn, destination="orders", payload=b"alone")
    finally:
        engine.dispose()
    assert asyncio.run(rows(db_url)) == []


async def test_async_autocommit_is_refused(aengine: AsyncEngine, db_url: str) -> None:
    auto = aengine.execution_options(isolation_level="AUTOCOMMIT")
    async with auto.connect() as conn:
        with pytest.raises(OutboxError, match="AUTOCOMMIT"):
            await outbox.enqueue(conn, destination="orders", payload=b"alone")
        with pytest.raises(OutboxError, match="AUTOCOMMIT"):
            await outbox.enqueue_many(conn, [{"destination": "orders", "payload": b"alone"}])
    async with AsyncSession(auto) as session:
        with pytest.raises(OutboxError, match="AUTOCOMMIT"):
            async with session.begin():
                await session.execute(text("INSERT INTO orders VALUES (7, 1)"))
                await outbox.enqueue(session, destination="orders", payload=b"alone")
    assert await rows(db_url) == []
    # The business row committed alone (AUTOCOMMIT did that), the event did not follow it.
    assert await orders(db_url) == [7]


# --- every kind of connection: a refusal leaves the business transaction usable --------------

BAD_INPUTS: list[tuple[dict[str, Any], str]] = [
    ({"key": "k\x00"}, "key"),
    ({"key": "k" * 3000}, "key"),
    ({"destination": "d\ud800"}, "destination"),
    ({"payload": "x\udcff"}, "payload"),
    ({"payload": nested(50_000)}, "payload"),
    ({"headers": {"h": "\x00"}}, "headers"),
    ({"content_type": "a\r\nb"}, "content_type"),
]


@pytest.mark.parametrize(("bad", "field"), BAD_INPUTS)
def test_sync_refusals_leave_the_transaction_usable(
    sengine: Engine, db_url: str, bad: dict[str, Any], field: str
) -> None:
    import asyncio

    with Session(sengine) as session, session.begin():
        session.execute(text("INSERT INTO orders VALUES (1, 10)"))
        with pytest.raises(OutboxValidationError) as err:
            outbox.enqueue_sync(session, **{"destination": "d", "payload": b"ok", **bad})
        assert err.value.field == field
        session.execute(text("INSERT INTO orders VALUES (2, 10)"))  # still usable
    with sengine.begin() as conn:
        with pytest.raises(OutboxValidationError):
            outbox.enqueue_many_sync(conn, [{"destination": "d", "payload": b"ok", **bad}])
        conn.execute(text("INSERT INTO orders VALUES (3, 10)"))
    assert asyncio.run(orders(db_url)) == [1, 2, 3]
    assert asyncio.run(rows(db_url)) == []


@pytest.mark.parametrize(("bad", "field"), BAD_INPUTS)
async def test_async_refusals_leave_the_transaction_usable(
    aengine: AsyncEngine, db_url: str, bad: dict[str, Any], field: str
) -> None:
    async with AsyncSession(aengine) as session, session.begin():
        await session.execute(text("INSERT INTO orders VALUES (1, 10)"))
        with pytest.raises(OutboxValidationError) as err:
            await outbox.enqueue(session, **{"destination": "d", "payload": b"ok", **bad})
        assert err.value.field == field
        await session.execute(text("INSERT INTO orders VALUES (2, 10)"))
    async with aengine.begin() as conn:
        with pytest.raises(OutboxValidationError):
            await outbox.enqueue_many(conn, [{"destination": "d", "payload": b"ok", **bad}])
        await conn.execute(text("INSERT INTO orders VALUES (3, 10)"))
    assert await orders(db_url) == [1, 2, 3]
    assert await rows(db_url) == []
