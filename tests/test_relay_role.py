"""deploy/sql/relay_role.sql gives the relay what it needs on the outbox table, and no more."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import psycopg
import pytest

import outbox
from outbox.dburl import to_asyncpg_dsn
from outbox.migrate import migrate
from relay.db.store import Record, Store, create_pool
from relay.sinks.endpoints.at_rest import clear_expired_previous_secrets
from relay.sinks.endpoints.store import DeliveryRecord, DeliveryStore
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


async def test_relay_role_can_run_the_queue_and_nothing_else(db_url: str, role_name: str) -> None:
    """Every statement the relay runs (the Store's own), as the role; then what it must not do."""
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id int)")
    apply_role_sql(db_url, role_name)
    apply_role_sql(db_url, role_name)  # idempotent

    url = to_asyncpg_dsn(as_user(db_url, role_name))
    pool = await create_pool(url, "role-test", 2)
    try:
        store = Store(pool, "public", "role-test", 30.0)
        assert await store.missing_tables() == []
        await store.register("host", 1, "test", ["orders", "ordered"])
        assert await store.paused() == set()
        conn = await asyncpg.connect(url)
        try:
            async with conn.transaction():
                await outbox.enqueue_many(
                    conn,
                    [
                        {"destination": "orders", "payload": {"n": 1}},
                        {"destination": "orders", "payload": {"n": 2}},
                        {"destination": "ordered", "key": "k", "payload": {"n": 3}},
                        {"destination": "ordered", "key": "k", "payload": {"n": 4}},
                    ],
                )
        finally:
            await conn.close()
        first, second = await store.claim("orders", 10)
        (head,), _ = await store.claim_ordered("ordered", 10, False, 40, None)  # fence + claim
        leases = [(e.id, e.token) for e in (first, second, head)]
        assert await store.heartbeat(leases) == {first.id, second.id, head.id}
        done = Record(first.id, first.token, "delivered", 1, 0.0, None, "orders")
        failed = Record(head.id, head.token, "failed", 1, 0.0, "poison", "ordered", "k")
        assert await store.record([done, failed]) == {(first.id, 1), (head.id, 1)}
        assert [r["failed_id"] for r in await store.blocked_keys(["ordered"])] == [head.id]
        await store.release([(second.id, second.token)])
        (again,) = await store.claim("orders", 10)
        await _expire(db_url, again.id)
        assert [r["id"] for r in await store.reap(25, {"orders": 25})] == [again.id]
        assert await store.unknown_destinations(["orders"], 600) == []
        assert await store.fail_unknown_destinations(["orders", "ordered"], 600, 0) == []
        assert await store.pending_stats() is not None
        await _age_delivered(db_url)
        batch = await store.delete_finished(60, 100)
        assert batch is not None and batch.deleted == 1 and not batch.more
        await store.forget_relays(3600)
        await _endpoint_statements(db_url, store)
        await store.unregister()
    finally:
        await pool.close()

    with psycopg.connect(as_user(db_url, role_name), autocommit=True) as c:
        role = c.execute(
            "SELECT rolsuper, rolcreatedb, rolcreaterole, rolcanlogin FROM pg_roles "
            "WHERE rolname = current_user"
        ).fetchone()
        assert role == (False, False, False, True)
        c.execute('LISTEN "public.outbox"')
        for forbidden in (
            "SELECT * FROM orders",
            "SELECT * FROM outbox_migrations",
            "CREATE TABLE mine (id int)",
            "TRUNCATE outbox",
            "ALTER TABLE outbox ADD COLUMN x int",
            "INSERT INTO outbox_paused (destination) VALUES ('orders')",  # operators pause
            # Applications register endpoints; relays change only their health and state.
            "INSERT INTO outbox_endpoints (destination, url, secret) VALUES ('d', 'u', 's')",
            "UPDATE outbox_endpoints SET url = 'http://evil.example/'",
            "UPDATE outbox_endpoints SET secret = 'whsec_mine'",  # it may only clear old ones
            "DELETE FROM outbox_endpoints",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                c.execute(forbidden)


async def _endpoint_statements(db_url: str, store: Store) -> None:
    """The endpoints sink's statements, as the role: fan-out, claim, heartbeat, record (with
    the message log), health, disable, reap, release, and their retention."""
    owner = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        endpoint = await owner.fetchval(
            "INSERT INTO outbox_endpoints (destination, url, secret) "
            "VALUES ('customers', 'http://127.0.0.1:9/', $1) RETURNING id",
            "whsec_" + "A" * 44,
        )
        # A previous secret past its window, for the relay to clear.
        await owner.execute(
            "INSERT INTO outbox_endpoints (destination, url, secret, previous_secret, "
            "previous_secret_until) VALUES ('elsewhere', 'http://127.0.0.1:9/', $1, $1, "
            "now() - interval '1 s')",
            "whsec_" + "B" * 44,
        )
        events = [
            await owner.fetchval(
                "INSERT INTO outbox (destination, payload) VALUES ('customers', '{}') RETURNING id"
            )
            for _ in range(2)
        ]
    finally:
        await owner.close()
    deliveries = DeliveryStore(store)
    held = [(e.id, e.token) for e in await store.claim("customers", 10)]
    assert sorted(i for i, _ in held) == sorted(events)
    assert await deliveries.fan_out(held, "no endpoint matched") == dict.fromkeys(events, 1)
    first, second = (await deliveries.claim(["customers"], [10], [10], 10, [], 100, None, {}))[0]
    pairs = [(first.id, first.token), (second.id, second.token)]
    assert await deliveries.heartbeat(pairs) == {first.id, second.id}
    rec = DeliveryRecord(
        first.id,
        first.token,
        "delivered",
        1,
        0.0,
        None,
        http_status=200,
        event_id=first.event_id,
        endpoint_id=endpoint,
        duration_ms=1.0,
        response="ok",
    )
    assert await deliveries.record([rec]) == {(first.id, first.token)}
    assert await deliveries.health({endpoint: False}) == {endpoint: 0.0}
    await deliveries.circuits({endpoint: 30.0})
    assert await deliveries.disable(endpoint, "gone", None)
    await deliveries.release(pairs[1:])
    assert await deliveries.reap(5, {"customers": 5}) == 0
    assert await clear_expired_previous_secrets(store) == 1
    assert await store.delete_finished(0, 100) is not None


async def _expire(db_url: str, row_id: int) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(
            "UPDATE outbox SET locked_until = now() - interval '1 s' WHERE id = $1", row_id
        )
    finally:
        await conn.close()


async def _age_delivered(db_url: str) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(
            "UPDATE outbox SET delivered_at = now() - interval '1 hour' WHERE status = 'delivered'"
        )
    finally:
        await conn.close()


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
