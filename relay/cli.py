"""The ``outbox-relay`` command."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import click

from outbox.dburl import redact
from outbox.migrate import migrate as run_migrations

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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
