"""What the endpoints commands print as text: an endpoint's fields, its audience and state,
its deliveries and newest attempts; and the warning of a secret stored unencrypted."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

import click

from relay.cli.render import BAD, GOOD, Tint, age, echo, print_fields, print_table, printable
from relay.ops.endpoints import DELIVERY_STATUSES, Changed, Shown

if TYPE_CHECKING:
    from outbox.endpoints import Endpoint

UNENCRYPTED = (
    "outbox-relay: warning: the secret is stored unencrypted, as OUTBOX_ENDPOINT_SECRET_KEY is "
    "not set here (set it as the relays have it to store secrets encrypted, then run "
    "`outbox-relay endpoints reencrypt`)"
)


def warn_if_unencrypted(result: Changed) -> Changed:
    """``result``; if the secret it stored is unencrypted, said on stderr as the command's
    last line, where it is seen (rather than as the library's log event)."""
    if result.unencrypted:
        click.get_current_context().call_on_close(lambda: echo(UNENCRYPTED, err=True))
    return result


def audience(ep: Endpoint) -> tuple[str, str]:
    """Whose events and which types it receives; '*' is every one."""
    return ep.tenant or "*", ",".join(ep.event_types) or "*"


def state(ep: Endpoint) -> str:
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


def print_endpoint(ep: Endpoint) -> None:
    tenant, types = audience(ep)
    _print_fields(
        {
            "id": ep.id,
            "destination": ep.destination,
            "url": ep.url,
            "tenant": tenant if ep.tenant else "* (every tenant)",
            "event_types": types if ep.event_types else "* (every type)",
            "rate_limit": f"{ep.rate_limit}/s" if ep.rate_limit else "none",
            "description": ep.description,
            "state": state(ep),
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


def print_activity(shown: Shown) -> None:
    """The endpoint's deliveries by status, its last outcome, its newest attempts."""
    d = shown.deliveries
    oldest = f" (oldest {age(d.oldest_pending_age_s)})" if d.pending else ""
    counts = ", ".join(f"{getattr(d, s)} {s}" for s in DELIVERY_STATUSES)
    _print_fields(
        {
            "deliveries": counts.replace(" pending", f" pending{oldest}", 1),
            "last_status": d.last_status,
            "last_error": printable(d.last_error or "", 300),
        }
    )
    attempts = shown.recent_attempts
    if not attempts:
        echo()
        echo("no attempts yet")
        return
    echo()
    echo(f"latest {len(attempts)} attempt(s), newest first:")
    rows = [("AT", "EVENT", "HTTP", "MS", "ERROR")]
    for a in attempts:
        ms = a.duration_ms
        rows.append(
            (
                a.at[:19],
                str(a.event_id),
                str(a.http_status or "-"),
                "-" if ms is None else f"{ms:.0f}",
                printable(a.error or "-", 160),
            )
        )
    print_table(rows)
