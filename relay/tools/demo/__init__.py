"""``outbox-relay demo``: the relay's three uses, end to end on this machine.

Creates a scratch database, starts a local Kafka-protocol broker (unless one is given) and a
local webhook receiver, registers an endpoint per tenant at runtime, and places orders, each
with its three events in the order's own transaction (and one more that rolls back). Then it
runs the relay (relay.app.Relay) with a destination of each kind and prints what each use
received: the Kafka topic (orders.py, kafka.py), the webhook receiver, which refuses one
request once so that the retry shows (webhooks.py), and each endpoint (endpoints.py).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from urllib.parse import urlsplit

import asyncpg
import click

from outbox.dburl import redact, to_asyncpg_dsn
from outbox.migrate import migrate
from relay.app import Relay
from relay.config.settings import Settings
from relay.obs.logs import configure
from relay.settings import load_settings
from relay.tools.demo import console as serving
from relay.tools.demo import endpoints, kafka, progress, webhooks
from relay.tools.demo.errors import DemoError
from relay.tools.demo.orders import ENDPOINTS, KAFKA, WEBHOOK, Placed, place_orders
from relay.tools.demo.receiver import Receiver, receiving
from relay.tools.localbroker import LocalBroker
from relay.tools.scratch import scratch_database

__all__ = ["DemoError", "run_demo"]

SCHEMA = "public"
# Everything is delivered in a few seconds; past this (and a moment per 100 orders), the demo
# says what is missing.
DELIVERY_TIMEOUT_S = 20.0


async def run_demo(
    admin_url: str,
    bootstrap: str | None,
    count: int,
    keep: bool,
    topic: str = "orders",
    console: bool = True,
) -> int:
    """The demo; with ``keep`` (and ``console``), then the console on its database until
    Ctrl-C, once the broker and the receiver are gone."""
    ok, db_url = await _run(admin_url, bootstrap, count, keep, topic)
    if keep:
        token = secrets.token_urlsafe(18)
        again = _next_steps(db_url, token, console)
        if console:
            await serving.serve(db_url, SCHEMA, token, again)
    return 0 if ok else 1


async def _run(
    admin_url: str, bootstrap: str | None, count: int, keep: bool, topic: str
) -> tuple[bool, str]:
    await _check_database(admin_url)
    broker = None if bootstrap else LocalBroker()
    if broker is not None:
        broker.start()
        bootstrap = broker.bootstrap
        click.echo(f"started a local Kafka-protocol broker (Tansu, in memory) at {bootstrap}")
    assert bootstrap is not None
    try:
        await kafka.check_broker(bootstrap)
        async with (
            receiving() as receiver,
            scratch_database(admin_url, "outbox_demo", keep) as db_url,
        ):
            click.echo(
                f"started a local webhook receiver at {receiver.url}: it verifies every "
                "request's signature with the standardwebhooks library"
            )
            ok = await _demo(db_url, bootstrap, count, topic, receiver)
            if not keep:
                click.echo(
                    f"dropping scratch database {_name(db_url)}; `outbox-relay demo --keep` "
                    "keeps it and serves the console on it"
                )
            return ok, db_url
    finally:
        if broker is not None:
            broker.stop()


async def _check_database(admin_url: str) -> None:
    """Fail now, saying so, if the server to make the scratch database on cannot be reached."""
    try:
        conn = await asyncpg.connect(to_asyncpg_dsn(admin_url), timeout=10)
    except (OSError, TimeoutError) as exc:
        raise DemoError(
            f"cannot reach PostgreSQL at {redact(admin_url)} ({exc}): check --database-url / "
            "OUTBOX_DATABASE_URL and that the server is running"
        ) from exc
    await conn.close()


async def _demo(db_url: str, bootstrap: str, count: int, topic: str, receiver: Receiver) -> bool:
    settings = _settings(db_url, bootstrap, topic, receiver)
    await migrate(db_url, schema=SCHEMA)
    click.echo(f"migrated scratch database {_name(db_url)}")
    registered = await endpoints.register(db_url, SCHEMA, receiver)
    click.echo(
        f"registered {len(registered)} endpoints at runtime, as `outbox-relay endpoints add` "
        "does: " + ", ".join(f"{e.id} for tenant {e.tenant} at {e.path}" for e in registered)
    )
    placed = await place_orders(db_url, count, run=_name(db_url))
    click.echo(
        f"placed {count} order{'' if count == 1 else 's'}, each with its 3 events (kafka, "
        "webhook, endpoints) in the same transaction, and 1 more that rolled back"
    )
    id_prefix = settings.section("webhooks").id_prefix or ""
    refused = placed.webhook[len(placed.webhook) // 2]
    receiver.refuse_once(webhooks.PATH, f"{id_prefix}{refused}")
    click.echo(
        f"relay: running with 3 destinations: {KAFKA} (kafka), {WEBHOOK} (webhook), "
        f"{ENDPOINTS} (endpoints)"
    )
    started = time.monotonic()
    # Enough for --count 100000 on a slow machine; the default 20 takes about 2 s.
    timeout = DELIVERY_TIMEOUT_S + count / 100
    done, attempts = await _relay(settings, db_url, placed, refused, timeout)
    elapsed = time.monotonic() - started
    seen = await kafka.read_topic(
        bootstrap, topic, len(placed.kafka), timeout=timeout, run=_name(db_url)
    )
    reports = [
        kafka.report(seen, placed, topic),
        webhooks.report(receiver, placed, f"{id_prefix}{refused}", attempts, id_prefix),
        endpoints.report(receiver, registered, placed, id_prefix),
    ]
    for lines, _ in reports:
        click.echo("\n".join(lines))
    ok = all(fine for _, fine in reports) and done.events == done.events_delivered == placed.total
    click.echo(
        f"all: {done.events_delivered}/{placed.total} committed events delivered in "
        f"{elapsed:.1f} s, none of the rolled-back order's 3 ({'OK' if ok else 'MISMATCH'})"
    )
    return ok


def _settings(db_url: str, bootstrap: str, topic: str, receiver: Receiver) -> Settings:
    return load_settings(
        None,
        # The demo's relay is the demo's alone: the shell's OUTBOX_* variables name that
        # shell's application's database and broker, and would win over what is set here.
        environment=False,
        database_url=db_url,
        # The in-memory demo broker rejects aiokafka's idempotent producer; real deployments
        # keep the default (idempotent, acks=all).
        kafka={"bootstrap_servers": bootstrap, "enable_idempotence": False},
        relay={"poll_interval": 0.5, "shutdown_timeout": 5},
        # No metrics listener: the demo must not take the port of a relay on this host.
        http={"enabled": False},
        destinations={
            KAFKA: kafka.destination(topic),
            WEBHOOK: webhooks.destination(receiver, webhooks.new_secret()),
            ENDPOINTS: endpoints.destination(),
        },
    )


async def _relay(
    settings: Settings, db_url: str, placed: Placed, refused: int, timeout: float
) -> tuple[progress.Progress, int | None]:
    """Run the relay until every event and delivery is delivered (or the timeout); where
    things stand then, and the attempts of the refused event."""
    # The relay's warnings and errors only (a retry is one): the demo says the rest.
    configure("warning", "console")
    relay = Relay(settings)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    deliveries = sum(map(len, placed.endpoints.values()))
    running = asyncio.create_task(relay.run())
    waiting = asyncio.create_task(progress.wait_delivered(conn, placed.total, deliveries, timeout))
    try:
        await asyncio.wait({running, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            await running  # raises what stopped the relay, if anything did
            raise DemoError("the relay stopped before delivering everything; its log says why")
        done = waiting.result()
        tried = await progress.attempts(conn, refused)
    finally:
        # Also when the demo is cancelled (Ctrl-C, SIGTERM): the relay stops as it would.
        waiting.cancel()
        relay.stop()
        await asyncio.wait({running, waiting}, timeout=10)
        await conn.close()
    status = running.result()
    if status != 0:
        raise DemoError(f"the relay stopped with status {status}; its log says why")
    return done, tried


def _next_steps(db_url: str, token: str, console: bool) -> str:
    """Says where the kept database is and how to look at it; returns the command that
    serves the console on it."""
    # The schema named, so that an OUTBOX_SCHEMA or OUTBOX_CONFIG of the shell's application
    # does not send the commands to another schema.
    at = f"--database-url {redact(db_url)} --schema {SCHEMA}"
    again = f"OUTBOX_UI_TOKEN={token} outbox-relay ui {at}"
    click.echo(
        f"kept scratch database {_name(db_url)}: its events, deliveries and endpoints are in\n"
        f"  outbox-relay status {at}\n"
        f"  outbox-relay endpoints list {at}"
    )
    if not console:
        click.echo(f"and in the console: {again}\n  then open http://127.0.0.1:8089/")
    return again


def _name(db_url: str) -> str:
    return urlsplit(db_url).path[1:]
