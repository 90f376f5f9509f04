"""Any schema name PostgreSQL takes as a quoted identifier works for every command and the
enqueue API, or is refused at once with a clear message."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
import pytest
from click.testing import CliRunner, Result

import outbox
from outbox import queries
from outbox.dburl import to_asyncpg_dsn
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
    conn = await asyncpg.connect(to_asyncpg_dsn(url))
    try:
        async with conn.transaction():
            ids = await outbox.Outbox(schema).enqueue_many(
                conn, [{"destination": "orders", "payload": {"n": i}} for i in range(3)]
            )
    finally:
        await conn.close()
    s = settings(url, "127.0.0.1:1", relay={"schema": schema, "poll_interval": 5})
    async with running(s, sinks={"orders": Delivers()}) as relay:
        # Woken by its NOTIFY channel ("<schema>.outbox"), not by the 5 s poll.
        await wait_until(
            lambda: fetchval(url, f"SELECT count(*) = 3 FROM {table} WHERE status = 'delivered'"),
            timeout=4,
            what="delivered",
        )
        assert relay.stats["delivered"] == 3

    await fetchval(url, f"UPDATE {table} SET status = 'failed' WHERE id = $1", ids[0])
    base = ["--database-url", url, "--schema", schema, "--json"]
    for args, check in (
        (["status"], lambda d: d["totals"]["failed"] == 1 and d["relays"]),
        (["show", str(ids[1])], lambda d: d["rows"][0]["status"] == "delivered"),
        (["pause", "orders"], lambda d: d["paused"]),
        (["resume", "orders"], lambda d: d["was_paused"]),
        (["retry", "--id", str(ids[0])], lambda d: d["rows"] == 1),
        (["purge", "--older-than", "0s"], lambda d: d["deleted"]["delivered"] == 2),
    ):
        res = await cli(args[0], *base, *args[1:])
        assert res.exit_code == 0, (args, res.output)
        assert check(json.loads(res.output)), (args, res.output)


async def test_a_schema_name_too_long_for_postgres_is_refused_everywhere(
    empty_db_url: str, tmp_path: Any
) -> None:
    name = "s" * 57
    res = await cli("migrate", "--database-url", empty_db_url, "--schema", name)
    assert res.exit_code == 2 and "at most 56" in res.output
    with pytest.raises(MigrationError, match="at most 56"):
        await migrate(empty_db_url, schema=name)
    res = await cli("status", "--database-url", empty_db_url, "--schema", name)
    assert res.exit_code == 2 and "at most 56" in res.output
    with pytest.raises(ValueError, match="at most 56"):
        outbox.Outbox(name)
    with pytest.raises(ConfigError, match=r"relay\.schema: .*at most 56"):
        settings(empty_db_url, "127.0.0.1:1", relay={"schema": name})
    assert (
        await fetchval(empty_db_url, "SELECT count(*) FROM pg_namespace WHERE nspname = $1", name)
        == 0
    )


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
