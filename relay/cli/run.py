"""``migrate`` and ``run``: the schema, and the relay itself."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import click

from outbox.dburl import redact
from outbox.errors import describe
from outbox.migrate import UNREACHABLE, MigrationError
from outbox.migrate import migrate as run_migrations
from relay.cli.options import database_url_option, schema_option
from relay.cli.render import echo, echo_exact, echo_lines
from relay.config import ConfigError, Settings, named_variables, unknown_environment
from relay.obs import scrub
from relay.settings import load_settings, settings_secrets, top_level_keys


@click.command(short_help="Apply pending schema migrations.")
@database_url_option
@schema_option
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the SQL that would run (psql can run it as it is); change nothing.",
)
@click.option(
    "--wait",
    type=click.FloatRange(0),
    default=600.0,
    show_default=True,
    metavar="SECONDS",
    help="How long to wait, in all, for another migrate and for the table's locks.",
)
def migrate(database_url: str, schema: str, dry_run: bool, wait: float) -> None:
    """Apply pending schema migrations (safe to run concurrently and repeatedly)."""

    def notify(message: str) -> None:
        echo(f"outbox-relay: {message}", err=True)

    try:
        result = asyncio.run(
            run_migrations(database_url, schema=schema, dry_run=dry_run, wait=wait, notify=notify)
        )
    except MigrationError as exc:
        raise click.ClickException(str(exc)) from exc
    except UNREACHABLE as exc:
        raise click.ClickException(
            f"cannot migrate {redact(database_url)}: {describe(exc)}. Check "
            "--database-url / OUTBOX_DATABASE_URL and that PostgreSQL is running."
        ) from exc
    if not result.applied:
        echo(f"schema {schema!r} is up to date (versions {result.already or 'none'})")
        return
    for m in result.applied:
        if dry_run:
            echo(f"-- {m.version:04d}_{m.name}.sql (would apply to schema {schema!r})")
            echo_exact(m.script(schema))  # for psql: the schema's name as it is
        else:
            echo(f"applied {m.version:04d}_{m.name} to schema {schema!r}")


def _load(config: Path | None) -> Settings:
    try:
        settings = load_settings(config)
    except ConfigError as exc:
        echo_lines(f"outbox-relay: {scrub.scrub(str(exc))}", err=True)
        sys.exit(2)
    # From here on no log event or error message of this process can print them.
    scrub.register(settings_secrets(settings))
    return settings


@click.command(short_help="Run the relay until SIGTERM/SIGINT.")
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
    _check_sink_environment(settings)
    unknown = unknown_environment(top_level_keys(), named_variables(settings))
    if check:
        for name in unknown:
            echo(f"outbox-relay: warning: {name} is not a setting; it is ignored", err=True)
        _check_catalog(settings)
        echo(
            f"configuration OK: {len(settings.destinations)} destination(s), "
            f"schema {settings.relay.db_schema!r}"
        )
        return
    from relay.obs.logs import configure

    configure(settings.log_level, settings.log_format)
    if unknown:
        import structlog

        structlog.get_logger("relay").warning(
            "relay.config.unknown_variables",
            variables=unknown,
            action="not settings, so ignored: check their spelling",
        )
    from relay.runtime import loop

    try:
        status = loop.run(_run(settings), settings.relay.event_loop)
    except loop.LoopUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(status)


def _check_sink_environment(settings: Settings) -> None:
    """What each configured kind of sink checks beyond its settings (see SinkKind.check): the
    endpoints sink's secrets key, shared with the applications. A bad one stops `run --check`
    and `run` as a bad setting does, with what to set."""
    from outbox.errors import OutboxError
    from relay.sinks.registry import KINDS

    used = {d.kind for d in settings.destinations.values()}
    for kind in KINDS.values():
        if kind.name not in used:
            continue
        try:
            kind.check()
        except OutboxError as exc:
            echo(f"outbox-relay: {scrub.scrub(str(exc))}", err=True)
            sys.exit(2)


def _check_catalog(settings: Settings) -> None:
    """``[catalog] source`` loads (exit 2 naming why, else the relay's console and portal would
    start without it), and what ``catalog check`` says of it, as warnings."""
    if settings.catalog.source is None:
        return
    from outbox.catalog import load_catalog
    from relay.catalog.checks import problems

    try:
        exported = load_catalog(settings.catalog.source).export()
    except Exception as exc:  # the application's module may raise anything
        echo(
            f"outbox-relay: catalog.source {settings.catalog.source!r} does not load: "
            f"{type(exc).__name__}: {scrub.scrub(str(exc))}",
            err=True,
        )
        sys.exit(2)
    for _, text in problems(exported, settings):
        echo(f"outbox-relay: warning: catalog: {text}", err=True)


async def _run(settings: Settings) -> int:
    from relay.app import Relay, RelayStartupError

    relay = Relay(settings)
    loop = asyncio.get_running_loop()
    # SIGHUP too (a closed terminal, a supervisor's reload): a graceful stop, never a crash
    # that leaves held rows to their lease. There is no reload: restart to apply a config.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, relay.stop, sig.name)
    try:
        return await relay.run()
    except RelayStartupError as exc:
        echo_lines(f"outbox-relay: {scrub.scrub(str(exc))}", err=True)
        return 1
