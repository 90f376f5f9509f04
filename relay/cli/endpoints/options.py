"""The endpoints commands' own options: endpoint ids and rate limits in their columns' range,
a secret given on the command line or in a file (never printed by an error after), the URL
checks to relax, and what `update` is asked to change."""

from __future__ import annotations

import math
import sys
from typing import Any

import click

from relay.obs import scrub

# The columns' own limits: a larger number is a usage error, not a database error.
ENDPOINT_ID = click.IntRange(1, 2**63 - 1)
RATE_LIMIT = click.IntRange(1, 2**31 - 1)
# Longer is no longer a rotation; and timedelta and PostgreSQL intervals have limits.
MAX_KEEP_PREVIOUS_HOURS = 24 * 366
MAX_SECRET_FILE = 1024  # bytes: a whsec_ secret is 50; more is the wrong file


def register_secret(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
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


def finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
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


def changes(
    url: str | None,
    tenant: str | None,
    all_tenants: bool,
    event_types: tuple[str, ...],
    all_event_types: bool,
    rate_limit: int | None,
    no_rate_limit: bool,
    description: str | None,
) -> dict[str, Any]:
    """The keywords of Endpoints.update for what `update`'s options ask to change."""
    for a, b, given in (
        ("--tenant", "--all-tenants", tenant is not None and all_tenants),
        ("--event-type", "--all-event-types", bool(event_types) and all_event_types),
        ("--rate-limit", "--no-rate-limit", rate_limit is not None and no_rate_limit),
    ):
        if given:
            raise click.UsageError(f"{a} and {b} contradict each other: give one")
    changed: dict[str, Any] = {}
    if url is not None:
        changed["url"] = url
    if tenant is not None or all_tenants:
        changed["tenant"] = tenant  # None: every tenant
    if event_types or all_event_types:
        changed["event_types"] = list(event_types)  # empty: every type
    if rate_limit is not None or no_rate_limit:
        changed["rate_limit"] = rate_limit  # None: no limit
    if description is not None:
        changed["description"] = description
    if not changed:
        raise click.UsageError(
            "nothing to change: give --url, --tenant/--all-tenants, --event-type/"
            "--all-event-types, --rate-limit/--no-rate-limit or --description"
        )
    return changed
