"""What the commands share: the database and schema options, durations and times as
arguments, JSON output, and one clear error for any database problem."""

from __future__ import annotations

import asyncio
import getpass
import json
import socket
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, TypeVar

import asyncpg
import click

from outbox import queries
from outbox.dburl import redact, to_asyncpg_dsn, url_secrets
from outbox.errors import describe
from relay import secrets
from relay.config import ConfigError, schema_from_environment
from relay.durations import format_duration, parse_duration, parse_since
from relay.ops import admin

T = TypeVar("T")

DATABASE_URL_HELP = "PostgreSQL URL (postgresql:// or postgresql+asyncpg://)."


def register_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # Known from here on, so that no error message of the command can print its password.
    if value:
        secrets.register(url_secrets(value))
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


def _schema(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        schema_from_environment()  # the two spellings must agree
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


def with_db(database_url: str, action: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
    """Connect, run ``action``, close; database problems become one clear error."""

    async def go() -> T:
        conn = await asyncpg.connect(
            to_asyncpg_dsn(database_url),
            server_settings={"application_name": "outbox-relay-cli"},
            timeout=10,
        )
        try:
            return await action(conn)
        finally:
            await conn.close()

    try:
        return asyncio.run(go())
    except admin.AdminError as exc:
        raise click.ClickException(str(exc)) from exc
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise click.ClickException(
            f"database error at {redact(database_url)}: {describe(exc)}. Check "
            "--database-url / OUTBOX_DATABASE_URL and that PostgreSQL is running."
        ) from exc
    except ValueError as exc:  # a URL that is not PostgreSQL
        raise click.ClickException(str(exc)) from exc


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def age(seconds: float | None) -> str:
    return "-" if seconds is None else format_duration(seconds)


def default_by() -> str:
    """Who runs a command, for the rows it marks: user@host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"
