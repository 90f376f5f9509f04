"""What the commands share: the database and schema options, durations and times as
arguments, --json, one clear error for any database problem, and who runs a command. Their
output, text and JSON, is relay/cli/render.py's."""

from __future__ import annotations

import asyncio
import functools
import getpass
import socket
import sys
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg
import click
from click.core import ParameterSource

from outbox import queries
from outbox.dburl import redact, to_asyncpg_dsn, url_secrets
from outbox.errors import describe
from relay.cli.render import echo, echo_lines
from relay.config import ConfigError, schema_from_environment
from relay.config.environment import log_schema_deprecation, schema_deprecation
from relay.db.session import SESSION_SETTINGS
from relay.durations import format_duration, parse_duration, parse_since
from relay.obs import scrub
from relay.ops.common import AdminError

if TYPE_CHECKING:
    from relay.config import Settings

T = TypeVar("T")

DATABASE_URL_HELP = "PostgreSQL URL (postgresql:// or postgresql+asyncpg://)."


def register_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # Known from here on, so that no error message of the command can print its password.
    if value:
        scrub.register(url_secrets(value))
    return value


def database_url_option(func: Any) -> Any:
    return click.option(
        "--database-url",
        envvar="OUTBOX_DATABASE_URL",
        required=True,
        show_envvar=True,
        help=DATABASE_URL_HELP,
        callback=register_url,
    )(func)


def snapshot_warning_option(func: Any) -> Any:
    """--snapshot-warning: past this age the snapshot holding back VACUUM is named (status and
    the console read it as the relay reads relay.snapshot_warning)."""
    from relay.db.snapshots import DEFAULT_WARNING

    return click.option(
        "--snapshot-warning",
        type=Duration(),
        default=DEFAULT_WARNING,
        envvar="OUTBOX_RELAY_SNAPSHOT_WARNING",
        show_envvar=True,
        metavar="DURATION",
        help="Name the snapshot or transaction holding back VACUUM once it is older than this "
        f"(relay.snapshot_warning; default {format_duration(DEFAULT_WARNING)}, 0: never).",
    )(func)


def warn_schema_deprecation() -> None:
    """Say on stderr that OUTBOX_RELAY_SCHEMA is deprecated, if it is set."""
    message = schema_deprecation()
    if message:
        echo(f"outbox-relay: warning: {message}", err=True)


def _schema_from_environment() -> str | None:
    """OUTBOX_SCHEMA or (deprecated, said on stderr) OUTBOX_RELAY_SCHEMA; ConfigError if they
    name different schemas."""
    warn_schema_deprecation()
    token = log_schema_deprecation.set(False)  # said here, on stderr: not as a log event
    try:
        return schema_from_environment()
    finally:
        log_schema_deprecation.reset(token)


def _schema(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        _schema_from_environment()  # the two spellings must agree
        return queries.check_schema(value)
    except (ValueError, ConfigError) as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def schema_option(func: Any) -> Any:
    return click.option(
        "--schema",
        envvar=["OUTBOX_SCHEMA", "OUTBOX_RELAY_SCHEMA"],
        default="public",
        show_default=True,
        show_envvar=True,
        callback=_schema,
        help="Schema that holds the outbox table (any name PostgreSQL takes, up to "
        f"{queries.MAX_SCHEMA_BYTES} bytes).",
    )(func)


# --- --config: the database and schema of the relay's own configuration ---------------------


def _load_config(path: Path, database_url: str | None) -> Settings:
    """The relay's configuration, validated as `run --check` validates it: an invalid one is
    the same message, and exit 2."""
    from relay.settings import load_settings

    # An explicit URL stands in for one the file leaves to the environment.
    overrides: dict[str, Any] = {"database_url": database_url} if database_url else {}
    token = log_schema_deprecation.set(False)  # the command says it on stderr
    try:
        settings = load_settings(path, **overrides)
    except ConfigError as exc:
        echo_lines(f"outbox-relay: {scrub.scrub(str(exc))}", err=True)
        sys.exit(2)
    finally:
        log_schema_deprecation.reset(token)
    scrub.register(url_secrets(settings.database_url.get_secret_value()))
    return settings


def resolve_database(
    ctx: click.Context, config: Path | None, database_url: str | None, schema: str | None
) -> tuple[str, str]:
    """The database URL and schema of a command: each from its option, else its environment
    variable (OUTBOX_DATABASE_URL; OUTBOX_SCHEMA, or the deprecated OUTBOX_RELAY_SCHEMA), else
    the --config file (database_url, relay.schema), else the default (schema ``public``; the
    URL has none)."""
    try:
        from_env = _schema_from_environment()
    except ConfigError as exc:
        raise click.BadParameter(str(exc), ctx, param_hint="'--schema'") from None
    settings = _load_config(config, database_url) if config is not None else None
    if database_url is None and settings is not None:
        database_url = settings.database_url.get_secret_value()
    if database_url is None:
        raise click.UsageError(
            "say which database: --database-url, OUTBOX_DATABASE_URL, or --config relay.toml "
            "(its database_url)",
            ctx,
        )
    if ctx.get_parameter_source("schema") is not ParameterSource.COMMANDLINE:
        schema = from_env
    if schema is None:
        schema = settings.relay.db_schema if settings is not None else "public"
    try:
        return database_url, queries.check_schema(schema)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param_hint="'--schema'") from None


def database_options(func: Callable[..., T]) -> Callable[..., T]:
    """--database-url, --schema and --config for a command that takes ``database_url`` and
    ``schema``: resolved by :func:`resolve_database` before it runs."""

    @functools.wraps(func)
    def command(
        *args: Any, config: Path | None, database_url: str | None, schema: str | None, **kw: Any
    ) -> T:
        ctx = click.get_current_context()
        url, name = resolve_database(ctx, config, database_url, schema)
        return func(*args, database_url=url, schema=name, **kw)

    options = [
        click.option(
            "--database-url",
            envvar="OUTBOX_DATABASE_URL",
            show_envvar=True,
            help=DATABASE_URL_HELP + " Default: database_url of --config.",
            callback=register_url,
        ),
        click.option(
            "--schema",
            envvar="OUTBOX_SCHEMA",
            show_envvar=True,
            help="Schema that holds the outbox table (any name PostgreSQL takes, up to "
            f"{queries.MAX_SCHEMA_BYTES} bytes). Default: relay.schema of --config, else "
            "public.",
        ),
        click.option(
            "--config",
            type=click.Path(dir_okay=False, path_type=Path),
            envvar="OUTBOX_CONFIG",
            show_envvar=True,
            help="The relay's relay.toml: the database and schema to use when neither the "
            "option nor its variable gives them (validated as `run --check` does).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


# `status --fail-if-…` exits with this when its condition holds (1 is an error, 2 bad usage).
EXIT_CONDITION = 3


class Duration(click.ParamType[float]):
    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float):
            return value
        try:
            return parse_duration(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class Since(click.ParamType[datetime]):
    name = "time"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, datetime):
            return value
        try:
            return parse_since(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def json_option(func: Any) -> Any:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON, not text.")(func)


def yes_option(help: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """--yes: the answer to the question a command would ask on a terminal."""
    return click.option("--yes", is_flag=True, help=help)


def with_db(database_url: str, action: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
    """Connect, run ``action``, close; database problems become one clear error."""

    async def go() -> T:
        conn = await asyncpg.connect(
            to_asyncpg_dsn(database_url),
            server_settings={"application_name": "outbox-relay-cli", **SESSION_SETTINGS},
            timeout=10,
        )
        try:
            return await action(conn)
        finally:
            await conn.close()

    try:
        return asyncio.run(go())
    except AdminError as exc:
        raise click.ClickException(str(exc)) from exc
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise click.ClickException(
            f"database error at {redact(database_url)}: {describe(exc)}. Check "
            "--database-url / OUTBOX_DATABASE_URL and that PostgreSQL is running."
        ) from exc
    except ValueError as exc:  # a URL that is not PostgreSQL
        raise click.ClickException(str(exc)) from exc


def default_by() -> str:
    """Who runs a command, for the rows it marks: user@host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"
