"""Any schema name PostgreSQL takes as a quoted identifier works for every command and the
enqueue API, or is refused at once with a clear message."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import asyncpg
import pytest
from click.testing import CliRunner, Result
from sqlalchemy import MetaData, create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import outbox
from outbox import define_outbox_table, queries
from outbox.dburl import to_asyncpg_dsn, to_sqlalchemy_async_url
from outbox.migrate import MigrationError, migrate
from relay.cli import main
from relay.config import ConfigError
from relay.model import Envelope, Outcome
from tests.support.relays import running, settings, wait_until
from tests.support.sinks import MemorySink

SHAPES = ["Events", "my events", "a.b", 'we"ird', "o'brien", "ünïcode", "s" * 56]


class Delivers(MemorySink):
    async def deliver(self, batch: list[Envelope]) -> list[Outcome]:  # type: ignore[override]
        return [Outcome.delivered(e.id) for e in batch]


async def cli(*args: str) -> Result:
    # The commands run their own event loop: keep them off this one.
    return await asyncio.to_thread(CliRunner().invoke, main, list(args))


async def fetchval(url: str, sql: str, *args: Any) -> Any:
    conn = await asyncpg.connect(to_asyncpg_dsn(url))
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


@pytest.mark.parametrize("schema", SHAPES)
async def test_every_command_works_in_a_schema_of_any_name(empty_db_url: str, schema: str) -> None:
    url = empty_db_url
    first = await cli("migrate", "--database-url", url, "--schema", schema)
    assert first.exit_code == 0 and "applied 0004" in first.output, first.output
    again = await cli("migrate", "--database-url", url, "--schema", schema)
    assert again.exit_code == 0 and "up to date" in again.output, again.output

    table = queries.qualified_table(schema)
    box = outbox.Outbox(schema)
    conn = await asyncpg.connect(to_asyncpg_dsn(url))
    try:
        async with conn.transaction():
            ids = await box.enqueue_many(
                conn, [{"destination": "orders", "payload": {"n": i}} for i in range(3)]
            )
    finally:
        await conn.close()
    # And through SQLAlchemy, whose text() reads names after a colon in SQL.
    engine = create_async_engine(to_sqlalchemy_async_url(url))
    try:
        async with AsyncSession(engine) as session, session.begin():
            ids.append(await box.enqueue(session, destination="orders", payload=b"sa"))
    finally:
        await engine.dispose()
    sync = create_engine("postgresql+psycopg://" + url.partition("://")[2])
    try:
        with Session(sync) as session, session.begin():
            ids.append(box.enqueue_sync(session, destination="orders", payload=b"sync"))
    finally:
        sync.dispose()
    s = settings(url, "127.0.0.1:1", relay={"schema": schema, "poll_interval": 5})
    async with running(s, sinks={"orders": Delivers()}) as relay:
        # Woken by its NOTIFY channel ("<schema>.outbox"), not by the 5 s poll.
        await wait_until(
            lambda: fetchval(url, f"SELECT count(*) = 5 FROM {table} WHERE status = 'delivered'"),
            timeout=4,
            what="delivered",
        )
        assert relay.stats["delivered"] == 5

    await fetchval(url, f"UPDATE {table} SET status = 'failed' WHERE id = $1", ids[0])
    base = ["--database-url", url, "--schema", schema, "--json"]
    for args, check in (
        (["status"], lambda d: d["totals"]["failed"] == 1 and d["relays"]),
        (["show", str(ids[1])], lambda d: d["rows"][0]["status"] == "delivered"),
        (["pause", "orders"], lambda d: d["paused"]),
        (["resume", "orders"], lambda d: d["was_paused"]),
        (["retry", "--id", str(ids[0])], lambda d: d["rows"] == 1),
        (["purge", "--older-than", "0s", "--yes"], lambda d: d["deleted"]["delivered"] == 4),
    ):
        res = await cli(args[0], *base, *args[1:])
        assert res.exit_code == 0, (args, res.output)
        assert check(json.loads(res.output)), (args, res.output)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("s" * 57, "at most 56"),
        ("my :events", "contains ':'"),
        ("a\\b", "contains '\\\\'"),
        ("x%y", "contains '%'"),
        ("{paused}", "contains '{', '}'"),
    ],
)
async def test_a_schema_name_the_outbox_cannot_use_is_refused_everywhere(
    empty_db_url: str, name: str, why: str
) -> None:
    res = await cli("migrate", "--database-url", empty_db_url, "--schema", name)
    assert res.exit_code == 2 and why in res.output, res.output
    with pytest.raises(MigrationError, match=re.escape(why)):
        await migrate(empty_db_url, schema=name)
    res = await cli("status", "--database-url", empty_db_url, "--schema", name)
    assert res.exit_code == 2 and why in res.output
    with pytest.raises(ValueError, match=re.escape(why)):
        outbox.Outbox(name)
    with pytest.raises(ValueError, match=re.escape(why)):
        define_outbox_table(MetaData(), schema=name)
    with pytest.raises(ConfigError, match=r"relay\.schema: .*" + re.escape(why)):
        settings(empty_db_url, "127.0.0.1:1", relay={"schema": name})
    count = "SELECT count(*) FROM pg_namespace WHERE nspname = $1"
    assert await fetchval(empty_db_url, count, name) == 0


def test_the_sqlalchemy_model_takes_any_schema_the_migrations_take(empty_db_url: str) -> None:
    """The Alembic path: define_outbox_table with a quote in the schema name."""
    engine = create_engine("postgresql+psycopg://" + empty_db_url.partition("://")[2])
    try:
        with engine.begin() as c:
            c.execute(text('CREATE SCHEMA "we""ird"'))
        metadata = MetaData()
        define_outbox_table(metadata, schema='we"ird')
        metadata.create_all(engine)
        with Session(engine) as session, session.begin():
            outbox.Outbox('we"ird').enqueue_sync(session, destination="d", payload=b"x")
        with engine.connect() as c:
            assert c.execute(text('SELECT count(*) FROM "we""ird".outbox')).scalar() == 1
    finally:
        engine.dispose()


async def test_an_unrelated_outbox_table_stops_migrate_with_one_line(empty_db_url: str) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(empty_db_url))
    try:
        await conn.execute("CREATE TABLE outbox (id serial PRIMARY KEY, body text)")
    finally:
        await conn.close()
    res = await cli("migrate", "--database-url", empty_db_url)
    assert res.exit_code == 1
    assert "already has a table named outbox that outbox-relay did not create" in res.output
    assert "--schema" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1
    # Nothing was half-applied; another schema works.
    res = await cli("migrate", "--database-url", empty_db_url, "--schema", "events")
    assert res.exit_code == 0, res.output
