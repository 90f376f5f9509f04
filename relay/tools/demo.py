"""``outbox-relay demo``: a real end-to-end run on this machine.

Creates a scratch database, starts a local Kafka-protocol broker (unless one is given), writes
orders with their ``order.created`` events in single transactions (and one that rolls back),
runs a relay, and reads the events back from the topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from decimal import Decimal
from urllib.parse import urlsplit

import asyncpg
import click
from aiokafka import AIOKafkaConsumer, TopicPartition
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import outbox
from outbox.dburl import redact, to_asyncpg_dsn, to_sqlalchemy_async_url
from outbox.migrate import migrate
from outbox.sql import load
from relay.app import Relay
from relay.obs.logs import configure
from relay.settings import load_settings
from relay.tools.localbroker import LocalBroker
from relay.tools.scratch import scratch_database

# The statements' text is in demo.sql beside this module: the orders' run through SQLAlchemy's
# text(), which binds :name itself.
_q = load("relay.tools", "demo.sql", binds="named")

ORDERS = _q["orders"]
INSERT_ORDER = _q["insert_order"]
INSERT_ROLLED_BACK_ORDER = _q["insert_rolled_back_order"]
DELIVERED_COUNT = _q["delivered_count"]


async def place_orders(db_url: str, count: int) -> list[int]:
    """The application side: each order and its event in one transaction."""
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    ids = []
    try:
        async with engine.begin() as conn:
            await conn.execute(text(ORDERS))
        for i in range(count):
            async with AsyncSession(engine) as session, session.begin():
                total = Decimal(10 + i) + Decimal("0.99")
                order_id = (
                    await session.execute(
                        text(INSERT_ORDER),
                        {"c": f"customer-{i % 3}", "t": total},
                    )
                ).scalar_one()
                ids.append(
                    await outbox.enqueue(
                        session,
                        destination="orders",
                        key=str(order_id),
                        payload={
                            "type": "order.created",
                            "order_id": order_id,
                            "total": str(total),
                        },
                        headers={"event-type": "order.created"},
                    )
                )
        # A transaction that fails after enqueueing: neither the order nor its event survive.
        with contextlib.suppress(RuntimeError):
            async with AsyncSession(engine) as session, session.begin():
                await session.execute(text(INSERT_ROLLED_BACK_ORDER))
                await outbox.enqueue(
                    session, destination="orders", payload={"type": "order.created", "x": 1}
                )
                raise RuntimeError("payment declined")
    finally:
        await engine.dispose()
    return ids


async def wait_delivered(db_url: str, count: int, timeout: float) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            n = await conn.fetchval(DELIVERED_COUNT)
            if n >= count:
                return
            await asyncio.sleep(0.05)
    finally:
        await conn.close()


async def read_topic(
    bootstrap: str, topic: str, want: int, timeout: float
) -> list[tuple[str, str, str]]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    seen: list[tuple[str, str, str]] = []
    try:
        deadline = time.monotonic() + timeout
        parts = consumer.partitions_for_topic(topic)
        while not parts and time.monotonic() < deadline:
            await consumer.topics()
            parts = consumer.partitions_for_topic(topic)
            await asyncio.sleep(0.05)
        tps = [TopicPartition(topic, p) for p in sorted(parts or [])]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        while len(seen) < want and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for r in records:
                    h = dict(r.headers)
                    seen.append(
                        (h["outbox-id"].decode(), (r.key or b"").decode(), r.value.decode())
                    )
    finally:
        await consumer.stop()
    return seen


async def run_demo(
    admin_url: str, bootstrap: str | None, count: int, keep: bool, topic: str = "orders"
) -> int:
    broker = None if bootstrap else LocalBroker()
    if broker is not None:
        broker.start()
        bootstrap = broker.bootstrap
        click.echo(f"started a local Kafka-protocol broker (Tansu, in memory) at {bootstrap}")
    assert bootstrap is not None
    try:
        async with scratch_database(admin_url, "outbox_demo", keep) as db_url:
            await migrate(db_url)
            click.echo(f"migrated scratch database {urlsplit(db_url).path[1:]}")
            started = time.monotonic()
            ids = await place_orders(db_url, count)
            click.echo(
                f"placed {count} orders, each with its event in the same transaction, "
                "and 1 more that rolled back"
            )
            settings = load_settings(
                None,
                database_url=db_url,
                # The in-memory demo broker rejects aiokafka's idempotent producer; real
                # deployments keep the default (idempotent, acks=all).
                kafka={"bootstrap_servers": bootstrap, "enable_idempotence": False},
                relay={"poll_interval": 0.5, "shutdown_timeout": 5},
                # No metrics listener: the demo must not take the port of a relay on this host.
                http={"enabled": False},
                destinations={"orders": {"kind": "kafka", "topic": topic}},
            )
            configure("info", "console")
            relay = Relay(settings)
            task = asyncio.create_task(relay.run())
            try:
                await wait_delivered(db_url, len(ids), timeout=30)
                seen = await read_topic(bootstrap, topic, len(ids), timeout=30)
            finally:
                relay.stop()
                status = await task
            elapsed = time.monotonic() - started
            for oid, key, value in sorted(seen, key=lambda s: int(s[0]))[:5]:
                click.echo(f"  outbox-id={oid} key={key} value={value}")
            if len(seen) > 5:
                click.echo(f"  … and {len(seen) - 5} more")
            got = {int(s[0]) for s in seen}
            ok = got == set(ids) and status == 0
            click.echo(
                f"{len(got)}/{len(ids)} committed events arrived on topic {topic!r} "
                f"in {elapsed:.2f}s; the rolled-back order's event did not "
                f"({'OK' if ok else 'MISMATCH'})"
            )
            if keep:
                click.echo(
                    f"kept scratch database {urlsplit(db_url).path[1:]}: `outbox-relay status "
                    f"--database-url {redact(db_url)}` shows its rows"
                )
            return 0 if ok else 1
    finally:
        if broker is not None:
            broker.stop()
