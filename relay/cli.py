"""The ``outbox-relay`` command."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import click

from outbox.dburl import redact
from outbox.migrate import migrate as run_migrations
from relay.config import ConfigError, Settings, load_settings

DATABASE_URL_HELP = "PostgreSQL URL (postgresql:// or postgresql+asyncpg://)."


def database_url_option(func: Any) -> Any:
    return click.option(
        "--database-url",
        envvar="OUTBOX_DATABASE_URL",
        required=True,
        show_envvar=True,
        help=DATABASE_URL_HELP,
    )(func)


def schema_option(func: Any) -> Any:
    return click.option(
        "--schema",
        envvar="OUTBOX_SCHEMA",
        default="public",
        show_default=True,
        show_envvar=True,
        help="Schema that holds the outbox table.",
    )(func)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="outbox-relay")
def main() -> None:
    """outbox-relay: a transactional outbox for PostgreSQL, relayed to Kafka and webhooks."""


@main.command()
@database_url_option
@schema_option
@click.option("--dry-run", is_flag=True, help="Print the SQL that would run; change nothing.")
def migrate(database_url: str, schema: str, dry_run: bool) -> None:
    """Apply pending schema migrations (safe to run concurrently and repeatedly)."""
    try:
        result = asyncio.run(run_migrations(database_url, schema=schema, dry_run=dry_run))
    except (OSError, ValueError) as exc:
        raise click.ClickException(
            f"cannot migrate {redact(database_url)}: {exc}. Check --database-url / "
            "OUTBOX_DATABASE_URL and that PostgreSQL is running."
        ) from exc
    if not result.applied:
        click.echo(f"schema {schema!r} is up to date (versions {result.already or 'none'})")
        return
    for m in result.applied:
        if dry_run:
            click.echo(f"-- {m.version:04d}_{m.name}.sql (would apply to schema {schema!r})")
            click.echo(m.sql)
        else:
            click.echo(f"applied {m.version:04d}_{m.name} to schema {schema!r}")


def _load(config: Path | None) -> Settings:
    try:
        return load_settings(config)
    except ConfigError as exc:
        click.echo(f"outbox-relay: {exc}", err=True)
        sys.exit(2)


@main.command()
@click.option(
    "--config",
    "config",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="OUTBOX_CONFIG",
    show_envvar=True,
    help="relay.toml; every key can also come from OUTBOX_* environment variables.",
)
@click.option("--check", is_flag=True, help="Validate the configuration and exit.")
def run(config: Path | None, check: bool) -> None:
    """Run the relay until SIGTERM/SIGINT."""
    settings = _load(config)
    if check:
        click.echo(f"configuration OK: {len(settings.destinations)} destination(s)")
        return
    from relay.logging import configure

    configure(settings.log_level, settings.log_format)
    sys.exit(asyncio.run(_run(settings)))


async def _run(settings: Settings) -> int:
    from relay.relay import Relay, RelayStartupError

    relay = Relay(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, relay.stop)
    try:
        return await relay.run()
    except RelayStartupError as exc:
        click.echo(f"outbox-relay: {exc}", err=True)
        return 1


@main.command()
@click.option(
    "--database-url",
    envvar="OUTBOX_DATABASE_URL",
    default="postgresql://root@127.0.0.1:5432/postgres",
    show_default=True,
    show_envvar=True,
    help="Server to create the scratch database on.",
)
@click.option("--bootstrap", help="Use this Kafka broker instead of starting a local one.")
@click.option("--count", default=20, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--keep", is_flag=True, help="Keep the scratch database afterwards.")
@click.option("--topic", default="orders", show_default=True, help="Kafka topic to relay to.")
def demo(database_url: str, bootstrap: str | None, count: int, keep: bool, topic: str) -> None:
    """Relay real events end to end on this machine (scratch database, local broker)."""
    from relay.demo import run_demo
    from relay.localbroker import LocalBrokerError

    try:
        sys.exit(asyncio.run(run_demo(database_url, bootstrap, count, keep, topic)))
    except (OSError, LocalBrokerError) as exc:
        raise click.ClickException(f"demo failed: {exc}") from exc


def _register_bench() -> None:
    from relay.bench.cli import bench

    main.add_command(bench)


_register_bench()

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
