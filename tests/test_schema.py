"""Migrations, the SQLAlchemy model, the claim index and the NOTIFY trigger."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy import create_engine

from outbox import metadata as model_metadata
from outbox import queries
from outbox.dburl import to_asyncpg_dsn
from outbox.migrate import load_migrations, migrate
from relay.db import queries as relay_queries


async def fetch(url: str, sql: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(to_asyncpg_dsn(url))
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


async def test_migrate_twice_is_a_noop(empty_db_url: str) -> None:
    first = await migrate(empty_db_url)
    assert [m.version for m in first.applied] == [m.version for m in load_migrations()]
    second = await migrate(empty_db_url)
    assert second.applied == []
    assert second.already == [m.version for m in load_migrations()]
    versions = await fetch(empty_db_url, "SELECT version FROM outbox_migrations")
    assert len(versions) == len(load_migrations())


async def test_concurrent_migrate_is_safe(empty_db_url: str) -> None:
    results = await asyncio.gather(*(migrate(empty_db_url) for _ in range(4)))
    applied = [len(r.applied) for r in results]
    # Exactly one run applied everything; the others waited on the lock and found nothing.
    assert sorted(applied) == [0, 0, 0, len(load_migrations())]
    assert (await fetch(empty_db_url, "SELECT count(*) FROM outbox"))[0][0] == 0


async def test_dry_run_changes_nothing(empty_db_url: str) -> None:
    result = await migrate(empty_db_url, dry_run=True)
    assert result.applied
    assert (await fetch(empty_db_url, "SELECT to_regclass('outbox')"))[0][0] is None


def test_cli_migrate_and_dry_run(empty_db_url: str) -> None:
    exe = [sys.executable, "-m", "relay.cli", "migrate", "--database-url"]
    dry = subprocess.run([*exe, empty_db_url, "--dry-run"], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert "CREATE TABLE outbox" in dry.stdout
    url = empty_db_url.replace("postgresql://", "postgresql+asyncpg://")
    run = subprocess.run([*exe, url], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "applied 0001_outbox" in run.stdout
    again = subprocess.run(
        [sys.executable, "-m", "relay.cli", "migrate"],
        capture_output=True,
        text=True,
        env={"OUTBOX_DATABASE_URL": empty_db_url, "PATH": "/usr/bin:/bin"},
    )
    assert again.returncode == 0, again.stderr
    assert "up to date" in again.stdout


def test_cli_migrate_unreachable_database() -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "relay.cli",
            "migrate",
            "--database-url",
            "postgresql://root:secret@127.0.0.1:1/nope",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1
    assert "cannot migrate" in run.stderr and "PostgreSQL is running" in run.stderr
    assert "secret" not in run.stderr


def test_cli_migrate_bad_url() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "relay.cli", "migrate", "--database-url", "mysql://x/y"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1 and "postgresql://" in run.stderr


TABLES = (
    "outbox",
    "outbox_paused",
    "outbox_relays",
    "outbox_endpoints",
    "outbox_deliveries",
    "outbox_attempts",
    "outbox_inbox",
    "outbox_batches",
)

CATALOG = {
    "columns": """
        SELECT table_name, column_name, data_type, is_nullable, column_default, is_identity,
               identity_generation
        FROM information_schema.columns
        WHERE table_schema = 'public' AND table_name = ANY($1::text[])
        ORDER BY table_name, ordinal_position
    """,
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = 'public' AND tablename = ANY($1::text[]) ORDER BY indexname
    """,
    "constraints": """
        SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint
        WHERE conrelid = ANY(ARRAY(SELECT ('public.' || t)::regclass FROM unnest($1::text[]) t))
        ORDER BY conname
    """,
    "triggers": """
        SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid) FROM pg_trigger
        WHERE NOT tgisinternal
          AND tgrelid = ANY(ARRAY(SELECT ('public.' || t)::regclass FROM unnest($1::text[]) t))
        ORDER BY tgname
    """,
    "functions": r"""
        SELECT p.proname, regexp_replace(pg_get_functiondef(p.oid), '\s+', ' ', 'g')
        FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
        WHERE n.nspname = 'public' AND p.proname LIKE 'outbox%' AND $1::text[] IS NOT NULL
        ORDER BY p.proname
    """,
}


async def catalog(url: str) -> dict[str, list[tuple[object, ...]]]:
    return {k: [tuple(r) for r in await fetch(url, q, list(TABLES))] for k, q in CATALOG.items()}


async def test_model_matches_migrated_schema(db_url: str, empty_db_url: str) -> None:
    """The SQLAlchemy model, created by SQLAlchemy, yields the catalog the migrations yield."""
    engine = create_engine("postgresql+psycopg://" + empty_db_url.partition("://")[2])
    try:
        model_metadata.create_all(engine)
    finally:
        engine.dispose()
    migrated, modelled = await catalog(db_url), await catalog(empty_db_url)
    by_table = {t: [c for c in migrated["columns"] if c[0] == t] for t in TABLES}
    assert len(by_table["outbox"]) == 18 and len(by_table["outbox_paused"]) == 4
    assert len(by_table["outbox_relays"]) == 11 and len(by_table["outbox_endpoints"]) == 19
    assert len(by_table["outbox_deliveries"]) == 15 and len(by_table["outbox_attempts"]) == 10
    assert len(by_table["outbox_inbox"]) == 3 and len(by_table["outbox_batches"]) == 9
    assert {i[1] for i in migrated["indexes"]} >= {"outbox_inbox_pkey", "outbox_inbox_received_idx"}
    assert {i[1] for i in migrated["indexes"]} >= {"outbox_delivered_idx", "outbox_paused_pkey"}
    assert migrated == modelled


async def test_claim_query_uses_partial_index(db_url: str) -> None:
    """With a table full of history and another destination's backlog ahead, the claim
    reads only its own destination's claimable rows from the partial index."""
    conn = await asyncpg.connect(
        to_asyncpg_dsn(db_url), server_settings={"plan_cache_mode": "force_custom_plan"}
    )
    try:
        await conn.execute(
            """
            INSERT INTO outbox (destination, payload, status, delivered_at)
            SELECT 'orders', '\\x00'::bytea, 'delivered', now() FROM generate_series(1, 50000)
            """
        )
        await conn.execute(  # e.g. a paused destination, enqueued earlier
            "INSERT INTO outbox (destination, payload) SELECT 'paused', '\\x00'::bytea "
            "FROM generate_series(1, 20000)"
        )
        await conn.execute(
            "INSERT INTO outbox (destination, payload) SELECT 'orders', '\\x00'::bytea "
            "FROM generate_series(1, 100)"
        )
        await conn.execute("VACUUM ANALYZE outbox")
        claim = queries.render(relay_queries.CLAIM, queries.qualified_table("public"))
        raw = await conn.fetchval(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + claim, "orders", 100, "r", 30.0, 0, 2**62, 0
        )
    finally:
        await conn.close()
    plan = json.loads(raw) if isinstance(raw, str) else raw
    text = json.dumps(plan)
    assert "outbox_fresh_idx" in text and "outbox_waiting_idx" in text
    assert "Seq Scan" not in text
    # Only the 100 rows of 'orders' were read: nothing of the other backlog was skipped.
    lanes = ("outbox_fresh_idx", "outbox_waiting_idx")
    scans = [n for n in _nodes(plan[0]["Plan"]) if n.get("Index Name") in lanes]
    assert scans
    assert all(n["Actual Rows"] <= 100 for n in scans)
    # The claims' scans filter nothing out; the next cursor's (the first fresh row not taken)
    # passes over the 100 rows this claim took, and no other.
    claims = [n for n in scans if n["Node Type"] == "Index Scan"]
    cursors = [n for n in scans if n["Node Type"] == "Index Only Scan"]
    assert len(claims) == 3 and all(n.get("Rows Removed by Filter", 0) == 0 for n in claims)
    assert sorted(n.get("Rows Removed by Filter", 0) for n in cursors) == [0, 100]


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


async def test_one_notify_per_transaction(db_url: str) -> None:
    listener = await asyncpg.connect(to_asyncpg_dsn(db_url))
    writer = await asyncpg.connect(to_asyncpg_dsn(db_url))
    got: list[tuple[str, str]] = []
    arrived = asyncio.Event()

    def on_notify(_c: object, _pid: int, channel: str, payload: str) -> None:
        got.append((channel, payload))
        arrived.set()

    try:
        await listener.add_listener("public.outbox", on_notify)
        async with writer.transaction():
            for _ in range(5):
                await writer.execute("INSERT INTO outbox (destination, payload) VALUES ('a', 'x')")
            await writer.execute(
                "INSERT INTO outbox (destination, payload) SELECT 'a', 'x' "
                "FROM generate_series(1,9)"
            )
        await asyncio.wait_for(arrived.wait(), 5)
        # A second transaction notifies again.
        arrived.clear()
        await writer.execute("INSERT INTO outbox (destination, payload) VALUES ('b', 'y')")
        await asyncio.wait_for(arrived.wait(), 5)
        await asyncio.sleep(0.2)  # room for any stray extra notification to show up
        assert got == [("public.outbox", ""), ("public.outbox", "")]
    finally:
        await listener.close()
        await writer.close()


@pytest.mark.parametrize("bad", ["0001-outbox.sql", "x_outbox.sql"])
def test_migration_file_names_are_checked(tmp_path, bad: str) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / bad).write_text("SELECT 1")
    with pytest.raises(ValueError, match=r"NNNN_name\.sql"):
        load_migrations(tmp_path)


def test_dry_run_prints_sql_psql_can_run(empty_db_url: str) -> None:
    """The dry run's output, run by psql, migrates the schema it names (bookkeeping
    included), so a DBA can review and apply it by hand."""
    exe = [sys.executable, "-m", "relay.cli", "migrate", "--database-url", empty_db_url]
    dry = subprocess.run([*exe, "--schema", "events", "--dry-run"], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    done = subprocess.run(
        ["psql", empty_db_url, "-X", "-q", "-v", "ON_ERROR_STOP=1"],
        input=dry.stdout,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    again = subprocess.run([*exe, "--schema", "events"], capture_output=True, text=True)
    assert again.returncode == 0 and "up to date" in again.stdout, again.stdout
    tables = asyncio.run(fetch(empty_db_url, "SELECT to_regclass('events.outbox')::text"))
    assert tables[0][0] == "events.outbox"
    assert asyncio.run(fetch(empty_db_url, "SELECT to_regclass('public.outbox')"))[0][0] is None


@pytest.mark.parametrize("wait", ["1", "0"])
def test_migrate_says_what_it_waits_for_and_gives_up_after_wait(db_url: str, wait: str) -> None:
    """With --wait 0 the deadline has passed at the first look, as a short --wait's can on a
    loaded machine once the connection took it all (the give-up came without the line naming
    what it waited for: a run of this test beside heavy ones failed so, once)."""
    import psycopg

    with psycopg.connect(db_url, autocommit=True) as holder:
        holder.execute(
            "SELECT pg_advisory_lock(hashtextextended('outbox-relay:migrate:public', 0))"
        )
        pid = holder.execute("SELECT pg_backend_pid()").fetchone()
        argv = ["migrate", "--database-url", db_url, "--wait", wait]
        run = subprocess.run(
            [sys.executable, "-m", "relay.cli", *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert pid is not None
    assert run.returncode == 1
    assert f"waiting for another migrate of schema 'public' to finish: pid {pid[0]}" in run.stderr
    assert "held its lock too long" in run.stderr


async def test_a_migration_behind_a_long_transaction_does_not_hold_up_inserts(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ALTER TABLE waits for every transaction using the table, and every insert queues
    behind the waiting ALTER: a migration waits a few seconds at most per try, so the
    application's inserts keep going while an old transaction stays open."""
    import outbox.migrate as m
    from outbox.migrate import Migration

    extra = Migration(99, "probe", "ALTER TABLE outbox ADD COLUMN probe integer;")
    monkeypatch.setattr(m, "load_migrations", lambda: [*load_migrations(), extra])
    old = await asyncpg.connect(to_asyncpg_dsn(db_url))
    app = await asyncpg.connect(to_asyncpg_dsn(db_url))
    told: list[str] = []
    try:
        tx = old.transaction()
        await tx.start()
        await old.execute("INSERT INTO outbox (destination, payload) VALUES ('d', 'old')")
        migrating = asyncio.create_task(m.migrate(db_url, notify=told.append))
        await asyncio.sleep(4)  # past one lock_timeout: the migration waits and tries again
        assert not migrating.done() and told, told
        async with app.transaction():
            await app.execute("INSERT INTO outbox (destination, payload) VALUES ('d', 'new')")
        await tx.commit()
        result = await asyncio.wait_for(migrating, 30)
    finally:
        await old.close()
        await app.close()
    assert [x.version for x in result.applied] == [99]
    assert "waits for transactions that use the outbox table" in told[0]
    assert (await fetch(db_url, "SELECT count(*) FROM outbox"))[0][0] == 2


_KEY_INDEXES = """
SELECT count(*) FILTER (WHERE pg_get_indexdef(i.indexrelid) LIKE '%(destination, key, id)%'),
       count(*) FILTER (WHERE pg_get_indexdef(i.indexrelid) LIKE '%(%locked_until)%')
FROM pg_index AS i
WHERE i.indrelid = 'outbox'::regclass AND i.indisvalid
"""

_BEFORE_0011 = [
    "DROP INDEX outbox_key_idx",
    "DROP INDEX outbox_lease_idx",
    "CREATE INDEX outbox_key_idx ON outbox (destination, key, id) "
    "WHERE status IN ('pending', 'running', 'failed') AND key IS NOT NULL",
    "CREATE INDEX outbox_lease_idx ON outbox (locked_until) WHERE status = 'running'",
    "DELETE FROM outbox_migrations WHERE version = 11",
]


async def test_migration_0011_interrupted_anywhere_and_run_again(empty_db_url: str) -> None:
    """Stopped after any of its statements (a cancelled DROP INDEX CONCURRENTLY waiting for a
    long transaction, a lost connection) and run again, 0011 ends with the new indexes and the
    table never lacks a valid key index or lease index meanwhile: a relay's ordered claim and
    the reaper would scan the table."""
    await migrate(empty_db_url)
    (m,) = [m for m in load_migrations() if m.version == 11]
    statements = m.statements()
    conn = await asyncpg.connect(to_asyncpg_dsn(empty_db_url))
    try:
        for stop in range(len(statements) + 1):
            for sql in _BEFORE_0011:
                await conn.execute(sql)
            for sql in [*statements[:stop], *statements]:  # interrupted, then run again
                await conn.execute(sql)
                key, lease = await conn.fetchrow(_KEY_INDEXES)
                assert key >= 1 and lease >= 1, (stop, sql)
            await conn.execute(queries.RECORD_MIGRATION, m.version, m.name)
            indexes = {
                r["indexname"]: r["indexdef"]
                for r in await conn.fetch(
                    "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'outbox'"
                )
            }
            assert not [n for n in indexes if n.endswith(("_old_idx", "_next_idx"))], stop
            assert (
                "(destination, key, id) WHERE ((status = ANY "
                "(ARRAY['pending'::text, 'failed'::text]))" in indexes["outbox_key_idx"]
            )
            assert (
                "(destination, locked_until) WHERE (status = 'running'::text)"
                in indexes["outbox_lease_idx"]
            )
    finally:
        await conn.close()
    assert (await migrate(empty_db_url)).applied == []  # recorded: nothing left to run


_RUNNING_BY_ENDPOINT = """
SELECT count(*) FROM pg_index AS i
WHERE i.indrelid = 'outbox_deliveries'::regclass AND i.indisvalid
  AND pg_get_indexdef(i.indexrelid) LIKE '%(endpoint_id%WHERE (status = ''running''::text)'
"""

_BEFORE_0017 = [
    "DROP INDEX IF EXISTS outbox_deliveries_in_flight_idx",
    "DROP INDEX IF EXISTS outbox_deliveries_running_idx",
    "CREATE INDEX outbox_deliveries_running_idx ON outbox_deliveries (endpoint_id) "
    "WHERE status = 'running'",
    "DELETE FROM outbox_migrations WHERE version = 17",
]


async def test_migration_0017_interrupted_anywhere_and_run_again(empty_db_url: str) -> None:
    """Stopped after any of its statements and run again (a review found that a run whose
    statements had all run but whose record was lost began by dropping the new index), 0017
    ends with outbox_deliveries_in_flight_idx and never leaves the deliveries without a
    valid index of running ones by endpoint meanwhile: each claim's count in flight would
    read the lease index whole, once per endpoint walked."""
    for indexes in await _interrupted_anywhere(empty_db_url, 17, _BEFORE_0017):
        assert "outbox_deliveries_running_idx" not in indexes
        assert (
            "(endpoint_id, locked_until) WHERE (status = 'running'::text)"
            in indexes["outbox_deliveries_in_flight_idx"]
        )


_BEFORE_0018 = [
    "DROP INDEX IF EXISTS outbox_deliveries_fresh_idx",
    "DROP INDEX IF EXISTS outbox_deliveries_waiting_idx",
    "DROP INDEX IF EXISTS outbox_deliveries_in_flight_idx",
    "CREATE INDEX outbox_deliveries_in_flight_idx ON outbox_deliveries (endpoint_id, "
    "locked_until) WHERE status = 'running'",
    "DELETE FROM outbox_migrations WHERE version = 18",
]


async def test_migration_0018_interrupted_anywhere_and_run_again(empty_db_url: str) -> None:
    """Stopped after any of its statements and run again, 0018 ends with the claim's two
    lanes and the in-flight index keyed by relay, and never leaves the deliveries without a
    valid index of running ones by endpoint meanwhile (it swaps the in-flight index as 0017
    built it)."""
    for indexes in await _interrupted_anywhere(empty_db_url, 18, _BEFORE_0018):
        assert (
            "(endpoint_id, locked_until, locked_by) WHERE (status = 'running'::text)"
            in indexes["outbox_deliveries_in_flight_idx"]
        )
        assert "(endpoint_id, id) WHERE" in indexes["outbox_deliveries_fresh_idx"]
        assert "(endpoint_id, run_after, id)" in indexes["outbox_deliveries_waiting_idx"]


async def _interrupted_anywhere(url: str, version: int, before: list[str]) -> list[dict[str, str]]:
    """Migration ``version`` of the deliveries' indexes, from the state ``before`` sets,
    stopped after each of its statements and run again: after every statement a valid index
    of running deliveries by endpoint is there, and no build is left half way. The indexes
    on outbox_deliveries at the end of each run (name: definition); the migrations are then
    all recorded."""
    await migrate(url)
    (m,) = [m for m in load_migrations() if m.version == version]
    statements = m.statements()
    ends = []
    conn = await asyncpg.connect(to_asyncpg_dsn(url))
    try:
        for stop in range(len(statements) + 1):
            for sql in before:
                await conn.execute(sql)
            for sql in [*statements[:stop], *statements]:  # interrupted, then run again
                await conn.execute(sql)
                assert await conn.fetchval(_RUNNING_BY_ENDPOINT) >= 1, (stop, sql)
            await conn.execute(queries.RECORD_MIGRATION, m.version, m.name)
            indexes = {
                r["indexname"]: r["indexdef"]
                for r in await conn.fetch(
                    "SELECT indexname, indexdef FROM pg_indexes"
                    " WHERE tablename = 'outbox_deliveries'"
                )
            }
            assert not [n for n in indexes if n.endswith(("_old_idx", "_next_idx"))], stop
            ends.append(indexes)
    finally:
        await conn.close()
    assert (await migrate(url)).applied == []
    return ends


def test_no_transaction_migrations_hold_one_command_per_statement() -> None:
    """psql (running `migrate --dry-run`'s script) sends each command on its own: a statement
    of a migration outside a transaction holds one command, several only inside a DO block,
    or a step meant to be atomic (0011's swap of two index names) would not be under psql."""
    for m in load_migrations():
        if m.transactional:
            continue
        for statement in m.statements():
            outside_dollar_quotes = re.sub(r"\$\$.*?\$\$", "", statement, flags=re.S)
            assert ";" not in outside_dollar_quotes, (m.name, statement)
