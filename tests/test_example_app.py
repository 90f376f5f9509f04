"""The example service over real HTTP (uvicorn in a subprocess) against a real PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import httpx
import psycopg
import pytest

from relay.tools.localbroker import free_port
from tests.support.deploy import DEPLOY
from tests.support.kafka import consume

APP_DIR = DEPLOY / "example-app"


def wait_until_up(proc: subprocess.Popen[bytes], url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"exited with {proc.returncode}: {proc.stderr and proc.stderr.read()!r}"
            )
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer 200 within {timeout}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture
def app_url(db_url: str) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "APP_DATABASE_URL": db_url}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "example_app.main:app",
            "--app-dir",
            str(APP_DIR),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, url + "/healthz")
        yield url
    finally:
        stop(proc)
        if proc.stderr:
            proc.stderr.close()


def rows(db_url: str) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    with psycopg.connect(db_url) as c:
        orders = c.execute("SELECT id, customer, total, xmin::text FROM orders ORDER BY id")
        order_rows = orders.fetchall()
        events = c.execute(
            "SELECT id, destination, key, payload, content_type, headers, status, xmin::text "
            "FROM outbox ORDER BY id"
        )
        return order_rows, events.fetchall()


def test_an_order_and_its_event_commit_in_one_transaction(app_url: str, db_url: str) -> None:
    r = httpx.post(app_url + "/orders", json={"customer": "ada", "total": "12.50"}, timeout=10)
    assert r.status_code == 201, r.text
    body = r.json()

    orders, events = rows(db_url)
    [(order_id, customer, total, order_xmin)] = orders
    [(event_id, destination, key, payload, content_type, headers, status, event_xmin)] = events
    assert (order_id, customer, total) == (body["id"], "ada", Decimal("12.50"))
    assert event_id == body["event_id"]
    assert order_xmin == event_xmin  # written by the same transaction
    assert (destination, key, content_type, status) == (
        "orders",
        str(order_id),
        "application/json",
        "pending",
    )
    assert headers == {"event-type": "order.created"}
    event = json.loads(bytes(payload))
    assert datetime.fromisoformat(event.pop("created_at")) == datetime.fromisoformat(
        body["created_at"]
    )
    assert event == {"type": "order.created", "id": order_id, "customer": "ada", "total": "12.50"}
    got = httpx.get(f"{app_url}/orders/{order_id}", timeout=10).json()
    assert got == {k: body[k] for k in ("id", "customer", "total", "created_at")}


def test_a_failed_event_write_rolls_back_the_order(app_url: str, db_url: str) -> None:
    # The outbox INSERT fails after the order's INSERT ran in the same transaction.
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute(
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'outbox unavailable'; END $$"
        )
        c.execute("CREATE TRIGGER refuse BEFORE INSERT ON outbox EXECUTE FUNCTION refuse()")
    r = httpx.post(app_url + "/orders", json={"customer": "bob", "total": "3.00"}, timeout=10)
    assert r.status_code == 500
    invalid = httpx.post(app_url + "/orders", json={"customer": "", "total": "-1"}, timeout=10)
    assert invalid.status_code == 422
    assert rows(db_url) == ([], [])

    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("DROP TRIGGER refuse ON outbox")
    r = httpx.post(app_url + "/orders", json={"customer": "bob", "total": "3.00"}, timeout=10)
    assert r.status_code == 201
    orders, events = rows(db_url)
    assert (len(orders), len(events)) == (1, 1)


async def test_an_order_reaches_kafka_through_the_relay(
    app_url: str, db_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    config = tmp_path / "relay.toml"
    config.write_text(
        "[relay]\npoll_interval = 0.2\n[kafka]\nenable_idempotence = false\n"
        '[destinations.orders]\nkind = "kafka"\ntopic = "example-orders"\n'
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
        "OUTBOX_DATABASE_URL": db_url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
    }
    relay = subprocess.Popen(
        [sys.executable, "-m", "relay.cli", "run", "--config", str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        async with httpx.AsyncClient() as client:
            r = await client.post(app_url + "/orders", json={"customer": "cy", "total": "7.25"})
        assert r.status_code == 201
        order = r.json()
        records: list[object] = []
        deadline = time.monotonic() + 20
        while not records and time.monotonic() < deadline:
            if relay.poll() is not None:
                err = relay.stderr.read().decode() if relay.stderr else ""
                pytest.fail(f"the relay exited with {relay.returncode}: {err[-2000:]}")
            records = list(await consume(kafka_bootstrap, "example-orders", count=1, timeout=1))
        [record] = await consume(kafka_bootstrap, "example-orders", count=1)
        assert record.key == str(order["id"]).encode()
        assert json.loads(record.value)["id"] == order["id"]
        assert dict(record.headers)["outbox-id"] == str(order["event_id"]).encode()
    finally:
        stop(relay)
        if relay.stderr:
            relay.stderr.close()


async def test_the_order_stats_consumer_counts_each_order_once(
    db_url: str, kafka_bootstrap: str
) -> None:
    """The example's consumer gets one order.created event three times (redeliveries) and
    counts it once."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from example_app import consumer as order_stats
    from sqlalchemy import select
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from outbox.dburl import to_sqlalchemy_async_url

    topic = f"example-stats-{os.getpid()}-{time.monotonic_ns()}"
    event = {"type": "order.created", "id": 1, "customer": "ada", "total": "12.50"}
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, enable_idempotence=False)
    await producer.start()
    try:
        for _ in range(3):
            await producer.send_and_wait(
                topic, json.dumps(event).encode(), headers=[("outbox-id", b"1")], partition=0
            )
    finally:
        await producer.stop()
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    kafka = AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap,
        group_id=order_stats.NAME,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await kafka.start()
    try:
        await order_stats.create_tables(engine)
        kafka.assign([TopicPartition(topic, 0)])  # no group join: reads at once
        inbox = order_stats.order_stats(kafka, async_sessionmaker(engine))
        deadline = time.monotonic() + 20
        while inbox.counts.applied + inbox.counts.duplicates < 3 and time.monotonic() < deadline:
            await inbox.poll()
        async with engine.connect() as c:
            rows = (await c.execute(select(order_stats.CustomerStats.__table__))).all()
    finally:
        await kafka.stop()
        await engine.dispose()
    assert [tuple(r) for r in rows] == [("ada", 1, Decimal("12.50"))]
    assert (inbox.counts.applied, inbox.counts.duplicates) == (1, 2)
