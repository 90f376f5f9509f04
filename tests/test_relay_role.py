"""deploy/sql/relay_role.sql gives the relay what it needs on the outbox table, and no more."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from outbox.migrate import migrate
from tests.support.deploy import DEPLOY

ROLE_SQL = DEPLOY / "sql" / "relay_role.sql"


def as_user(url: str, user: str, password: str | None = None) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    auth = f"{user}:{password}" if password else user
    return urlunsplit(parts._replace(netloc=f"{auth}@{host}"))


def apply_role_sql(url: str, role: str, schema: str = "public") -> None:
    done = subprocess.run(
        [
            "psql",
            url,
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-v",
            f"role={role}",
            "-v",
            "password=s3cret",
            "-v",
            f"schema={schema}",
            "-f",
            str(ROLE_SQL),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr


@pytest.fixture
def role_name(db_url: str, empty_db_url: str) -> Iterator[str]:
    """A login role of this test's own (roles are cluster-wide), dropped afterwards."""
    name = f"relay_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(db_url, autocommit=True) as c:
        if c.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone() is None:
            return
    for url in (db_url, empty_db_url):
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(f'DROP OWNED BY "{name}"')
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute(f'DROP ROLE IF EXISTS "{name}"')


def test_relay_role_can_run_the_queue_and_nothing_else(db_url: str, role_name: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id int)")
    apply_role_sql(db_url, role_name)
    apply_role_sql(db_url, role_name)  # idempotent

    with psycopg.connect(as_user(db_url, role_name), autocommit=True) as c:
        role = c.execute(
            "SELECT rolsuper, rolcreatedb, rolcreaterole, rolcanlogin FROM pg_roles "
            "WHERE rolname = current_user"
        ).fetchone()
        assert role == (False, False, False, True)
        c.execute('LISTEN "public.outbox"')
        [(row_id,)] = c.execute(
            "INSERT INTO outbox (destination, payload) VALUES ('orders', '\\x7b7d') RETURNING id"
        ).fetchall()
        claimed = c.execute(
            "UPDATE outbox SET status = 'running', locked_by = 'r', attempts = attempts + 1, "
            "locked_until = now() + interval '30 s' WHERE id IN (SELECT id FROM outbox "
            "WHERE status = 'pending' ORDER BY run_after, id FOR UPDATE SKIP LOCKED LIMIT 10) "
            "RETURNING id"
        ).fetchall()
        assert claimed == [(row_id,)]
        c.execute(
            "UPDATE outbox SET status = 'delivered', delivered_at = now() WHERE id = %s", (row_id,)
        )
        assert c.execute("DELETE FROM outbox WHERE status = 'delivered'").rowcount == 1
        assert c.execute("SELECT destination FROM outbox_paused").fetchall() == []

        for forbidden in (
            "SELECT * FROM orders",
            "SELECT * FROM outbox_migrations",
            "CREATE TABLE mine (id int)",
            "TRUNCATE outbox",
            "ALTER TABLE outbox ADD COLUMN x int",
            "INSERT INTO outbox_paused (destination) VALUES ('orders')",  # operators pause
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                c.execute(forbidden)


def test_migrate_as_a_non_superuser_owner_then_grant(
    empty_db_url: str, db_url: str, role_name: str
) -> None:
    """`migrate` needs CREATE on the database (for a new schema); the grants, CREATEROLE."""
    owner = f"{role_name}_own"
    database = urlsplit(empty_db_url).path.lstrip("/")
    with psycopg.connect(empty_db_url, autocommit=True) as c:
        c.execute(f'CREATE ROLE "{owner}" LOGIN CREATEROLE')
        c.execute(f'GRANT CREATE ON DATABASE "{database}" TO "{owner}"')
    try:
        owner_url = as_user(empty_db_url, owner)
        result = asyncio.run(migrate(owner_url, schema="events"))
        assert result.applied
        apply_role_sql(owner_url, role_name, schema="events")
        with psycopg.connect(as_user(empty_db_url, role_name), autocommit=True) as c:
            c.execute("INSERT INTO events.outbox (destination, payload) VALUES ('d', '\\x00')")
            assert c.execute("SELECT count(*) FROM events.outbox").fetchone() == (1,)
    finally:
        with psycopg.connect(empty_db_url, autocommit=True) as c:
            c.execute(f'DROP OWNED BY "{owner}"')
            c.execute(f'DROP ROLE "{owner}"')
