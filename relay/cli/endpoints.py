"""``outbox-relay endpoints``: the webhook endpoints registered at runtime for destinations of
kind ``endpoints`` (see :mod:`outbox.endpoints`). Each change is one transaction (``reencrypt``:
one per batch); each command prints its result as text or ``--json``; a signing secret is
printed only by ``add``, ``rotate-secret`` and ``show --show-secret``.

SQLAlchemy and outbox.endpoints are imported when a command runs, not when ``--help`` lists
it, so that the operations commands keep starting fast (tests/test_imports.py).
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg
import click

from outbox.dburl import redact, to_sqlalchemy_async_url
from outbox.errors import OutboxError, describe
from outbox.queries import render_endpoints
from relay.cli import terminal
from relay.cli.options import database_options, json_option
from relay.cli.render import (
    BAD,
    GOOD,
    Tint,
    age,
    confirm,
    echo,
    echo_json,
    print_fields,
    print_table,
    printable,
)
from relay.db.session import SESSION_SETTINGS
from relay.obs import scrub
from relay.ops import queries

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

    from outbox.endpoints import Endpoint, Endpoints, Reencrypted

T = TypeVar("T")
Action = Callable[["Endpoints", "AsyncConnection"], Awaitable[T]]

# The columns' own limits: a larger number is a usage error, not a database error.
ENDPOINT_ID = click.IntRange(1, 2**63 - 1)
RATE_LIMIT = click.IntRange(1, 2**31 - 1)
RECENT_ATTEMPTS = 10
# Longer is no longer a rotation; and timedelta and PostgreSQL intervals have limits.
MAX_KEEP_PREVIOUS_HOURS = 24 * 366
DELIVERY_STATUSES = ("pending", "running", "delivered", "failed", "cancelled")
MAX_SECRET_FILE = 1024  # bytes: a whsec_ secret is 50; more is the wrong file
REENCRYPT_BATCH = 500

UNENCRYPTED = (
    "outbox-relay: warning: the secret is stored unencrypted, as OUTBOX_ENDPOINT_SECRET_KEY is "
    "not set here (set it as the relays have it to store secrets encrypted, then run "
    "`outbox-relay endpoints reencrypt`)"
)
ARGV_WARNING = (
    "outbox-relay: warning: --secret is visible to other users of this machine while the "
    "command runs (ps, /proc); pass it with --secret-file PATH, or --secret-file - to read it "
    "from standard input"
)


def run(database_url: str, schema: str, action: Action[T]) -> T:
    """Run ``action`` in one transaction of its own; errors become one clear message, worded
    as the other operations commands word them."""
    return _guarded(database_url, schema, lambda e: _transaction(database_url, e, action))


def _guarded(
    database_url: str, schema: str, work: Callable[[Endpoints], Coroutine[Any, Any, T]]
) -> T:
    """``work`` on the schema's endpoints; a secret it stored unencrypted is said on stderr
    once it is committed, as the command's last line (rather than as the library's log
    event)."""
    from sqlalchemy.exc import DBAPIError

    from outbox.endpoints import Endpoints

    unencrypted: list[int] = []

    class CommandEndpoints(Endpoints):
        def _unencrypted(self, ep: Endpoint) -> None:
            unencrypted.append(ep.id)

    try:
        result = asyncio.run(work(CommandEndpoints(schema)))
    except OutboxError as exc:  # EndpointNotFound, OutboxValidationError, a secret key problem
        raise click.ClickException(str(exc)) from exc
    except DBAPIError as exc:
        # SQLAlchemy's wording adds the SQL; the driver's own error is what the others show.
        orig = exc.orig or exc
        raise _database_error(database_url, schema, orig.__cause__ or orig) from exc
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise _database_error(database_url, schema, exc) from exc
    except ValueError as exc:  # a URL that is not PostgreSQL
        raise click.ClickException(str(exc)) from exc
    if unencrypted:
        # Last, after what the command prints, where it is seen.
        click.get_current_context().call_on_close(lambda: echo(UNENCRYPTED, err=True))
    return result


def _engine(database_url: str) -> AsyncEngine:
    from sqlalchemy.ext.asyncio import create_async_engine
    from sqlalchemy.pool import NullPool

    return create_async_engine(
        to_sqlalchemy_async_url(database_url),
        poolclass=NullPool,
        hide_parameters=True,  # a secret is a parameter, and errors quote parameters
        connect_args={
            "timeout": 10,
            "server_settings": {"application_name": "outbox-relay-cli", **SESSION_SETTINGS},
        },
    )


async def _transaction(database_url: str, endpoints: Endpoints, action: Action[T]) -> T:
    engine = _engine(database_url)
    try:
        async with engine.begin() as conn:
            return await action(endpoints, conn)
    finally:
        await engine.dispose()


def _database_error(database_url: str, schema: str, exc: BaseException) -> click.ClickException:
    if isinstance(exc, asyncpg.UndefinedTableError):
        return click.ClickException(
            f"the endpoint tables are missing from schema {schema!r} ({exc}): run "
            "`outbox-relay migrate` (with the same --database-url and --schema)"
        )
    return click.ClickException(
        f"database error at {redact(database_url)}: {describe(exc)}. Check "
        "--database-url / OUTBOX_DATABASE_URL and that PostgreSQL is running."
    )


async def _activity(conn: AsyncConnection, schema: str, endpoint_id: int) -> dict[str, Any]:
    """The endpoint's deliveries by status, its last outcome, and its newest attempts."""
    from sqlalchemy import text

    def sql(statement: str) -> Any:
        return text(render_endpoints(statement, schema))

    binds = {"id": endpoint_id, "limit": RECENT_ATTEMPTS}
    d = (await conn.execute(sql(queries.ENDPOINT_DELIVERIES), binds)).one()._mapping
    attempts = (await conn.execute(sql(queries.ENDPOINT_RECENT_ATTEMPTS), binds)).all()
    oldest = d["oldest_pending_age"]
    return {
        "deliveries": {
            **{s: d[s] for s in DELIVERY_STATUSES},
            "oldest_pending_age_s": round(oldest, 3) if oldest is not None else None,
            "last_status": d["last_status"],
            "last_error": d["last_error"],
        },
        "recent_attempts": [
            {
                "at": a.at.isoformat(),
                "event_id": a.event_id,
                "http_status": a.http_status,
                "duration_ms": round(a.duration_ms, 1) if a.duration_ms is not None else None,
                "error": a.error,
            }
            for a in attempts
        ],
    }


# --- options ----------------------------------------------------------------------------------


def _register_secret(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # Known from here on, so that no error message of the command can print it.
    if value:
        scrub.register([value])
    return value


def _read_secret_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The secret in the file (``-``: standard input), without the line break that ends it;
    known from here on as --secret's is."""
    if value is None:
        return None
    try:
        text: str
        if value == "-":
            text = sys.stdin.read(MAX_SECRET_FILE + 1)
        else:
            with open(value, encoding="utf-8") as f:
                text = f.read(MAX_SECRET_FILE + 1)
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise click.BadParameter(f"cannot read {value}: {reason}", ctx, param) from None
    secret = text.strip()
    if secret:
        scrub.register([secret])
    if len(text) > MAX_SECRET_FILE:
        raise click.BadParameter(
            f"{value} holds more than {MAX_SECRET_FILE} bytes: give a file that holds the "
            "whsec_… secret alone",
            ctx,
            param,
        )
    if not secret:
        raise click.BadParameter(f"{value} is empty: it must hold the whsec_… secret", ctx, param)
    return secret


def secret_file_option(func: Any) -> Any:
    return click.option(
        "--secret-file",
        metavar="PATH",
        callback=_read_secret_file,
        help="Sign with the secret (Standard Webhooks format) in this file; - reads it from "
        "standard input. Unlike --secret, it is not shown to other users by ps.",
    )(func)


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not math.isfinite(value):
        raise click.BadParameter("must be a number of hours", ctx, param)
    return value


def url_check_options(func: Any) -> Any:
    func = click.option(
        "--no-dns-check",
        is_flag=True,
        help="Do not resolve the URL's host now (the relay still checks it at every delivery).",
    )(func)
    return click.option(
        "--allow-private-networks",
        is_flag=True,
        help="Accept a host on a private or loopback network (for destinations that set "
        "allow_private_networks = true).",
    )(func)


# --- text output ------------------------------------------------------------------------------


def _audience(ep: Endpoint) -> tuple[str, str]:
    """Whose events and which types it receives; '*' is every one."""
    return ep.tenant or "*", ",".join(ep.event_types) or "*"


def _state(ep: Endpoint) -> str:
    if ep.enabled:
        return Tint("enabled", GOOD)
    return Tint("disabled" + (f": {ep.disabled_reason}" if ep.disabled_reason else ""), BAD)


def _print_fields(fields: dict[str, Any]) -> None:
    print_fields({k: _text(v) for k, v in fields.items()}, 22)


def _text(value: Any) -> str:
    if isinstance(value, Tint):
        return value
    if isinstance(value, datetime):
        return value.isoformat()
    return "-" if value is None or value == "" else str(value)


def _print_endpoint(ep: Endpoint) -> None:
    tenant, types = _audience(ep)
    _print_fields(
        {
            "id": ep.id,
            "destination": ep.destination,
            "url": ep.url,
            "tenant": tenant if ep.tenant else "* (every tenant)",
            "event_types": types if ep.event_types else "* (every type)",
            "rate_limit": f"{ep.rate_limit}/s" if ep.rate_limit else "none",
            "description": ep.description,
            "state": _state(ep),
            "disabled_at": ep.disabled_at,
            "failing_since": ep.failing_since,
            "last_success_at": ep.last_success_at,
            "created_at": ep.created_at,
            "updated_at": ep.updated_at,
            "previous_secret_until": ep.previous_secret_until,
        }
    )
    if ep.secret is not None:
        _print_fields({"secret": ep.secret})


def _print_activity(activity: dict[str, Any]) -> None:
    d = activity["deliveries"]
    oldest = f" (oldest {age(d['oldest_pending_age_s'])})" if d["pending"] else ""
    counts = ", ".join(f"{d[s]} {s}" for s in DELIVERY_STATUSES)
    _print_fields(
        {
            "deliveries": counts.replace(" pending", f" pending{oldest}", 1),
            "last_status": d["last_status"],
            "last_error": printable(d["last_error"] or "", 300),
        }
    )
    attempts = activity["recent_attempts"]
    if not attempts:
        echo()
        echo("no attempts yet")
        return
    echo()
    echo(f"latest {len(attempts)} attempt(s), newest first:")
    rows = [("AT", "EVENT", "HTTP", "MS", "ERROR")]
    for a in attempts:
        ms = a["duration_ms"]
        rows.append(
            (
                a["at"][:19],
                str(a["event_id"]),
                str(a["http_status"] or "-"),
                "-" if ms is None else f"{ms:.0f}",
                printable(a["error"] or "-", 160),
            )
        )
    print_table(rows)


# --- commands ---------------------------------------------------------------------------------


@click.group(short_help="Manage webhook endpoints registered at runtime.")
def endpoints() -> None:
    """Webhook endpoints registered at runtime.

    The receivers of destinations of kind `endpoints`: add, list, show, update, disable,
    enable, rotate-secret, delete; reencrypt moves their secrets under a new key. Relays see
    each change at their next claim."""


@endpoints.command(short_help="Register an endpoint; prints its secret.")
@database_options
@json_option
@click.argument("destination")
@click.argument("url")
@click.option("--tenant", help="Only this tenant's events (default: every tenant's).")
@click.option(
    "--event-type",
    "event_types",
    multiple=True,
    metavar="TYPE",
    help="Only events of this type (repeatable; default: every type).",
)
@click.option("--rate-limit", type=RATE_LIMIT, metavar="N", help="At most N requests a second.")
@click.option("--description", default="", help="A note for people: whose receiver it is.")
@click.option(
    "--secret",
    metavar="whsec_…",
    callback=_register_secret,
    help="Sign with this secret (Standard Webhooks format) instead of a generated one; "
    "visible to other users while the command runs: prefer --secret-file.",
)
@secret_file_option
@url_check_options
def add(
    database_url: str,
    schema: str,
    as_json: bool,
    destination: str,
    url: str,
    tenant: str | None,
    event_types: tuple[str, ...],
    rate_limit: int | None,
    description: str,
    secret: str | None,
    secret_file: str | None,
    allow_private_networks: bool,
    no_dns_check: bool,
) -> None:
    """Register an endpoint; prints its secret.

    URL becomes an endpoint of DESTINATION (a destination of kind `endpoints`); the signing
    secret printed is shown again only by `show --show-secret`."""
    if secret is not None and secret_file is not None:
        raise click.UsageError("--secret and --secret-file contradict each other: give one")
    if secret is not None:
        echo(ARGV_WARNING, err=True)
    secret = secret if secret is not None else secret_file
    ep = run(
        database_url,
        schema,
        lambda e, c: e.create(
            c,
            destination=destination,
            url=url,
            tenant=tenant,
            event_types=event_types,
            rate_limit=rate_limit,
            description=description,
            secret=secret,
            allow_private_networks=allow_private_networks,
            check_dns=not no_dns_check,
        ),
    )
    if as_json:
        echo_json(ep.as_dict())
        return
    tenant_shown, types = _audience(ep)
    echo(
        f"added endpoint {ep.id} to {ep.destination}: {ep.url} (tenant {tenant_shown}, "
        f"event types {types})"
    )
    if secret is None:
        echo(f"secret: {ep.secret}")
        echo(
            "give it to the receiver now to verify signatures; it is not shown again unless "
            f"asked for: `outbox-relay endpoints show {ep.id} --show-secret`"
        )


@endpoints.command("list", short_help="List the endpoints (never their secrets).")
@database_options
@json_option
@click.option("--destination", help="Only this destination's endpoints.")
@click.option("--tenant", help="Only endpoints of this tenant (not those taking every tenant).")
def list_(
    database_url: str,
    schema: str,
    as_json: bool,
    destination: str | None,
    tenant: str | None,
) -> None:
    """List the endpoints (never their secrets)."""
    found = run(
        database_url, schema, lambda e, c: e.list(c, destination=destination, tenant=tenant)
    )
    if as_json:
        echo_json({"endpoints": [ep.as_dict() for ep in found]})
        return
    if not found:
        echo(
            "no endpoints" + (" match" if destination or tenant else "") + " (add one with "
            "`outbox-relay endpoints add DESTINATION URL`)"
        )
        return
    rows = [("ID", "DESTINATION", "URL", "TENANT", "EVENT TYPES", "RATE LIMIT", "STATE")]
    for ep in found:
        rate = f"{ep.rate_limit}/s" if ep.rate_limit else "-"
        rows.append((str(ep.id), ep.destination, ep.url, *_audience(ep), rate, _state(ep)))
    print_table(rows)


@endpoints.command(short_help="Show an endpoint, its deliveries, its attempts.")
@database_options
@json_option
@click.argument("endpoint_id", metavar="ID", type=ENDPOINT_ID)
@click.option("--show-secret", is_flag=True, help="Print its signing secret too.")
def show(
    database_url: str, schema: str, as_json: bool, endpoint_id: int, show_secret: bool
) -> None:
    """Show an endpoint, its deliveries and attempts.

    Endpoint ID's settings and health, its deliveries by status with the last outcome, and
    its latest attempts."""

    async def read(e: Endpoints, c: AsyncConnection) -> tuple[Endpoint, dict[str, Any]]:
        ep = await e.get(c, endpoint_id, show_secret=show_secret)
        return ep, await _activity(c, schema, endpoint_id)

    ep, activity = run(database_url, schema, read)
    if as_json:
        echo_json({**ep.as_dict(), **activity})
        return
    _print_endpoint(ep)
    echo()
    _print_activity(activity)


def _changes(
    url: str | None,
    tenant: str | None,
    all_tenants: bool,
    event_types: tuple[str, ...],
    all_event_types: bool,
    rate_limit: int | None,
    no_rate_limit: bool,
    description: str | None,
) -> dict[str, Any]:
    """The keywords of Endpoints.update for what the options ask to change."""
    for a, b, given in (
        ("--tenant", "--all-tenants", tenant is not None and all_tenants),
        ("--event-type", "--all-event-types", bool(event_types) and all_event_types),
        ("--rate-limit", "--no-rate-limit", rate_limit is not None and no_rate_limit),
    ):
        if given:
            raise click.UsageError(f"{a} and {b} contradict each other: give one")
    changes: dict[str, Any] = {}
    if url is not None:
        changes["url"] = url
    if tenant is not None or all_tenants:
        changes["tenant"] = tenant  # None: every tenant
    if event_types or all_event_types:
        changes["event_types"] = list(event_types)  # empty: every type
    if rate_limit is not None or no_rate_limit:
        changes["rate_limit"] = rate_limit  # None: no limit
    if description is not None:
        changes["description"] = description
    if not changes:
        raise click.UsageError(
            "nothing to change: give --url, --tenant/--all-tenants, --event-type/"
            "--all-event-types, --rate-limit/--no-rate-limit or --description"
        )
    return changes


@endpoints.command(short_help="Change an endpoint's settings.")
@database_options
@json_option
@click.argument("endpoint_id", metavar="ID", type=ENDPOINT_ID)
@click.option("--url", help="Send to this URL from now on.")
@click.option("--tenant", help="Only this tenant's events.")
@click.option("--all-tenants", is_flag=True, help="Every tenant's events.")
@click.option(
    "--event-type",
    "event_types",
    multiple=True,
    metavar="TYPE",
    help="Only events of these types (repeatable; replaces the list).",
)
@click.option("--all-event-types", is_flag=True, help="Events of every type.")
@click.option("--rate-limit", type=RATE_LIMIT, metavar="N", help="At most N requests a second.")
@click.option("--no-rate-limit", is_flag=True, help="No rate limit.")
@click.option("--description", help="A note for people (empty to clear it).")
@url_check_options
def update(
    database_url: str,
    schema: str,
    as_json: bool,
    endpoint_id: int,
    allow_private_networks: bool,
    no_dns_check: bool,
    **options: Any,
) -> None:
    """Change an endpoint's settings.

    Only what is given changes in endpoint ID; the rest stays as it is."""
    changes = _changes(**options)
    ep = run(
        database_url,
        schema,
        lambda e, c: e.update(
            c,
            endpoint_id,
            **changes,
            allow_private_networks=allow_private_networks,
            check_dns=not no_dns_check,
        ),
    )
    if as_json:
        echo_json(ep.as_dict())
        return
    echo(f"updated endpoint {ep.id} ({', '.join(changes)})")
    _print_endpoint(ep)


@endpoints.command(short_help="Stop sending to an endpoint.")
@database_options
@json_option
@click.argument("endpoint_id", metavar="ID", type=ENDPOINT_ID)
@click.option("--reason", help="Why; shown by `endpoints list` and `endpoints show`.")
def disable(
    database_url: str, schema: str, as_json: bool, endpoint_id: int, reason: str | None
) -> None:
    """Stop sending to an endpoint.

    Endpoint ID gets no requests until it is enabled again."""
    ep = run(database_url, schema, lambda e, c: e.disable(c, endpoint_id, reason=reason))
    if as_json:
        echo_json(ep.as_dict())
        return
    echo(
        f"disabled endpoint {ep.id} ({ep.url}). Undo with `outbox-relay endpoints enable {ep.id}`."
    )


@endpoints.command(short_help="Send to a disabled endpoint again.")
@database_options
@json_option
@click.argument("endpoint_id", metavar="ID", type=ENDPOINT_ID)
def enable(database_url: str, schema: str, as_json: bool, endpoint_id: int) -> None:
    """Send to a disabled endpoint again.

    Endpoint ID's health starts afresh: failures before it was disabled do not count."""
    ep = run(database_url, schema, lambda e, c: e.enable(c, endpoint_id))
    if as_json:
        echo_json(ep.as_dict())
        return
    echo(f"enabled endpoint {ep.id} ({ep.url})")


@endpoints.command("rotate-secret", short_help="Give an endpoint a new secret; prints it.")
@database_options
@json_option
@click.argument("endpoint_id", metavar="ID", type=ENDPOINT_ID)
@click.option(
    "--keep-previous-hours",
    type=click.FloatRange(0, MAX_KEEP_PREVIOUS_HOURS),
    default=24.0,
    show_default=True,
    metavar="H",
    callback=_finite,
    help="How long the previous secret still signs too, so the receiver can switch.",
)
@secret_file_option
def rotate_secret(
    database_url: str,
    schema: str,
    as_json: bool,
    endpoint_id: int,
    keep_previous_hours: float,
    secret_file: str | None,
) -> None:
    """Give an endpoint a new secret; prints it.

    The previous secret signs too for --keep-previous-hours, while the receiver switches."""
    keep = timedelta(hours=keep_previous_hours)
    ep = run(
        database_url,
        schema,
        lambda e, c: e.rotate_secret(c, endpoint_id, keep_previous=keep, secret=secret_file),
    )
    if as_json:
        echo_json(ep.as_dict())
        return
    if secret_file is None:
        echo(f"new secret of endpoint {ep.id}: {ep.secret}")
    else:
        echo(f"endpoint {ep.id} now signs with the secret of --secret-file")
    until = ep.previous_secret_until
    echo(
        f"the previous secret stays valid until {until:%Y-%m-%d %H:%M:%S %Z}"
        if until and keep
        else "the previous secret no longer signs"
    )


def _confirm_delete(database_url: str, schema: str, endpoint_id: int) -> None:
    if not terminal.stdin():
        raise click.UsageError(
            f"deleting endpoint {endpoint_id} cancels its unfinished deliveries and there is "
            "no terminal to confirm on: pass --yes to delete it"
        )

    async def read(e: Endpoints, c: AsyncConnection) -> tuple[Endpoint, dict[str, Any]]:
        return await e.get(c, endpoint_id), await _activity(c, schema, endpoint_id)

    # A transaction of its own: none stays open while someone reads the question.
    ep, activity = run(database_url, schema, read)
    unfinished = activity["deliveries"]["pending"] + activity["deliveries"]["running"]
    confirm(
        f"delete endpoint {ep.id} of {ep.destination} ({ep.url}) and cancel its {unfinished} "
        "unfinished deliveries?"
    )


@endpoints.command(short_help="Delete an endpoint, cancelling its deliveries.")
@database_options
@json_option
@click.argument("endpoint_id", metavar="ID", type=ENDPOINT_ID)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def delete(database_url: str, schema: str, as_json: bool, endpoint_id: int, yes: bool) -> None:
    """Delete an endpoint, cancelling its deliveries.

    Endpoint ID's unfinished deliveries end as cancelled (never sent). Asks first, unless
    --yes."""
    if not yes:
        _confirm_delete(database_url, schema, endpoint_id)
    cancelled = run(database_url, schema, lambda e, c: e.delete(c, endpoint_id))
    if as_json:
        echo_json({"id": endpoint_id, "deleted": True, "cancelled": cancelled})
        return
    echo(f"deleted endpoint {endpoint_id}; cancelled {cancelled} unfinished deliveries")


@endpoints.command(short_help="Re-encrypt every secret under the first key.")
@database_options
@json_option
@click.option(
    "--batch-size",
    type=click.IntRange(1, 10_000),
    default=REENCRYPT_BATCH,
    show_default=True,
    metavar="N",
    help="Endpoints per transaction.",
)
def reencrypt(database_url: str, schema: str, as_json: bool, batch_size: int) -> None:
    """Re-encrypt every secret under the first key.

    With OUTBOX_ENDPOINT_SECRET_KEY=new,old, every endpoint's secret and previous secret are
    rewritten under the new key (those stored unencrypted are encrypted), a batch per
    transaction; previous secrets past their window are cleared. Running it again is safe.
    An endpoint whose secret opens with none of the keys is left as it is, and named."""
    passes = _guarded(database_url, schema, lambda e: _reencrypt_all(database_url, e, batch_size))
    done = [b for p in passes for b in p]
    # Each change is made once (then it is under the first key), so they add up over passes;
    # the endpoints are those the last pass read.
    total = {
        "endpoints": sum(b.endpoints for b in passes[-1]),
        "encrypted": sum(b.encrypted for b in done),
        "rewritten": sum(b.rewritten for b in done),
        "expired_cleared": sum(b.expired for b in done),
    }
    unreadable = list(dict.fromkeys(i for b in passes[-1] for i in b.unreadable))
    if as_json:
        echo_json({**total, "unreadable": unreadable})
    elif total["encrypted"] or total["rewritten"] or total["expired_cleared"]:
        echo(
            f"{total['endpoints']} endpoint(s): {total['encrypted']} unencrypted secret(s) "
            f"encrypted and {total['rewritten']} moved from an older key to the first key of "
            f"OUTBOX_ENDPOINT_SECRET_KEY; {total['expired_cleared']} expired previous "
            "secret(s) cleared"
        )
    else:
        echo(
            f"{total['endpoints']} endpoint(s): nothing to change, every secret is under the "
            "first key of OUTBOX_ENDPOINT_SECRET_KEY" + (" (but those below)" if unreadable else "")
        )
    if unreadable:
        ids = ", ".join(map(str, unreadable))
        raise click.ClickException(
            f"the secrets of endpoint(s) {ids} open with none of the keys in "
            "OUTBOX_ENDPOINT_SECRET_KEY and were left as they are: add the key they were "
            "encrypted with (after the new one) and run `outbox-relay endpoints reencrypt` again"
        )


async def _reencrypt_all(
    database_url: str, endpoints: Endpoints, batch_size: int
) -> list[list[Reencrypted]]:
    """Passes over the endpoints, each batch in a transaction of its own, on one connection.
    A second pass only if the first encrypted secrets that were unencrypted: until its first
    batch committed, a writer without the key could still add one, and it may have done so
    behind the pass."""
    engine = _engine(database_url)
    passes: list[list[Reencrypted]] = []
    try:
        while len(passes) < 2:
            batches: list[Reencrypted] = []
            after = 0
            while True:
                async with engine.begin() as conn:
                    batch = await endpoints.reencrypt(conn, after_id=after, limit=batch_size)
                batches.append(batch)
                if batch.last_id is None or batch.endpoints < batch_size:
                    break
                after = batch.last_id
            passes.append(batches)
            if not any(b.encrypted for b in batches):
                break
    finally:
        await engine.dispose()
    return passes
