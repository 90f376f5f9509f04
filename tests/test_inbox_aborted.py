"""A handler that catches a database error and carries on leaves its transaction aborted, and
PostgreSQL answers that transaction's COMMIT with ROLLBACK, without an error: the effect and
the mark are gone. The inbox helpers must take that as a failure on every kind of database
handle they take, never as an event applied:

- the Kafka consumer (``outbox.inbox.kafka``) commits no offset for the record and raises, so
  the record is read again;
- the FastAPI dependency (``outbox.inbox.fastapi``) answers 500, so the relay sends again;
- a receiver that owns its transaction (``verify_and_mark``) is told by
  ``hook.check_committable()`` before it answers.

The idiom under test is the common "insert, and take a unique violation to mean it is already
there" (and its ORM form, a flush whose IntegrityError is caught), each against a real
database, a real broker and the real relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from fastapi import FastAPI
from sqlalchemy import Integer, create_engine, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import (
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from standardwebhooks import Webhook
from structlog.testing import capture_logs

import outbox
import outbox.inbox
from outbox import OutboxError
from outbox.dburl import to_asyncpg_dsn
from outbox.inbox import ReceivedWebhook, verify_and_mark, verify_and_mark_sync
from outbox.inbox.fastapi import verified_webhook
from outbox.inbox.kafka import KafkaInbox
from tests.support.asgi import serve
from tests.support.relays import running, settings, wait_until
from tests.webhook_helpers import SECRET

# Every handle the helpers open a transaction on (outbox/inbox/_db.py), over both async
# PostgreSQL drivers SQLAlchemy has: a driver decides what a failed statement leaves behind.
KAFKA_HANDLES = [
    "asyncpg-connection",
    "asyncpg-pool",
    "engine-asyncpg",
    "engine-psycopg",
    "sessionmaker-asyncpg",
    "sessionmaker-psycopg",
]
# verified_webhook refuses one asyncpg Connection (requests run concurrently).
FASTAPI_HANDLES = [h for h in KAFKA_HANDLES if h != "asyncpg-connection"]


class Base(DeclarativeBase):
    pass


class Customer(Base):
    __tablename__ = "customers"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)


@pytest.fixture
async def dsn(db_url: str) -> str:
    """The database, with customer 1 already there: inserting it again violates its key."""
    c = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await c.execute(
            "CREATE TABLE effects (event_id text PRIMARY KEY);"
            "CREATE TABLE customers (id int PRIMARY KEY);"
            "INSERT INTO customers VALUES (1)"
        )
    finally:
        await c.close()
    return to_asyncpg_dsn(db_url)


@contextlib.asynccontextmanager
async def database(kind: str, dsn: str) -> AsyncIterator[Any]:
    """The handle ``kind`` names, closed afterwards."""
    if kind == "asyncpg-connection":
        conn = await asyncpg.connect(dsn)
        try:
            yield conn
        finally:
            await conn.close()
        return
    if kind == "asyncpg-pool":
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
        try:
            yield pool
        finally:
            await pool.close()
        return
    what, _, driver = kind.partition("-")
    engine = create_async_engine(f"postgresql+{driver}://" + dsn.partition("://")[2])
    try:
        yield engine if what == "engine" else async_sessionmaker(engine)
    finally:
        await engine.dispose()


async def execute(tx: Any, sql: str) -> None:
    """``sql`` in the handler's transaction, whatever the helper handed it."""
    if isinstance(tx, asyncpg.Connection):
        await tx.execute(sql)
    else:
        await tx.execute(text(sql))


async def insert_ignoring_duplicates(tx: Any, sql: str) -> None:
    """The idiom under test: a unique violation taken to mean "already there"."""
    with contextlib.suppress(asyncpg.UniqueViolationError, IntegrityError):
        await execute(tx, sql)


async def rows(dsn: str, sql: str) -> list[Any]:
    c = await asyncpg.connect(dsn)
    try:
        return [r[0] for r in await c.fetch(sql)]
    finally:
        await c.close()


async def applied(dsn: str) -> tuple[list[str], list[str]]:
    """(effects, marks): what was committed."""
    return (
        await rows(dsn, "SELECT event_id FROM effects ORDER BY 1"),
        await rows(dsn, "SELECT event_id FROM outbox_inbox ORDER BY 1"),
    )


def aborted_logs(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "inbox.handler.aborted"]


# --- Kafka ---------------------------------------------------------------------------------


async def produce(bootstrap: str, topic: str, ids: list[str]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=False)
    await producer.start()
    try:
        for eid in ids:
            await producer.send_and_wait(
                topic, eid.encode(), headers=[("outbox-id", eid.encode())], partition=0
            )
    finally:
        await producer.stop()


@pytest.mark.parametrize("kind", KAFKA_HANDLES)
async def test_kafka_a_handler_that_swallowed_a_database_error_commits_no_offset(
    kafka_bootstrap: str, dsn: str, kind: str
) -> None:
    topic, group = f"aborted-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    await produce(kafka_bootstrap, topic, ["1", "2"])
    fixed = False

    async def handle(record: Any, tx: Any) -> None:
        eid = record.value.decode()
        await execute(tx, f"INSERT INTO effects VALUES ('{eid}')")
        if eid == "2" and not fixed:
            await insert_ignoring_duplicates(tx, "INSERT INTO customers VALUES (1)")

    tp = TopicPartition(topic, 0)
    c = AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await c.start()
    try:
        c.assign([tp])
        async with database(kind, dsn) as db:
            inbox = KafkaInbox(c, db, handle, name="billing", poll_timeout=0.2)
            with capture_logs() as logs, pytest.raises(OutboxError) as caught:
                for _ in range(20):  # the two records may come in one batch or two
                    await inbox.poll()
            assert isinstance(caught.value, outbox.inbox.TransactionAborted)
            message = str(caught.value)
            assert "'2'" in message and "ON CONFLICT DO NOTHING" in message
            assert (inbox.counts.applied, await c.committed(tp)) == (1, 1)
            assert await applied(dsn) == (["1"], ["1"])
            [line] = aborted_logs(logs)
            assert (line["event_id"], line["consumer"], line["offset"]) == ("2", "billing", 1)
            assert "savepoint" in line["hint"]

            # Set back to the record: once the handler is fixed, the next poll applies it.
            fixed = True
            for _ in range(20):  # a poll may end before the fetch from the new position
                if inbox.counts.applied == 2:
                    break
                await inbox.poll()
            assert (inbox.counts.applied, await c.committed(tp)) == (2, 2)
    finally:
        await c.stop()
    assert await applied(dsn) == (["1", "2"], ["1", "2"])


async def test_kafka_a_caught_flush_error_the_session_rolled_back_is_not_applied(
    kafka_bootstrap: str, dsn: str
) -> None:
    """The ORM form: a flush that fails rolls the session's transaction back at once (SQLAlchemy
    does), and a ``session.begin()`` block then ends without an error."""
    topic, group = f"aborted-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    await produce(kafka_bootstrap, topic, ["7"])

    async def handle(record: Any, session: AsyncSession) -> None:
        await session.execute(text("INSERT INTO effects VALUES ('7')"))
        session.add(Customer(id=1))
        with contextlib.suppress(IntegrityError):
            await session.flush()

    tp = TopicPartition(topic, 0)
    c = AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await c.start()
    try:
        c.assign([tp])
        async with database("sessionmaker-asyncpg", dsn) as sessions:
            inbox = KafkaInbox(c, sessions, handle, name="billing", poll_timeout=0.2)
            with capture_logs() as logs, pytest.raises(OutboxError, match="'7'"):
                for _ in range(10):
                    await inbox.poll()
            assert (inbox.counts.applied, await c.committed(tp)) == (0, None)
            assert [e["event_id"] for e in aborted_logs(logs)] == ["7"]
    finally:
        await c.stop()
    assert await applied(dsn) == ([], [])


# --- FastAPI -------------------------------------------------------------------------------


def signed(body: str, msg_id: str) -> dict[str, str]:
    stamp = datetime.now(UTC)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(stamp.timestamp())),
        "webhook-signature": Webhook(SECRET).sign(msg_id, stamp, body),
        "content-type": "application/json",
    }


def swallowing_app(db: Any, fixed: dict[str, bool]) -> FastAPI:
    hook_dep = verified_webhook(db, consumer="billing", secrets=[SECRET])
    app = FastAPI()

    @app.post("/hook")
    async def on_hook(hook: ReceivedWebhook = hook_dep) -> dict[str, bool]:
        if hook.new:
            await execute(hook.db, f"INSERT INTO effects VALUES ('{hook.id}')")
            if not fixed.get(hook.id):
                await insert_ignoring_duplicates(hook.db, "INSERT INTO customers VALUES (1)")
        return {"duplicate": hook.duplicate}

    return app


@pytest.mark.parametrize("kind", FASTAPI_HANDLES)
async def test_fastapi_a_handler_that_swallowed_a_database_error_is_answered_500(
    dsn: str, kind: str
) -> None:
    fixed: dict[str, bool] = {}
    body = '{"n": 1}'
    async with database(kind, dsn) as db:
        app = swallowing_app(db, fixed)
        async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:
            with capture_logs() as logs:
                first = await client.post("/hook", content=body, headers=signed(body, "5"))
            assert first.status_code == 500, first.text
            assert "not applied" in first.text
            assert await applied(dsn) == ([], [])
            assert [(e["event_id"], e["consumer"]) for e in aborted_logs(logs)] == [
                ("5", "billing")
            ]
            fixed["5"] = True  # the sender's retry, once the handler is fixed, applies it
            again = await client.post("/hook", content=body, headers=signed(body, "5"))
            assert (again.status_code, again.json()) == (200, {"duplicate": False})
    assert await applied(dsn) == (["5"], ["5"])


async def test_the_relay_is_answered_500_and_sends_the_event_again(db_url: str, dsn: str) -> None:
    """End to end: the real relay's first attempt meets the swallowed error and is not
    acknowledged; its retry, once the handler is fixed, applies the event once."""
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            [row_id] = await outbox.enqueue_many(conn, [{"destination": "hook", "payload": {}}])
    finally:
        await conn.close()
    fixed: dict[str, bool] = {}
    async with database("sessionmaker-asyncpg", dsn) as sessions:
        app = swallowing_app(sessions, fixed)
        async with serve(app) as url:
            destination = {
                "kind": "webhook",
                "url": url + "/hook",
                "secrets": [SECRET],
                "allow_private_networks": True,
                # Long enough for the row to be read back pending between the attempts.
                "backoff": {"schedule": [1.0], "jitter": 0},
            }
            s = settings(
                db_url,
                "127.0.0.1:9",
                destinations={"hook": destination},
                relay={"poll_interval": 0.2},
            )
            pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
            try:
                async with running(s):

                    async def attempted() -> bool:
                        return bool(
                            await pool.fetchval(
                                "SELECT attempts >= 1 FROM outbox WHERE id = $1", row_id
                            )
                        )

                    await wait_until(attempted, what="the first attempt")
                    first = await pool.fetchrow(
                        "SELECT status, attempts, last_error FROM outbox WHERE id = $1", row_id
                    )
                    assert (first["status"], first["attempts"]) == ("pending", 1)
                    assert first["last_error"].startswith("HTTP 500")
                    assert await applied(dsn) == ([], [])
                    fixed[str(row_id)] = True

                    async def delivered() -> bool:
                        status = await pool.fetchval(
                            "SELECT status FROM outbox WHERE id = $1", row_id
                        )
                        return bool(status == "delivered")

                    await wait_until(delivered, what="delivered on retry")
            finally:
                await pool.close()
    assert await applied(dsn) == ([str(row_id)], [str(row_id)])


# --- a receiver that owns its transaction: check_committable --------------------------------

# What verify_and_mark takes: SQLAlchemy's AsyncConnection and AsyncSession (over both async
# drivers), an asyncpg Connection; verify_and_mark_sync a Session or Connection.
ASYNC_TARGETS = [
    "asyncpg-connection",
    "connection-asyncpg",
    "session-asyncpg",
    "connection-psycopg",
    "session-psycopg",
]


@contextlib.asynccontextmanager
async def in_transaction(kind: str, dsn: str) -> AsyncIterator[Any]:
    """An open transaction of the connection ``kind`` names; committed if the block ends."""
    if kind == "asyncpg-connection":
        async with database(kind, dsn) as conn, conn.transaction():
            yield conn
        return
    what, _, driver = kind.partition("-")
    async with database(f"engine-{driver}", dsn) as engine:
        if what == "connection":
            async with engine.begin() as conn:
                yield conn
        else:
            async with AsyncSession(engine) as session, session.begin():
                yield session


@pytest.mark.parametrize("kind", ASYNC_TARGETS)
async def test_check_committable_tells_a_receiver_its_transaction_would_roll_back(
    dsn: str, kind: str
) -> None:
    body = '{"n": 1}'

    async def receive(msg_id: str, swallow: bool) -> None:
        async with in_transaction(kind, dsn) as tx:
            hook = await verify_and_mark(
                tx, consumer="c", headers=signed(body, msg_id), body=body.encode(), secrets=SECRET
            )
            await execute(tx, f"INSERT INTO effects VALUES ('{msg_id}')")
            if swallow:
                await insert_ignoring_duplicates(tx, "INSERT INTO customers VALUES (1)")
            await hook.check_committable()

    await receive("1", swallow=False)  # nothing failed: no error, and it commits
    with capture_logs() as logs, pytest.raises(outbox.inbox.TransactionAborted) as caught:
        await receive("2", swallow=True)
    assert (caught.value.event_id, caught.value.consumer) == ("2", "c")
    assert caught.value.status_code == 500 and "SQLSTATE 25P02" in str(caught.value)
    assert [e["event_id"] for e in aborted_logs(logs)] == ["2"]
    assert await applied(dsn) == (["1"], ["1"])


@pytest.mark.parametrize("kind", ["session", "connection"])
def test_check_committable_sync_on_a_session_and_a_connection(dsn: str, kind: str) -> None:
    body = '{"n": 1}'
    engine = create_engine("postgresql+psycopg://" + dsn.partition("://")[2])

    def receive(msg_id: str, swallow: bool) -> None:
        with contextlib.ExitStack() as stack:
            if kind == "session":
                tx: Any = stack.enter_context(Session(engine))
                stack.enter_context(tx.begin())
            else:
                tx = stack.enter_context(engine.begin())
            hook = verify_and_mark_sync(
                tx, consumer="c", headers=signed(body, msg_id), body=body.encode(), secrets=SECRET
            )
            tx.execute(text(f"INSERT INTO effects VALUES ('{msg_id}')"))
            if swallow:
                with contextlib.suppress(IntegrityError):
                    tx.execute(text("INSERT INTO customers VALUES (1)"))
            hook.check_committable_sync()

    try:
        receive("1", swallow=False)
        with pytest.raises(outbox.inbox.TransactionAborted, match="'2'"):
            receive("2", swallow=True)
    finally:
        engine.dispose()
    assert asyncio.run(applied(dsn)) == (["1"], ["1"])


async def test_a_transaction_ended_inside_the_handler_is_not_committable(dsn: str) -> None:
    """asyncpg: a handler that ran ROLLBACK itself leaves asyncpg's COMMIT to find no
    transaction (PostgreSQL only warns): nothing of it commits, so it is not applied."""
    body = '{"n": 1}'
    async with database("asyncpg-connection", dsn) as conn:
        with pytest.raises(outbox.inbox.TransactionAborted, match=r"ended .*inside the handler"):
            async with conn.transaction():
                hook = await verify_and_mark(
                    conn,
                    consumer="c",
                    headers=signed(body, "9"),
                    body=body.encode(),
                    secrets=SECRET,
                )
                await conn.execute("ROLLBACK")
                await hook.check_committable()
    assert await applied(dsn) == ([], [])
