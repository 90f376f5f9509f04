"""Forward-only SQL migrations, applied in order under an advisory lock."""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import asyncpg

from outbox import queries
from outbox.dburl import to_asyncpg_dsn
from outbox.errors import describe

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

    def preamble(self, schema: str) -> list[str]:
        """What runs before a transactional migration, in its transaction."""
        return [
            queries.render_schema(queries.CREATE_SCHEMA, schema),
            queries.render_schema(queries.USE_SCHEMA, schema),
            queries.MIGRATIONS_TABLE.strip(),
            queries.MIGRATION_LOCK_TIMEOUT,
        ]

    def script(self, schema: str) -> str:
        """The migration as SQL psql can run as it is (what `migrate --dry-run` prints)."""
        record = queries.RECORD_MIGRATION_SCRIPT.format(version=self.version, name=self.name) + ";"
        if self.transactional:
            lines = ["BEGIN;", *(f"{p};" for p in self.preamble(schema)), self.sql.strip()]
            return "\n".join([*lines, record, "COMMIT;"])
        lines = [queries.render_schema(queries.USE_SCHEMA_SESSION, schema) + ";"]
        lines += [f"{st};" for st in self.statements()]
        return "\n".join([*lines, record, queries.RESET_SEARCH_PATH + ";"])

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


UNREACHABLE: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
)
"""What else :func:`migrate` raises when the database cannot be reached or refuses (a bad
URL, a refused connection, a timeout, a server error): the commands that run it (``outbox-relay
migrate``, Django's ``outbox_migrate``) catch these to name the database and what to check."""


def not_utf8(encoding: str) -> str:
    return (
        f"the database's encoding is {encoding}: the outbox needs a UTF8 database (events "
        "carry any Unicode text, which another encoding cannot store); create the outbox in a "
        "UTF8 database"
    )


@dataclass(frozen=True)
class MigrateResult:
    applied: list[Migration]
    already: list[int]


Notify = Callable[[str], None]


async def migrate(
    database_url: str,
    *,
    schema: str = "public",
    dry_run: bool = False,
    wait: float = 600.0,
    notify: Notify | None = None,
) -> MigrateResult:
    """Apply every pending migration to ``schema``; a second run is a no-op.

    ``wait``: seconds to wait, in all, for another ``migrate`` of the schema and for the
    locks a migration needs (transactions that use the outbox table hold them); ``notify``
    is told, once per wait, what is being waited for. A dry run waits for nothing.
    """
    try:
        queries.check_schema(schema)
    except ValueError as exc:
        raise MigrationError(f"{exc}; choose another --schema") from None
    conn = await asyncpg.connect(
        to_asyncpg_dsn(database_url), server_settings={"application_name": "outbox-relay-migrate"}
    )
    try:
        if dry_run:
            return await _plan(conn, schema)
        deadline = time.monotonic() + wait
        await _take_lock(conn, schema, deadline, notify or _quiet)
        try:
            plan = await _plan(conn, schema)
            for m in plan.applied:
                await _apply_retrying(conn, schema, m, deadline, notify or _quiet)
            return plan
        finally:
            await conn.execute(queries.MIGRATE_UNLOCK, schema)
    finally:
        await conn.close()


def _quiet(message: str) -> None:
    pass


async def _take_lock(
    conn: asyncpg.Connection, schema: str, deadline: float, notify: Notify
) -> None:
    told = False
    while True:
        if await conn.fetchval(queries.MIGRATE_LOCK, schema):
            return
        holder = await conn.fetchrow(queries.MIGRATE_LOCK_HOLDER, schema)
        who = (
            f"pid {holder['pid']} ({holder['application_name'] or 'no name'}, "
            f"{holder['state']} since {holder['since']})"
            if holder
            else "another session"
        )
        # Told first: a deadline already past (a short --wait on a loaded machine, where the
        # connection took it all) still names what it waited for before giving up.
        if not told:
            notify(f"waiting for another migrate of schema {schema!r} to finish: {who}")
            told = True
        if time.monotonic() > deadline:
            raise MigrationError(
                f"another migrate of schema {schema!r} has held its lock too long: {who}; "
                "wait for it, or end that session (pg_terminate_backend)"
            )
        await asyncio.sleep(0.2)


async def _plan(conn: asyncpg.Connection, schema: str) -> MigrateResult:
    """The migrations not yet applied to ``schema``, after the checks every run makes."""
    encoding = await conn.fetchval(queries.SERVER_ENCODING)
    if encoding != "UTF8":
        raise MigrationError(not_utf8(encoding))
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
    pending = [m for m in load_migrations() if m.version not in applied]
    return MigrateResult(applied=pending, already=sorted(applied))


async def _apply_retrying(
    conn: asyncpg.Connection, schema: str, m: Migration, deadline: float, notify: Notify
) -> None:
    """Apply ``m``, waiting a few seconds at most for each lock it needs: a migration queued
    behind a long transaction would block every insert into the table while it waits."""
    told = False
    while True:
        try:
            if m.transactional:
                await _apply(conn, schema, m)
            else:
                await _apply_outside_a_transaction(conn, schema, m)
            return
        except asyncpg.LockNotAvailableError:
            if time.monotonic() > deadline:
                raise MigrationError(
                    f"migration {m.version:04d}_{m.name} could not take the locks it needs on "
                    f"schema {schema!r}: transactions that use the outbox table keep them "
                    "(see pg_stat_activity); nothing was changed, run migrate again"
                ) from None
            if not told:
                notify(
                    f"migration {m.version:04d}_{m.name} waits for transactions that use the "
                    "outbox table (trying again every few seconds, inserts are not held up)"
                )
                told = True
            await asyncio.sleep(random.uniform(0.5, 2.0))
        except asyncpg.PostgresError as exc:
            undone = "was rolled back" if m.transactional else "can be run again"
            raise MigrationError(
                f"migration {m.version:04d}_{m.name} failed in schema {schema!r} and "
                f"{undone}: {describe(exc)}"
            ) from exc


async def _apply(conn: asyncpg.Connection, schema: str, m: Migration) -> None:
    async with conn.transaction():
        for statement in m.preamble(schema):
            await conn.execute(statement)
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
