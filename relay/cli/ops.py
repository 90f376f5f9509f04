"""The operations commands: status, show, retry, purge, pause, resume, skip. Each runs one
function of relay/ops/admin.py and prints its result, as text or ``--json``."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Any

import click

from relay.cli.options import (
    EXIT_CONDITION,
    Duration,
    Since,
    age,
    database_url_option,
    default_by,
    echo_json,
    json_option,
    schema_option,
    with_db,
)
from relay.durations import FORMS, format_duration
from relay.ops import admin


@click.command()
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
    data = with_db(database_url, lambda c: admin.status(c, schema))
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
        echo_json(data)
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
            "running": f"seen {age(r['seen_age_s'])} ago",
            "silent": f"SILENT for {age(r['seen_age_s'])} (killed, or cut off from the database)",
            "stopped": f"stopped at {(r['stopped_at'] or '')[:19]}",
        }[r["state"]]
        where = f"{r['host']} pid {r['pid']}" if r["host"] else "?"
        serves = ", ".join(r["destinations"]) or "-"
        click.echo(f"  {r['relay_id']}: {r['state']} on {where}, {when}; serves {serves}")


STATUS_COLUMNS = (
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


def _print_status(data: dict[str, Any]) -> None:
    dests = data["destinations"]
    if not dests:
        click.echo(f"the outbox in schema {data['schema']!r} is empty")
        _print_relays(data["relays"])
        return
    _print_table([STATUS_COLUMNS, *(_status_row(d) for d in dests)])
    _print_relays(data["relays"])
    _print_details(dests)


def _status_row(d: dict[str, Any]) -> tuple[str, ...]:
    state = "active"
    if d["paused"]:
        p = d["paused"]
        state = f"PAUSED since {p['since'][:19]}" + (f" by {p['by']}" if p["by"] else "")
        if p["reason"]:
            state += f": {p['reason']}"
    counts = (d["pending"], d["due_now"])
    more = (d["running"], d["delivered"], d["failed"], d["skipped"])
    return (
        d["destination"],
        *map(str, counts),
        age(d["oldest_pending_age_s"]),
        *map(str, more),
        state,
    )


def _print_table(rows: list[tuple[str, ...]]) -> None:
    """Columns aligned: the first to the left, the numbers to the right, the last as it is."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        cells = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=False))
        ]
        click.echo("  ".join([*cells, r[-1]]))


def _print_details(dests: list[dict[str, Any]]) -> None:
    """What needs attention: leases held, failures by error, blocked keys."""
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


@click.command()
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
    found, missing = with_db(
        database_url, lambda c: admin.show(c, schema, list(ids), preview_bytes)
    )
    if as_json:
        echo_json({"rows": found, "missing": missing})
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


@click.command()
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
    result = with_db(database_url, lambda c: admin.retry(c, schema, flt, dry_run=dry_run))
    if as_json:
        echo_json(result)
        return
    verb = "would retry" if dry_run else "retried"
    click.echo(f"{verb} {result['rows']} failed row(s)")
    for name, d in sorted(result["destinations"].items()):
        click.echo(f"  {name}: {d['rows']} (ids {d['first_id']}…{d['last_id']})")


@click.command()
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
    result = with_db(
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
        echo_json(result)
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


@click.command()
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
    result = with_db(
        database_url, lambda c: admin.pause(c, schema, destination, by or default_by(), reason)
    )
    if as_json:
        echo_json(result)
    elif result["already_paused"]:
        click.echo(f"{destination} was already paused (since {result['since']})")
    else:
        click.echo(
            f"paused {destination}: relays stop claiming it within one poll interval; "
            f"in-flight rows finish. Undo with `outbox-relay resume {destination}`."
        )


@click.command()
@database_url_option
@schema_option
@json_option
@click.argument("destination")
def resume(database_url: str, schema: str, as_json: bool, destination: str) -> None:
    """Let relays claim DESTINATION again."""
    result = with_db(database_url, lambda c: admin.resume(c, schema, destination))
    if as_json:
        echo_json(result)
    elif result["was_paused"]:
        click.echo(f"resumed {destination}: relays claim it again within one poll interval")
    else:
        click.echo(f"{destination} was not paused; nothing to do")


@click.command()
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
    result = with_db(
        database_url,
        lambda c: admin.skip(c, schema, list(ids), by or default_by(), dry_run=dry_run),
    )
    if as_json:
        echo_json(result)
        return
    verb = "would skip" if dry_run else "skipped"
    click.echo(f"{verb} {result['rows']} row(s): {', '.join(map(str, result['ids']))}")
