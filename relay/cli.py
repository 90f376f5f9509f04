"""The ``outbox-relay`` command."""

from __future__ import annotations

import asyncio
import getpass
import json
import signal
import socket
import sys
import traceback
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import click

from outbox import queries
from outbox.dburl import redact, to_asyncpg_dsn, url_secrets
from outbox.migrate import MigrationError
from outbox.migrate import migrate as run_migrations
from relay import admin, secrets
from relay.config import (
    ConfigError,
    Settings,
    load_settings,
    schema_from_environment,
    settings_secrets,
    unknown_environment,
)
from relay.durations import FORMS, format_duration, parse_duration, parse_since

T = TypeVar("T")

DATABASE_URL_HELP = "PostgreSQL URL (postgresql:// or postgresql+asyncpg://)."


def _register_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
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
        callback=_register_url,
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


class ScrubbingGroup(click.Group):
    """Every command's error output passes through relay.secrets.scrub: a usage or database
    error's message, and the traceback of an error nothing expected. The secrets a command
    registered are forgotten when it ends."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            scrubbed = secrets.scrub(exc.message)
            if scrubbed == exc.message:
                raise
            if isinstance(exc, click.UsageError):
                raise click.UsageError(scrubbed, exc.ctx) from None
            raise click.ClickException(scrubbed) from None
        except (click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            text = "".join(traceback.format_exception(exc))
            click.echo(secrets.scrub(text).rstrip("\n"), err=True)
            ctx.exit(1)
        finally:
            secrets.reset()


@click.group(cls=ScrubbingGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="outbox-relay")
def main() -> None:
    """outbox-relay: a transactional outbox for PostgreSQL, relayed to Kafka and webhooks."""


@main.command()
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
        click.echo(f"outbox-relay: {message}", err=True)

    try:
        result = asyncio.run(
            run_migrations(database_url, schema=schema, dry_run=dry_run, wait=wait, notify=notify)
        )
    except MigrationError as exc:
        raise click.ClickException(str(exc)) from exc
    except (
        OSError,
        ValueError,
        TimeoutError,
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
    ) as exc:
        raise click.ClickException(
            f"cannot migrate {redact(database_url)}: {type(exc).__name__}: {exc}. Check "
            "--database-url / OUTBOX_DATABASE_URL and that PostgreSQL is running."
        ) from exc
    if not result.applied:
        click.echo(f"schema {schema!r} is up to date (versions {result.already or 'none'})")
        return
    for m in result.applied:
        if dry_run:
            click.echo(f"-- {m.version:04d}_{m.name}.sql (would apply to schema {schema!r})")
            click.echo(m.script(schema))
        else:
            click.echo(f"applied {m.version:04d}_{m.name} to schema {schema!r}")


def _load(config: Path | None) -> Settings:
    try:
        settings = load_settings(config)
    except ConfigError as exc:
        click.echo(f"outbox-relay: {secrets.scrub(str(exc))}", err=True)
        sys.exit(2)
    # From here on no log event or error message of this process can print them.
    secrets.register(settings_secrets(settings))
    return settings


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
    unknown = unknown_environment(settings)
    if check:
        for name in unknown:
            click.echo(f"outbox-relay: warning: {name} is not a setting; it is ignored", err=True)
        click.echo(
            f"configuration OK: {len(settings.destinations)} destination(s), "
            f"schema {settings.relay.db_schema!r}"
        )
        return
    from relay.logging import configure

    configure(settings.log_level, settings.log_format)
    if unknown:
        import structlog

        structlog.get_logger("relay").warning(
            "relay.config.unknown_variables",
            variables=unknown,
            action="not settings, so ignored: check their spelling",
        )
    sys.exit(asyncio.run(_run(settings)))


async def _run(settings: Settings) -> int:
    from relay.relay import Relay, RelayStartupError

    relay = Relay(settings)
    loop = asyncio.get_running_loop()
    # SIGHUP too (a closed terminal, a supervisor's reload): a graceful stop, never a crash
    # that leaves held rows to their lease. There is no reload: restart to apply a config.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, relay.stop, sig.name)
    try:
        return await relay.run()
    except RelayStartupError as exc:
        click.echo(f"outbox-relay: {secrets.scrub(str(exc))}", err=True)
        return 1


@main.command()
@click.option(
    "--database-url",
    envvar="OUTBOX_DATABASE_URL",
    default="postgresql://root@127.0.0.1:5432/postgres",
    show_default=True,
    show_envvar=True,
    help="Server to create the scratch database on.",
    callback=_register_url,
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


# --- operations -------------------------------------------------------------------------------

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


def _with_db(database_url: str, action: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
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
            f"database error at {redact(database_url)}: {type(exc).__name__}: {exc}. Check "
            "--database-url / OUTBOX_DATABASE_URL and that PostgreSQL is running."
        ) from exc
    except ValueError as exc:  # a URL that is not PostgreSQL
        raise click.ClickException(str(exc)) from exc


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else format_duration(seconds)


@main.command()
@database_url_option
@schema_option
@json_option
@click.option("--fail-if-failed", is_flag=True, help=f"Exit {EXIT_CONDITION} if any row is failed.")
@click.option(
    "--fail-if-pending-older-than",
    type=Duration(),
    metavar="DURATION",
    help=f"Exit {EXIT_CONDITION} if the oldest pending row is older than this (e.g. 5m).",
)
def status(
    database_url: str,
    schema: str,
    as_json: bool,
    fail_if_failed: bool,
    fail_if_pending_older_than: float | None,
) -> None:
    """Per destination: pending, due now, oldest pending age, in flight, delivered, failed."""
    data = _with_db(database_url, lambda c: admin.status(c, schema))
    dests = data["destinations"]
    problems = []
    if fail_if_failed and data["totals"]["failed"]:
        problems.append(f"{data['totals']['failed']} failed row(s)")
    if fail_if_pending_older_than is not None:
        late = [
            d["destination"]
            for d in dests
            if (d["oldest_pending_age_s"] or 0) > fail_if_pending_older_than
        ]
        if late:
            problems.append(
                f"pending rows older than {format_duration(fail_if_pending_older_than)} "
                f"in {', '.join(late)}"
            )
    data["problems"] = problems
    if as_json:
        _echo_json(data)
    else:
        _print_status(data)
    if problems:
        if not as_json:
            click.echo(f"problem: {'; '.join(problems)}", err=True)
        sys.exit(EXIT_CONDITION)


def _print_relays(relays: list[dict[str, Any]]) -> None:
    if not relays:
        return
    click.echo("\nrelays:")
    for r in relays:
        when = {
            "running": f"seen {_age(r['seen_age_s'])} ago",
            "silent": f"SILENT for {_age(r['seen_age_s'])} (killed, or cut off from the database)",
            "stopped": f"stopped at {(r['stopped_at'] or '')[:19]}",
        }[r["state"]]
        where = f"{r['host']} pid {r['pid']}" if r["host"] else "?"
        serves = ", ".join(r["destinations"]) or "-"
        click.echo(f"  {r['relay_id']}: {r['state']} on {where}, {when}; serves {serves}")


def _print_status(data: dict[str, Any]) -> None:
    dests = data["destinations"]
    if not dests:
        click.echo(f"the outbox in schema {data['schema']!r} is empty")
        _print_relays(data["relays"])
        return
    head = (
        "DESTINATION",
        "PENDING",
        "DUE",
        "OLDEST",
        "RUNNING",
        "DELIVERED",
        "FAILED",
        "SKIPPED",
        "STATE",
    )
    rows = [head]
    for d in dests:
        state = "active"
        if d["paused"]:
            p = d["paused"]
            state = f"PAUSED since {p['since'][:19]}" + (f" by {p['by']}" if p["by"] else "")
            if p["reason"]:
                state += f": {p['reason']}"
        rows.append(
            (
                d["destination"],
                str(d["pending"]),
                str(d["due_now"]),
                _age(d["oldest_pending_age_s"]),
                str(d["running"]),
                str(d["delivered"]),
                str(d["failed"]),
                str(d["skipped"]),
                state,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    for r in rows:
        cells = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=False))
        ]
        click.echo("  ".join([*cells, r[-1]]))
    _print_relays(data["relays"])
    leases = [(d["destination"], x) for d in dests for x in d["in_flight"]]
    if leases:
        click.echo("\nin flight:")
        for name, x in leases:
            left = x["lease_left_s"]
            lease = f"lease {format_duration(left)} left" if left >= 0 else "LEASE EXPIRED"
            click.echo(f"  {name}: {x['rows']} row(s) held by {x['relay']} ({lease})")
    errors = [(d["destination"], e) for d in dests for e in d["failed_errors"]]
    if errors:
        click.echo("\nfailed (retry with `outbox-relay retry --destination NAME`):")
        for name, e in errors:
            err = (e["error"] or "no error recorded").replace("\n", " ")
            click.echo(f"  {name}: {e['rows']} x {err[:160]}")
    blocked = [(d["destination"], b) for d in dests for b in d["blocked_keys"]]
    if blocked:
        click.echo(
            "\nkeys with a failed row ahead of pending rows (they wait where the destination "
            'has ordering = "key" and poison_policy = "block"; unblock with '
            "`outbox-relay retry --id ID` or `outbox-relay skip ID`):"
        )
        for name, b in blocked:
            err = (b["error"] or "").replace("\n", " ")
            click.echo(
                f"  {name}: key {b['key']!r} held by failed row {b['failed_id']}, "
                f"{b['waiting']} row(s) waiting: {err[:120]}"
            )


@main.command()
@database_url_option
@schema_option
@json_option
@click.argument("ids", nargs=-1, type=int, required=True)
@click.option(
    "--preview-bytes",
    type=click.IntRange(0),
    default=512,
    show_default=True,
    help="Payload bytes shown.",
)
def show(
    database_url: str, schema: str, as_json: bool, ids: tuple[int, ...], preview_bytes: int
) -> None:
    """Show outbox rows in full: status, attempts, last error, headers, payload preview."""
    found, missing = _with_db(
        database_url, lambda c: admin.show(c, schema, list(ids), preview_bytes)
    )
    if as_json:
        _echo_json({"rows": found, "missing": missing})
    else:
        for i, row in enumerate(found):
            if i:
                click.echo()
            for k, v in row.items():
                if k == "headers":
                    v = json.dumps(v, ensure_ascii=False)
                click.echo(f"{k + ':':<16} {'-' if v is None else v}")
    if missing:
        raise click.ClickException(
            f"no outbox row with id {', '.join(map(str, missing))} (delivered rows are deleted "
            "after relay.retention)"
        )


@main.command()
@database_url_option
@schema_option
@json_option
@click.option(
    "--destination", "destinations", multiple=True, help="Only this destination (repeatable)."
)
@click.option("--id", "ids", multiple=True, type=int, help="Only this row id (repeatable).")
@click.option(
    "--since",
    type=Since(),
    metavar="TIME",
    help="Only rows created since then: a duration ago (2h, 7d) or an ISO-8601 timestamp.",
)
@click.option(
    "--error-like",
    metavar="PATTERN",
    help="Only rows whose last error matches (case-insensitive; a plain word matches "
    "anywhere, or use SQL LIKE wildcards % and _).",
)
@click.option(
    "--all", "all_failed", is_flag=True, help="Every failed row (when no filter is given)."
)
@click.option("--dry-run", is_flag=True, help="Show what would be retried; change nothing.")
def retry(
    database_url: str,
    schema: str,
    as_json: bool,
    destinations: tuple[str, ...],
    ids: tuple[int, ...],
    since: datetime | None,
    error_like: str | None,
    all_failed: bool,
    dry_run: bool,
) -> None:
    """Move failed rows back to pending, with attempts reset and due now."""
    if not (destinations or ids or since or error_like or all_failed):
        raise click.UsageError(
            "say which failed rows to retry: --destination, --id, --since, --error-like, "
            "or --all for every failed row (add --dry-run to see them first)"
        )
    flt = admin.RetryFilter(
        destinations=list(destinations) or None,
        ids=list(ids) or None,
        since=since,
        error_like=error_like,
    )
    result = _with_db(database_url, lambda c: admin.retry(c, schema, flt, dry_run=dry_run))
    if as_json:
        _echo_json(result)
        return
    verb = "would retry" if dry_run else "retried"
    click.echo(f"{verb} {result['rows']} failed row(s)")
    for name, d in sorted(result["destinations"].items()):
        click.echo(f"  {name}: {d['rows']} (ids {d['first_id']}…{d['last_id']})")


@main.command()
@database_url_option
@schema_option
@json_option
@click.option(
    "--older-than",
    type=Duration(),
    metavar="DURATION",
    help=f"Required: delete rows older than this; {FORMS}.",
)
@click.option("--failed", is_flag=True, help="Delete failed rows too (aged by created_at).")
@click.option(
    "--destination", "destinations", multiple=True, help="Only this destination (repeatable)."
)
@click.option(
    "--batch-size",
    type=click.IntRange(1, 100_000),
    default=1000,
    show_default=True,
    help="Rows per DELETE (each its own transaction).",
)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
def purge(
    database_url: str,
    schema: str,
    as_json: bool,
    older_than: float | None,
    failed: bool,
    destinations: tuple[str, ...],
    batch_size: int,
    dry_run: bool,
) -> None:
    """Delete delivered rows (and with --failed, failed rows) older than --older-than."""
    if older_than is None:
        raise click.UsageError(
            "purge needs --older-than, e.g. --older-than 7d: delivered rows older than that are "
            "deleted (add --failed for failed rows, --dry-run to count first)"
        )
    result = _with_db(
        database_url,
        lambda c: admin.purge(
            c,
            schema,
            older_than=older_than,
            failed=failed,
            destinations=list(destinations) or None,
            batch_size=batch_size,
            dry_run=dry_run,
        ),
    )
    if as_json:
        _echo_json(result)
        return
    if dry_run:
        click.echo(f"would delete {result['rows']} row(s) older than {format_duration(older_than)}")
        for name, per in sorted(result["destinations"].items()):
            click.echo(f"  {name}: " + ", ".join(f"{n} {s}" for s, n in sorted(per.items())))
        return
    d = result["deleted"]
    what = f"{d['delivered']} delivered, {d['skipped']} skipped" + (
        f" and {d['failed']} failed" if failed else ""
    )
    click.echo(
        f"deleted {what} row(s) older than {format_duration(older_than)} "
        f"in {result['batches']} batch(es)"
    )


def _default_by() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


@main.command()
@database_url_option
@schema_option
@json_option
@click.argument("destination")
@click.option("--reason", help="Why; shown by `status`.")
@click.option("--by", help="Who (default: user@host).")
def pause(
    database_url: str,
    schema: str,
    as_json: bool,
    destination: str,
    reason: str | None,
    by: str | None,
) -> None:
    """Stop every relay from claiming DESTINATION (its rows wait as pending)."""
    if not destination.strip():
        raise click.UsageError("DESTINATION must be a non-empty name")
    result = _with_db(
        database_url, lambda c: admin.pause(c, schema, destination, by or _default_by(), reason)
    )
    if as_json:
        _echo_json(result)
    elif result["already_paused"]:
        click.echo(f"{destination} was already paused (since {result['since']})")
    else:
        click.echo(
            f"paused {destination}: relays stop claiming it within one poll interval; "
            f"in-flight rows finish. Undo with `outbox-relay resume {destination}`."
        )


@main.command()
@database_url_option
@schema_option
@json_option
@click.argument("destination")
def resume(database_url: str, schema: str, as_json: bool, destination: str) -> None:
    """Let relays claim DESTINATION again."""
    result = _with_db(database_url, lambda c: admin.resume(c, schema, destination))
    if as_json:
        _echo_json(result)
    elif result["was_paused"]:
        click.echo(f"resumed {destination}: relays claim it again within one poll interval")
    else:
        click.echo(f"{destination} was not paused; nothing to do")


@main.command()
@database_url_option
@schema_option
@json_option
@click.argument("ids", nargs=-1, type=int, required=True)
@click.option("--by", help="Who skips (recorded in last_error); default user@host.")
@click.option("--dry-run", is_flag=True, help="Check the rows; change nothing.")
def skip(
    database_url: str,
    schema: str,
    as_json: bool,
    ids: tuple[int, ...],
    by: str | None,
    dry_run: bool,
) -> None:
    """Give up on failed rows: mark them skipped (never delivered); a key they block moves on."""
    result = _with_db(
        database_url,
        lambda c: admin.skip(c, schema, list(ids), by or _default_by(), dry_run=dry_run),
    )
    if as_json:
        _echo_json(result)
        return
    verb = "would skip" if dry_run else "skipped"
    click.echo(f"{verb} {result['rows']} row(s): {', '.join(map(str, result['ids']))}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
