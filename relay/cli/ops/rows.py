"""`outbox-relay show` and `outbox-relay list`: rows in full (an event's deliveries and
attempts with them), and pages of rows matching filters, newest first."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import asyncpg
import click

from outbox.status import Status
from relay.cli.options import database_options, json_option, with_db
from relay.cli.render import (
    STATUS_COLOURS,
    Tint,
    echo,
    echo_json,
    line,
    print_fields,
    print_table,
)
from relay.ops import rows as ops
from relay.ops.rows import EventActivity, EventAttempt, EventDelivery, ListedRow, ShownRow

# Ids are bigint: a larger number is a usage error, not a database error.
ROW_ID = click.IntRange(1, 2**63 - 1)


@click.command(short_help="Show outbox rows in full, with their deliveries.")
@database_options
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
    """Show outbox rows in full: status, attempts, last error, headers, payload preview.

    An event of an `endpoints` destination also shows its deliveries (one per endpoint) and
    their attempts from the message log."""

    async def read(c: asyncpg.Connection) -> tuple[list[ShownRow], list[int], EventActivity]:
        found, missing = await ops.show(c, schema, list(ids), preview_bytes)
        activity = await ops.event_deliveries(c, schema, [r.id for r in found])
        return found, missing, activity

    found, missing, activity = with_db(database_url, read)
    if as_json:
        rows = [r.to_json() for r in found]
        echo_json({"rows": rows, "missing": missing, **activity.to_json()})
    else:
        for i, row in enumerate(found):
            if i:
                echo()
            print_fields({k: _field(k, v) for k, v in row.to_json().items()}, 16)
            _print_event_deliveries(row.id, activity)
    if missing:
        raise click.ClickException(
            f"no outbox row with id {', '.join(map(str, missing))} (delivered rows are deleted "
            "after relay.retention)"
        )


def _field(name: str, value: object) -> str:
    if name == "status":
        return Tint(str(value), STATUS_COLOURS.get(str(value)))
    if name == "headers":
        return json.dumps(value, ensure_ascii=False)
    return "-" if value is None else str(value)


# `show` in text: an event's deliveries and attempts beyond these are left to --json.
SHOWN_DELIVERIES = 50
SHOWN_ATTEMPTS = 20


def _print_event_deliveries(event_id: int, activity: EventActivity) -> None:
    deliveries = [d for d in activity.deliveries if d.event_id == event_id]
    attempts = [a for a in activity.attempts if a.event_id == event_id]
    if not deliveries and not attempts:
        return  # not an event of an `endpoints` destination (or not fanned out yet)
    counts = Counter(d.status for d in deliveries)
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    echo(f"{'deliveries:':<16} {len(deliveries)}" + (f" ({summary})" if summary else ""))
    if deliveries:
        _print_deliveries(deliveries)
    if not attempts:
        echo(f"{'attempt_log:':<16} no attempts yet")
        return
    shown = attempts[-SHOWN_ATTEMPTS:]
    older = len(attempts) - len(shown)
    echo(
        f"{'attempt_log:':<16} {len(attempts)} attempt(s), oldest first"
        + (f"; the {older} oldest left out (--json lists them all)" if older else "")
    )
    _print_attempts(shown)


def _print_deliveries(deliveries: list[EventDelivery]) -> None:
    rows: list[tuple[str, ...]] = [
        ("ENDPOINT", "ORIGIN", "STATUS", "ATTEMPTS", "HTTP", "FINISHED", "LAST ERROR")
    ]
    for d in deliveries[:SHOWN_DELIVERIES]:
        rows.append(
            (
                str(d.endpoint_id),
                d.origin or "(deleted)",
                Tint(d.status, STATUS_COLOURS.get(d.status)),
                str(d.attempts),
                str(d.last_status or "-"),
                (d.finished_at or "-")[:19],
                line(d.last_error, 120),
            )
        )
    print_table(rows, indent="  ")
    if len(deliveries) > SHOWN_DELIVERIES:
        echo(f"  … {len(deliveries) - SHOWN_DELIVERIES} more (--json lists them all)")


def _print_attempts(attempts: list[EventAttempt]) -> None:
    rows = [("AT", "ENDPOINT", "HTTP", "MS", "REPLAY", "ERROR / RESPONSE")]
    for a in attempts:
        ms = a.duration_ms
        text = line(a.error, 120) if a.error else "response: " + line(a.response, 80)
        rows.append(
            (
                (a.at or "")[:19],
                str(a.endpoint_id),
                str(a.http_status or "-"),
                "-" if ms is None else f"{ms:.0f}",
                "replay" if a.replay else "-",
                text,
            )
        )
    print_table(rows, indent="  ")


# `list` in text: a row's last error cut to this (--json has it whole).
LIST_ERROR_CHARS = 80
LIST_COLUMNS = (
    "ID",
    "DESTINATION",
    "KEY",
    "STATUS",
    "ATTEMPTS",
    "CREATED",
    "RUN AFTER",
    "LAST ERROR",
)


@click.command("list", short_help="List outbox rows, newest first, a page at a time.")
@database_options
@json_option
@click.option(
    "--status", type=click.Choice([s.value for s in Status]), help="Only rows in this state."
)
@click.option("--destination", help="Only this destination's rows.")
@click.option("--key", help="Only rows with this key.")
@click.option("--tenant", help="Only this tenant's rows.")
@click.option("--event-type", help="Only rows of this event type.")
@click.option(
    "--error-like",
    metavar="PATTERN",
    help="Only rows whose last error matches (case-insensitive; a plain word matches "
    "anywhere, or use SQL LIKE wildcards % and _).",
)
@click.option("--min-id", type=ROW_ID, metavar="N", help="Only rows with id >= N.")
@click.option("--max-id", type=ROW_ID, metavar="N", help="Only rows with id <= N.")
@click.option(
    "--before-id",
    type=ROW_ID,
    metavar="N",
    help="Only rows with id < N: the next page starts where the last one ended.",
)
@click.option(
    "--limit",
    type=click.IntRange(1, ops.LIST_MAX_LIMIT),
    default=ops.LIST_DEFAULT_LIMIT,
    show_default=True,
    help="Rows per page.",
)
def list_(database_url: str, schema: str, as_json: bool, **filters: Any) -> None:
    """List outbox rows, newest first, a page at a time.

    Every filter given must match. The next page: the same command with --before-id the id
    printed at the end (in JSON, next_before_id); pages never skip or repeat a row, however
    far down. A filter no index serves (--error-like, --key or --destination alone) reads
    back until it finds a page: for a rare match add --status, --min-id or --before-id."""
    page = with_db(database_url, lambda c: ops.list_rows(c, schema, **filters))
    if as_json:
        echo_json(page.to_json())
        return
    if not page.rows:
        before_id = filters["before_id"]
        echo("no rows match" + (f" below id {before_id}" if before_id else ""))
        return
    print_table([LIST_COLUMNS, *(_listed(r) for r in page.rows)])
    if page.next_before_id is not None:
        echo(f"… more: the next page is this command with --before-id {page.next_before_id}")


def _listed(r: ListedRow) -> tuple[str, ...]:
    return (
        str(r.id),
        r.destination,
        line(r.key, 40),
        Tint(r.status, STATUS_COLOURS.get(r.status)),
        str(r.attempts),
        (r.created_at or "")[:19],
        (r.run_after or "")[:19],
        line(r.last_error, LIST_ERROR_CHARS),
    )
