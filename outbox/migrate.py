"""Forward-only SQL migrations, applied in order under an advisory lock."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import asyncpg

from outbox import queries
from outbox.dburl import to_asyncpg_dsn

_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


# A first line that marks a migration to run outside a transaction, statement by statement
# (CREATE INDEX CONCURRENTLY cannot run in one). Such a file holds statements separated by a
# semicolon at the end of a line, and must be safe to run again if it was interrupted.
NO_TRANSACTION = "-- outbox-relay: no transaction"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def transactional(self) -> bool:
        return not self.sql.startswith(NO_TRANSACTION)

    def statements(self) -> list[str]:
        """The statements of a migration that runs outside a transaction."""
        body = "\n".join(
            line for line in self.sql.splitlines() if not line.lstrip().startswith("--")
        )
        return [s.strip() for s in re.split(r";\s*\n", body + "\n") if s.strip()]


def _migrations_dir() -> Path:
    # Installed wheels carry the files as package data; an editable install or a checkout
    # reads them from the repository's top-level migrations/ folder.
    packaged = resources.files("outbox") / "_migrations"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parent.parent / "migrations"


def load_migrations(directory: Path | None = None) -> list[Migration]:
    directory = directory or _migrations_dir()
    found = []
    for path in sorted(directory.glob("*.sql")):
        m = _NAME.match(path.name)
        if not m:
            raise ValueError(f"migration file {path.name!r} is not named NNNN_name.sql")
        found.append(Migration(int(m.group(1)), m.group(2), path.read_text()))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise ValueError(f"duplicate migration versions in {directory}")
    return found


class MigrationError(Exception):
    """The migrations cannot be applied; the message says why and what to do."""


@dataclass(frozen=True)
class MigrateResult:
    applied: list[Migration]
    already: list[int]


async def migrate(
    database_url: str, *, schema: str = "public", dry_run: bool = False
) -> MigrateResult:
    """Apply every pending migration to ``schema``; a second run is a no-op."""
    try:
        queries.check_schema(schema)
    except ValueError as exc:
        raise MigrationError(f"{exc}; choose another --schema") from None
    conn = await asyncpg.connect(
        to_asyncpg_dsn(database_url), server_settings={"application_name": "outbox-relay-migrate"}
    )
    try:
        return await _migrate(conn, schema, dry_run)
    finally:
        await conn.close()


async def _migrate(conn: asyncpg.Connection, schema: str, dry_run: bool) -> MigrateResult:
    migrations = load_migrations()
    while True:
        if await conn.fetchval(queries.MIGRATE_LOCK, schema):
            break
        await asyncio.sleep(0.2)  # another migrate runs on this schema: wait for it
    try:
        applied: set[int] = set()
        tracked = await conn.fetchval(queries.SCHEMA_EXISTS, schema) and await conn.fetchval(
            queries.MIGRATIONS_TABLE_EXISTS, schema
        )
        if tracked:
            rows = await conn.fetch(queries.render_schema(queries.APPLIED_MIGRATIONS, schema))
            applied = {r[0] for r in rows}
        elif await conn.fetchval(queries.OUTBOX_TABLE_EXISTS, schema):
            raise MigrationError(
                f"schema {schema!r} already has a table named outbox that outbox-relay did not "
                "create (it has no outbox_migrations table): put the outbox in a schema of its "
                "own with --schema (and relay.schema), or rename that table"
            )
        pending = [m for m in migrations if m.version not in applied]
        if dry_run:
            return MigrateResult(applied=pending, already=sorted(applied))
        for m in pending:
            try:
                if m.transactional:
                    await _apply(conn, schema, m)
                else:
                    await _apply_outside_a_transaction(conn, schema, m)
            except asyncpg.PostgresError as exc:
                undone = "was rolled back" if m.transactional else "can be run again"
                raise MigrationError(
                    f"migration {m.version:04d}_{m.name} failed in schema {schema!r} and "
                    f"{undone}: {type(exc).__name__}: {exc}"
                ) from exc
        return MigrateResult(applied=pending, already=sorted(applied))
    finally:
        await conn.execute(queries.MIGRATE_UNLOCK, schema)


async def _apply(conn: asyncpg.Connection, schema: str, m: Migration) -> None:
    async with conn.transaction():
        await conn.execute(queries.render_schema(queries.CREATE_SCHEMA, schema))
        await conn.execute(queries.render_schema(queries.USE_SCHEMA, schema))
        await conn.execute(queries.MIGRATIONS_TABLE)
        await conn.execute(m.sql)
        await conn.execute(queries.RECORD_MIGRATION, m.version, m.name)


async def _apply_outside_a_transaction(conn: asyncpg.Connection, schema: str, m: Migration) -> None:
    await conn.execute(queries.render_schema(queries.USE_SCHEMA_SESSION, schema))
    try:
        for statement in m.statements():
            await conn.execute(statement)
        await conn.execute(queries.RECORD_MIGRATION, m.version, m.name)
    finally:
        await conn.execute(queries.RESET_SEARCH_PATH)
