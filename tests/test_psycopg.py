"""Enqueue on psycopg 3 connections, sync and async, against a real database: the event
commits and rolls back with the caller's transaction, and is refused where it would commit
alone."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

import outbox
from outbox import Outbox, OutboxError, OutboxValidationError
from tests.test_enqueue import BAD_INPUTS

BUSINESS = "CREATE TABLE orders (id bigint PRIMARY KEY, total numeric NOT NULL)"

Conn = psycopg.Connection[Any]
AsyncConn = psycopg.AsyncConnection[Any]


@pytest.fixture
def conn(db_url: str) -> Iterator[Conn]:
    """A connection as psycopg makes it by default: not in autocommit."""
    with psycopg.connect(db_url) as c:
        c.execute(BUSINESS)
        c.commit()
        yield c


@pytest.fixture
async def aconn(db_url: str) -> AsyncIterator[AsyncConn]:
    async with await psycopg.AsyncConnection.connect(db_url) as c:
        await c.execute(BUSINESS)
        await c.commit()
        yield c


def rows(db_url: str) -> list[dict[str, Any]]:
    """What another session sees: committed rows only."""
    with psycopg.connect(db_url, row_factory=dict_row) as c:
        return c.execute("SELECT * FROM outbox ORDER BY id").fetchall()


def orders(db_url: str) -> list[int]:
    with psycopg.connect(db_url) as c:
        return [r[0] for r in c.execute("SELECT id FROM orders ORDER BY id")]


# --- sync ------------------------------------------------------------------------------------


def test_commit_keeps_both_and_rollback_neither(conn: Conn, db_url: str) -> None:
    with conn.transaction():
        conn.execute("INSERT INTO orders VALUES (1, 10)")
        eid = outbox.enqueue_sync(
            conn, destination="orders", key="1", payload={"type": "order.created"}
        )
    with pytest.raises(RuntimeError, match="boom"), conn.transaction():
        conn.execute("INSERT INTO orders VALUES (2, 20)")
        outbox.enqueue_sync(conn, destination="orders", payload={"id": 2})
        raise RuntimeError("boom")
    # psycopg's own transaction: opened by the first statement, ended by commit()/rollback().
    conn.execute("INSERT INTO orders VALUES (3, 30)")
    outbox.enqueue_sync(conn, destination="orders", payload=b"lost")
    conn.rollback()
    later = outbox.enqueue_sync(conn, destination="orders", payload="first statement")
    conn.execute("INSERT INTO orders VALUES (4, 40)")
    conn.commit()

    stored = rows(db_url)
    assert [r["id"] for r in stored] == [eid, later]
    assert orders(db_url) == [1, 4]
    r = stored[0]
    assert r["destination"] == "orders" and r["key"] == "1"
    assert json.loads(r["payload"]) == {"type": "order.created"}
    assert r["content_type"] == "application/json"
    assert r["status"] == "pending" and r["attempts"] == 0
    assert bytes(stored[1]["payload"]) == b"first statement"
    assert stored[1]["content_type"] == "text/plain; charset=utf-8"


def test_many_and_labelled_events(conn: Conn, db_url: str) -> None:
    when = datetime.now(UTC) + timedelta(hours=1)
    with conn.transaction():
        ids = outbox.enqueue_many_sync(
            conn,
            [
                {"destination": "a", "payload": {"n": 1}},
                {"destination": "b", "payload": b"\x00\x01", "key": "k2", "run_after": when},
                {"destination": "c", "payload": "s", "headers": {"x": "y"}},
            ],
        )
        labelled = outbox.enqueue_many_sync(
            conn,
            [
                {"destination": "e", "payload": b"1", "event_type": "invoice.paid"},
                {"destination": "e", "payload": b"2", "tenant": "acme"},
            ],
        )
        one = outbox.enqueue_sync(
            conn, destination="e", payload=b"3", event_type="order.created", tenant="acme"
        )
        assert outbox.enqueue_many_sync(conn, []) == []
    stored = {r["id"]: r for r in rows(db_url)}
    assert len(ids) == 3 and ids == sorted(ids) and min(labelled) > max(ids) and one > max(ids)
    assert [stored[i]["destination"] for i in ids] == ["a", "b", "c"]
    assert [stored[i]["key"] for i in ids] == [None, "k2", None]
    assert stored[ids[1]]["run_after"] == when
    assert bytes(stored[ids[1]]["payload"]) == b"\x00\x01"
    assert stored[ids[2]]["headers"] == {"x": "y"}  # psycopg reads jsonb as a dict
    assert [(stored[i]["event_type"], stored[i]["tenant"]) for i in [*labelled, one]] == [
        ("invoice.paid", None),
        (None, "acme"),
        ("order.created", "acme"),
    ]


def test_outside_a_transaction_is_refused_and_nothing_is_written(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        with pytest.raises(OutboxError, match=r"autocommit.*conn\.transaction\(\)"):
            outbox.enqueue_sync(conn, destination="orders", payload=b"alone")
        with pytest.raises(OutboxError, match="autocommit"):
            outbox.enqueue_many_sync(conn, [{"destination": "orders", "payload": b"alone"}])
        # Inside a transaction block an autocommit connection is in a transaction.
        with conn.transaction():
            kept = outbox.enqueue_sync(conn, destination="orders", payload=b"kept")
        with pytest.raises(RuntimeError), conn.transaction():
            outbox.enqueue_sync(conn, destination="orders", payload=b"rolled back")
            raise RuntimeError
    assert [r["id"] for r in rows(db_url)] == [kept]


def test_pipeline_mode_is_told_apart(db_url: str) -> None:
    """In pipeline mode a queued statement leaves the status ACTIVE whether or not a
    transaction block is open: enqueue syncs the pipeline first, then decides."""
    with psycopg.connect(db_url, autocommit=True) as conn, conn.pipeline():
        conn.execute("SELECT 1")
        with pytest.raises(OutboxError, match="autocommit"):
            outbox.enqueue_sync(conn, destination="orders", payload=b"alone")
        with conn.transaction():
            conn.execute("SELECT 1")
            kept = outbox.enqueue_sync(conn, destination="orders", payload=b"kept")
        with pytest.raises(RuntimeError), conn.transaction():
            conn.execute("SELECT 1")
            outbox.enqueue_sync(conn, destination="orders", payload=b"rolled back")
            raise RuntimeError
    assert [r["id"] for r in rows(db_url)] == [kept]


@pytest.mark.parametrize(("bad", "field"), BAD_INPUTS)
def test_refusals_leave_the_transaction_usable(
    conn: Conn, db_url: str, bad: dict[str, Any], field: str
) -> None:
    with conn.transaction():
        conn.execute("INSERT INTO orders VALUES (1, 10)")
        with pytest.raises(OutboxValidationError) as err:
            outbox.enqueue_sync(conn, **{"destination": "d", "payload": b"ok", **bad})
        assert err.value.field == field
        with pytest.raises(OutboxValidationError) as err:
            outbox.enqueue_many_sync(
                conn,
                [
                    {"destination": "d", "payload": b"ok"},
                    {"destination": "d", "payload": b"ok", **bad},
                ],
            )
        assert err.value.field.startswith("events[1].")
        conn.execute("INSERT INTO orders VALUES (2, 10)")  # still usable
    assert orders(db_url) == [1, 2]
    assert rows(db_url) == []


def test_the_connection_cursor_and_row_settings_do_not_matter(db_url: str) -> None:
    """Whatever rows and cursors the application chose for its connection, enqueue binds
    %s parameters and reads the ids as tuples."""
    ids = []
    for kw in ({"row_factory": dict_row}, {"cursor_factory": psycopg.ClientCursor}):
        with psycopg.connect(db_url, **kw) as conn, conn.transaction():
            ids.append(outbox.enqueue_sync(conn, destination="d", payload=b"x", key=None))
            ids += outbox.enqueue_many_sync(
                conn,
                [
                    {"destination": "d", "payload": b"\xff", "run_after": datetime.now(UTC)},
                    {"destination": "d", "payload": {"a": [1]}, "event_type": "t"},
                ],
            )
    stored = rows(db_url)
    assert [r["id"] for r in stored] == ids and len(ids) == 6
    assert [bytes(r["payload"]) for r in stored] == [b"x", b"\xff", b'{"a":[1]}'] * 2


async def test_a_schema_with_dollars_and_quotes(empty_db_url: str) -> None:
    """The %s statements are derived from the $n ones before the table name goes in: a $1
    in a schema name stays a name."""
    from outbox.migrate import migrate

    schema = 'ev$1 "x"'
    await migrate(empty_db_url, schema=schema)
    box = Outbox(schema)
    async with await psycopg.AsyncConnection.connect(empty_db_url) as conn:
        async with conn.transaction():
            await box.enqueue(conn, destination="d", payload=b"p")
            await box.enqueue_many(conn, [{"destination": "d", "payload": b"q"}])
        with psycopg.connect(empty_db_url) as sync, sync.transaction():
            box.enqueue_sync(sync, destination="d", payload=b"r")
        cur = await conn.execute('SELECT payload FROM "ev$1 ""x""".outbox ORDER BY id')
        assert [bytes(r[0]) for r in await cur.fetchall()] == [b"p", b"q", b"r"]


# --- async -----------------------------------------------------------------------------------


async def test_async_commit_and_rollback(aconn: AsyncConn, db_url: str) -> None:
    async with aconn.transaction():
        await aconn.execute("INSERT INTO orders VALUES (1, 10)")
        eid = await outbox.enqueue(aconn, destination="orders", payload={"id": 1})
        many = await outbox.enqueue_many(
            aconn,
            [
                {"destination": "orders", "payload": b"a", "tenant": "acme"},
                {"destination": "orders", "payload": b"b", "key": "k"},
            ],
        )
    with pytest.raises(RuntimeError):
        async with aconn.transaction():
            await aconn.execute("INSERT INTO orders VALUES (2, 20)")
            await outbox.enqueue(aconn, destination="orders", payload=b"lost")
            raise RuntimeError
    await aconn.execute("INSERT INTO orders VALUES (3, 30)")
    await outbox.enqueue(aconn, destination="orders", payload=b"lost too")
    await aconn.rollback()
    stored = rows(db_url)
    assert [r["id"] for r in stored] == [eid, *many]
    assert [r["tenant"] for r in stored] == [None, "acme", None]
    assert orders(db_url) == [1]


async def test_async_outside_a_transaction_is_refused(db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        with pytest.raises(OutboxError, match="autocommit"):
            await outbox.enqueue(conn, destination="orders", payload=b"alone")
        with pytest.raises(OutboxError, match="autocommit"):
            await outbox.enqueue_many(conn, [{"destination": "orders", "payload": b"alone"}])
        async with conn.transaction():
            kept = await outbox.enqueue(conn, destination="orders", payload=b"kept")
        async with conn.pipeline():
            await conn.execute("SELECT 1")
            with pytest.raises(OutboxError, match="autocommit"):
                await outbox.enqueue(conn, destination="orders", payload=b"alone")
            async with conn.transaction():
                await conn.execute("SELECT 1")
                also = await outbox.enqueue(conn, destination="orders", payload=b"also kept")
    assert [r["id"] for r in rows(db_url)] == [kept, also]


@pytest.mark.parametrize(("bad", "field"), BAD_INPUTS)
async def test_async_refusals_leave_the_transaction_usable(
    aconn: AsyncConn, db_url: str, bad: dict[str, Any], field: str
) -> None:
    async with aconn.transaction():
        await aconn.execute("INSERT INTO orders VALUES (1, 10)")
        with pytest.raises(OutboxValidationError) as err:
            await outbox.enqueue(aconn, **{"destination": "d", "payload": b"ok", **bad})
        assert err.value.field == field
        with pytest.raises(OutboxValidationError):
            await outbox.enqueue_many(aconn, [{"destination": "d", "payload": b"ok", **bad}])
        await aconn.execute("INSERT INTO orders VALUES (2, 10)")
    assert orders(db_url) == [1, 2]
    assert rows(db_url) == []


async def test_sync_and_async_connections_are_not_mixed_up(db_url: str) -> None:
    with (
        psycopg.connect(db_url) as conn,
        pytest.raises(TypeError, match="enqueue_sync for a sync Session or psycopg"),
    ):
        await outbox.enqueue(conn, destination="d", payload=b"")
    async with await psycopg.AsyncConnection.connect(db_url) as aconn:
        with pytest.raises(TypeError, match="await enqueue"):
            outbox.enqueue_sync(aconn, destination="d", payload=b"")  # type: ignore[arg-type]


def test_psycopg_is_not_imported_by_the_outbox() -> None:
    """psycopg stays optional: enqueue recognises its connections without importing it."""
    code = (
        "import sys, outbox; outbox.enqueue; import outbox.writer; print('psycopg' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "False"
