"""The options the bench commands share (the scratch database's server, the sink, the event
loop, ``--max-seconds``, ``--json``), and ``shown``: an option whose ``--help`` shows its
default, as most of theirs do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from relay.tools.bench.common import SNAPSHOT_APP

Command = Callable[..., Any]
Decorator = Callable[[Command], Command]


def shown(name: str, default: Any, *, type: Any = None, help: str | None = None) -> Decorator:
    """An option whose default ``--help`` shows."""
    return click.option(name, default=default, show_default=True, type=type, help=help)


def hold_snapshot(when: str) -> Decorator:
    """--hold-snapshot: a snapshot held open (``when``: from when to when), as a pg_dump holds
    one."""
    return click.option(
        "--hold-snapshot",
        is_flag=True,
        help=f"Hold a snapshot open (a connection named {SNAPSHOT_APP!r} in a REPEATABLE "
        f"READ transaction, as a pg_dump or a long report holds one) {when}: vacuum can "
        "remove none of the run's dead row versions.",
    )


def window(default: float) -> Decorator:
    """--window: the latency-per-window table's lines."""
    return shown(
        "--window",
        default,
        type=click.FloatRange(0.1, clamp=False),
        help="Seconds of commit time per line of the latency-per-window table.",
    )


def database_url(
    help: str = "Server for the scratch database (created and dropped by the run).",
) -> Decorator:
    return click.option(
        "--database-url",
        envvar="OUTBOX_DATABASE_URL",
        default="postgresql://root@127.0.0.1:5432/postgres",
        show_default=True,
        help=help,
    )


def event_loop(help: str | None = None) -> Decorator:
    return shown("--loop", "auto", type=click.Choice(["auto", "uvloop", "asyncio"]), help=help)


def max_seconds(default: float, help: str) -> Decorator:
    return shown("--max-seconds", default, type=click.FloatRange(1, 600), help=help)


as_json: Decorator = click.option(
    "--json", "as_json", is_flag=True, help="Print JSON instead of tables."
)


def common(func: Any) -> Any:
    options = [
        database_url(),
        shown(
            "--sink",
            "kafka",
            type=click.Choice(["kafka", "webhook", "null"]),
            help="kafka, webhook, or null to measure the database side alone.",
        ),
        click.option("--bootstrap", help="Kafka broker; default: start a local one (Tansu)."),
        click.option(
            "--webhook-url",
            help="Endpoint for --sink webhook; default: start a fast local receiver.",
        ),
        shown("--webhook-concurrency", 64, help="max_concurrency of the webhook destination."),
        click.option(
            "--idempotence/--no-idempotence",
            default=None,
            help="Idempotent producer; default on with --bootstrap, off for the local broker "
            "(whose memory engine rejects it).",
        ),
        event_loop("The event loop, as relay.event_loop: compare the two on one machine."),
        as_json,
    ]
    for option in reversed(options):
        func = option(func)
    return func
