"""Security under faults: secrets never reach the logs, SQL is only ever parameterised, and
the least-privilege role of deploy/sql/relay_role.sql is enough to run the relay."""

from __future__ import annotations

import ast
import asyncio
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import psycopg
import pytest

from outbox.dburl import to_asyncpg_dsn
from tests.support.faults import (
    Writer,
    all_delivered,
    events,
    fetch,
    fleet,
    read_copies,
    relay_config,
)
from tests.support.receiver import Receiver
from tests.support.relays import wait_until
from tests.test_relay_role import apply_role_sql, as_user
from tests.webhook_helpers import SECRET

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DB_SECRET = "Pg-s3cret-" + uuid.uuid4().hex[:8]
SASL_SECRET = "Sasl-s3cret-" + uuid.uuid4().hex[:8]


@pytest.fixture
def relay_role(db_url: str) -> Iterator[str]:
    """The relay's login role, made with the deploy script (roles are cluster-wide)."""
    name = f"relay_{uuid.uuid4().hex[:10]}"
    apply_role_sql(db_url, name)
    yield name
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute(f'DROP OWNED BY "{name}"')
        c.execute(f'DROP ROLE IF EXISTS "{name}"')


async def test_least_privilege_role_runs_the_relay_end_to_end(
    db_url: str, kafka_bootstrap: str, relay_role: str, tmp_path: Path, receiver: Receiver
) -> None:
    """As the role of deploy/sql/relay_role.sql: claim and deliver to Kafka, reap a dead
    relay's rows, keep a lease alive with heartbeats through a delivery longer than the lease,
    claim ordered rows through the visibility fence, and release held rows on SIGTERM."""
    topic = f"role-{uuid.uuid4().hex[:8]}"
    ids = await Writer(db_url, 2000, chunk=500, rate=1e9).run()
    first, second = await Writer(db_url, 2, keys=1, destination="ordered").run()
    # A dead relay's rows, for the reaper to take back under the role.
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(
            "UPDATE outbox SET status = 'running', locked_by = 'gone', "
            "locked_until = now() - interval '1 second' WHERE id = ANY($1)",
            ids[:50],
        )
    finally:
        await conn.close()
    lease = 3.0
    receiver.respond(200, delay=lease * 1.5)  # each ordered delivery outlasts the lease
    cfg = relay_config(
        as_user(db_url, relay_role, "s3cret"),
        kafka_bootstrap,
        topic,
        relay_id="role",
        lease=lease,
        shutdown_timeout=1,
    )
    cfg["destinations"]["ordered"] = {
        "kind": "webhook",
        "url": receiver.url,
        "secrets": [SECRET],
        "allow_private_networks": True,
        "ordering": "key",
        "timeout": 60,
    }
    with fleet(tmp_path) as relays:
        relay = relays.start(cfg, "role")

        async def done() -> bool:
            assert relay.proc is not None and relay.proc.poll() is None, relay.output()[-3000:]
            return await all_delivered(db_url, len(ids) + 1)

        await wait_until(done, timeout=60, what="delivered under the relay role")
        # The next ordered row is in flight now (its key's head was recorded): stop the relay
        # before its answer comes, so the row is released.
        await asyncio.to_thread(receiver.wait_for, 2, 10)
        relay.signal(signal.SIGTERM)
        status = await asyncio.to_thread(relay.wait, 30)
        output = relay.output()
    assert status == 0, output[-3000:]
    assert "permission denied" not in output and "InsufficientPrivilege" not in output
    reaped = events(output, "relay.lease.expired")
    assert reaped and all(e["last_id"] <= ids[49] for e in reaped)  # the dead relay's only
    assert not events(output, "relay.lease.lost")
    rows = {r["id"]: r for r in await fetch(db_url, "SELECT * FROM outbox")}
    # Delivered although it took 1.5 leases: the heartbeat kept the lease, nothing reaped it.
    assert (rows[first]["status"], rows[first]["attempts"]) == ("delivered", 1)
    # Held at SIGTERM, released unattempted.
    assert (rows[second]["status"], rows[second]["attempts"], rows[second]["claims"]) == (
        "pending",
        0,
        1,
    )
    assert [e["count"] for e in events(output, "relay.released")] == [1]
    await read_copies(kafka_bootstrap, topic, ids)


def test_secrets_never_reach_the_logs(db_url: str, kafka_bootstrap: str, tmp_path: Path) -> None:
    """A database password and a SASL password, through start-up, debug logging, a Kafka
    that refuses SASL, lost connections, a config error and an unreachable database."""
    host = db_url.split("@", 1)[1]
    url = f"postgresql://root:{DB_SECRET}@{host}"  # trust authentication ignores it
    cfg = relay_config(url, kafka_bootstrap, "secrets", relay_id="secretive")
    cfg["log_level"] = "debug"
    cfg["kafka"].update(
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="PLAIN",
        sasl_plain_username="relay",
        sasl_plain_password=SASL_SECRET,
    )
    outputs: list[str] = []

    async def scenario() -> None:
        await Writer(db_url, 20).run()
        with fleet(tmp_path) as relays:
            relay = relays.start(cfg, "secretive")
            await wait_until(
                lambda: '"relay.sink.unavailable"' in relay.output(),
                timeout=60,
                what="Kafka refused the SASL client",
            )
            admin = await asyncpg.connect(to_asyncpg_dsn(db_url))
            try:
                # The listener connects after start-up: only a listener that was connected
                # can be lost and come back.
                await wait_until(
                    lambda: admin.fetchval(
                        "SELECT count(*) > 0 FROM pg_stat_activity "
                        "WHERE datname = current_database() "
                        "AND application_name = 'outbox-relay-listen:secretive'"
                    ),
                    timeout=30,
                    what="the listener connected",
                )
                await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name LIKE "
                    "'outbox-relay%:secretive'"
                )
            finally:
                await admin.close()
            await wait_until(
                lambda: '"relay.listener.recovered"' in relay.output(), timeout=30, what="back"
            )
            relay.signal(signal.SIGTERM)
            await asyncio.to_thread(relay.wait, 30)
            outputs.append(relay.output())

    asyncio.run(scenario())
    # Error paths at start-up: an unreachable database, and a bad value next to the secrets.
    for broken in (
        {**cfg, "database_url": f"postgresql://root:{DB_SECRET}@127.0.0.1:1/x"},
        {**cfg, "database_url": f"mysql://root:{DB_SECRET}@h/x"},
        {**cfg, "kafka": {**cfg["kafka"], "sasl_plain_password": [SASL_SECRET]}},
    ):
        broken["relay"] = {**cfg["relay"], "startup_timeout": 1}
        with fleet(tmp_path) as relays:
            p = relays.start(broken, f"broken-{uuid.uuid4().hex[:6]}")
            assert p.wait(60) in (1, 2)
            outputs.append(p.output())
    everything = "\n".join(outputs)
    assert '"relay.started"' in everything and "cannot reach the database" in everything
    assert DB_SECRET not in everything
    assert SASL_SECRET not in everything


SQL_CALLS = {"execute", "executemany", "fetch", "fetchrow", "fetchval", "_call", "call", "text"}
# Runners that take the method's name first and the SQL second: Store._call, the parts'
# call (relay/db), store.call (the endpoints sink).
SQL_SECOND = {"_call", "call"}


def built_sql(tree: ast.AST) -> list[int]:
    """The lines where SQL handed to a call is built from values: an f-string, % or + on
    it, or .format(). Calls through an attribute (``conn.fetch(…)``, ``self._call(…)``) and
    by a plain name (``call(…)``, a runner passed in; ``text(…)``, SQLAlchemy's) alike."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name not in SQL_CALLS or not node.args:
            continue
        sql = node.args[1] if name in SQL_SECOND and len(node.args) > 1 else node.args[0]
        bad = isinstance(sql, ast.JoinedStr) or (
            isinstance(sql, ast.BinOp) and isinstance(sql.op, ast.Mod | ast.Add)
        )
        bad |= (
            isinstance(sql, ast.Call)
            and isinstance(sql.func, ast.Attribute)
            and sql.func.attr == "format"
        )
        if bad:
            lines.append(node.lineno)
    return lines


def test_the_check_sees_sql_built_wherever_it_is_run() -> None:
    code = """
async def checks(call, store, conn, t):
    await call("fetchval", f"SELECT {t}")
    await store.call("fetch", "SELECT " + t)
    await store._call("fetchrow", "SELECT %s" % t)
    await conn.fetchval("SELECT {}".format(t))
    await call("fetchval", QUERY, t)
    await conn.fetch(QUERY, t)
    await conn.execute(text(f"SELECT {t}"))
"""
    assert built_sql(ast.parse(code)) == [3, 4, 5, 6, 9]


def test_sql_is_only_ever_parameterised() -> None:
    """No statement is built from values: every SQL call's text is a constant, a rendered
    constant (table/schema names, quoted once), or a variable holding one. f-strings, %,
    .format() and + on SQL text are refused wherever SQL is run."""
    offenders = []
    for path in sorted([*(ROOT / "relay").rglob("*.py"), *(ROOT / "outbox").rglob("*.py")]):
        for line in built_sql(ast.parse(path.read_text())):
            offenders.append(f"{path.relative_to(ROOT)}:{line}")
    assert not offenders, offenders
