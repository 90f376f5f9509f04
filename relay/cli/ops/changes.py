"""The commands that change rows or destinations: `retry`, `purge`, `skip`, `pause` and
`resume`. Those that change many rows or lose them (retry by filter, purge, skip) count them
first (a dry run) and ask on the terminal; elsewhere they need --yes."""

from __future__ import annotations

from datetime import datetime

import click

from relay.cli.options import (
    Duration,
    Since,
    database_options,
    default_by,
    json_option,
    with_db,
    yes_option,
)
from relay.cli.render import ProgressLine, confirm_change, echo, echo_json, timed
from relay.durations import FORMS, format_duration
from relay.ops import pause as pausing
from relay.ops import purge as purging
from relay.ops import retry as retrying
from relay.ops.pause import SkipCount, Skipped
from relay.ops.purge import PurgeCount, Purged, PurgeScope
from relay.ops.retry import Retried, RetryFilter

# --- retry ----------------------------------------------------------------------------------


@click.command(short_help="Move failed rows back to pending, due now.")
@database_options
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
@yes_option("Do not ask for confirmation (needed off a terminal, but with --id only).")
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
    yes: bool,
) -> None:
    """Move failed rows back to pending, with attempts reset and due now.

    Rows chosen by a filter (--all, --destination, --since, --error-like) are counted per
    destination first and retried once confirmed on the terminal; off a terminal, with --yes.
    Rows named by --id alone are retried at once."""
    if not (destinations or ids or since or error_like or all_failed):
        raise click.UsageError(
            "say which failed rows to retry: --destination, --id, --since, --error-like, "
            "or --all for every failed row (add --dry-run to see them first)"
        )
    flt = RetryFilter(
        destinations=list(destinations) or None,
        ids=list(ids) or None,
        since=since,
        error_like=error_like,
    )
    by_filter = bool(destinations or since or error_like or all_failed)
    if by_filter and not (dry_run or yes):
        preview = with_db(database_url, lambda c: retrying.retry(c, schema, flt, dry_run=True))
        confirm_change(
            f"would retry {preview.rows} failed row(s)",
            _retry_lines(preview),
            "retry them",
            empty=not preview.rows,
        )
    action = timed(
        "counting" if dry_run else "retrying",
        lambda c: retrying.retry(c, schema, flt, dry_run=dry_run),
        shown=not as_json,
    )
    result = with_db(database_url, action)
    if as_json:
        echo_json(result.to_json())
        return
    verb = "would retry" if dry_run else "retried"
    echo(f"{verb} {result.rows} failed row(s)")
    for text in _retry_lines(result):
        echo(text)


def _retry_lines(result: Retried) -> list[str]:
    return [
        f"  {name}: {d.rows} (ids {d.first_id}…{d.last_id})"
        for name, d in sorted(result.destinations.items())
    ]


# --- purge ----------------------------------------------------------------------------------


@click.command(short_help="Delete old delivered, skipped (and failed) rows.")
@database_options
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
@yes_option("Do not ask for confirmation (needed off a terminal).")
def purge(
    database_url: str,
    schema: str,
    as_json: bool,
    older_than: float | None,
    failed: bool,
    destinations: tuple[str, ...],
    batch_size: int,
    dry_run: bool,
    yes: bool,
) -> None:
    """Delete delivered and skipped rows (and with --failed, failed rows) older than
    --older-than.

    Counts them per destination first and deletes them once confirmed on the terminal; off a
    terminal, with --yes."""
    if older_than is None:
        raise click.UsageError(
            "purge needs --older-than, e.g. --older-than 7d: delivered rows older than that are "
            "deleted (add --failed for failed rows, --dry-run to count first)"
        )
    scope = PurgeScope(older_than, failed, list(destinations) or None)
    older = format_duration(older_than)
    if dry_run or not yes:
        counted = with_db(database_url, lambda c: purging.purge_count(c, schema, scope))
        if dry_run:
            _print_purge_count(counted, older, as_json)
            return
        confirm_change(
            f"would delete {counted.rows} row(s) older than {older}",
            _purge_lines(counted),
            "delete them",
            empty=not counted.rows,
        )
    result = _purge(database_url, schema, scope, batch_size, shown=not as_json)
    if as_json:
        echo_json(result.to_json())
        return
    d = result.deleted
    what = f"{d['delivered']} delivered, {d['skipped']} skipped" + (
        f" and {d['failed']} failed" if failed else ""
    )
    echo(f"deleted {what} row(s) older than {older} in {result.batches} batch(es)")


def _purge(
    database_url: str, schema: str, scope: PurgeScope, batch_size: int, *, shown: bool
) -> Purged:
    """The purge, its progress on a line of stderr (a terminal's, ``shown``) as it goes."""
    bar = ProgressLine(shown)

    def progress(deleted: int, total: int) -> None:
        if total:  # else there is nothing to wait for
            share = min(100, deleted * 100 // total)
            bar.draw(f"purging: {deleted} of {total} row(s) deleted ({share}%)")

    try:
        return with_db(
            database_url,
            lambda c: purging.purge(
                c, schema, scope, batch_size=batch_size, progress=progress if bar.shown else None
            ),
        )
    finally:
        bar.wipe()


def _print_purge_count(counted: PurgeCount, older: str, as_json: bool) -> None:
    if as_json:
        echo_json(counted.to_json())
        return
    echo(f"would delete {counted.rows} row(s) older than {older}")
    for text in _purge_lines(counted):
        echo(text)


def _purge_lines(result: PurgeCount) -> list[str]:
    return [
        f"  {name}: " + ", ".join(f"{n} {s}" for s, n in sorted(per.items()))
        for name, per in sorted(result.destinations.items())
    ]


# --- skip, pause, resume --------------------------------------------------------------------


@click.command(short_help="Give up on failed rows: mark them skipped.")
@database_options
@json_option
@click.argument("ids", nargs=-1, type=int, required=True)
@click.option("--by", help="Who skips (recorded in last_error); default user@host.")
@click.option("--dry-run", is_flag=True, help="Check the rows; change nothing.")
@yes_option("Do not ask for confirmation (needed off a terminal).")
def skip(
    database_url: str,
    schema: str,
    as_json: bool,
    ids: tuple[int, ...],
    by: str | None,
    dry_run: bool,
    yes: bool,
) -> None:
    """Give up on failed rows: mark them skipped (never delivered); a key they block moves on.

    Checks the rows and shows them per destination first, and skips them once confirmed on
    the terminal; off a terminal, with --yes."""
    who = by or default_by()
    if dry_run or not yes:
        counted = with_db(database_url, lambda c: pausing.skip_count(c, schema, list(ids)))
        if dry_run:
            _print_skipped(counted, as_json, "would skip")
            return
        confirm_change(
            f"would skip {counted.rows} failed row(s), never to be delivered",
            [
                f"  {name}: {d.rows} (ids {', '.join(map(str, d.ids))})"
                for name, d in sorted(counted.destinations.items())
            ],
            "skip them",
            empty=not counted.rows,
        )
    done = with_db(database_url, lambda c: pausing.skip(c, schema, list(ids), who))
    _print_skipped(done, as_json, "skipped")


def _print_skipped(result: SkipCount | Skipped, as_json: bool, verb: str) -> None:
    if as_json:
        echo_json(result.to_json())
    else:
        echo(f"{verb} {result.rows} row(s): {', '.join(map(str, result.ids))}")


@click.command(short_help="Stop every relay from claiming DESTINATION.")
@database_options
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
        database_url,
        lambda c: pausing.pause(c, schema, destination, by or default_by(), reason),
    )
    if as_json:
        echo_json(result.to_json())
    elif result.already_paused:
        echo(f"{destination} was already paused (since {result.since})")
    else:
        echo(
            f"paused {destination}: relays stop claiming it within one poll interval; "
            f"in-flight rows finish. Undo with `outbox-relay resume {destination}`."
        )


@click.command(short_help="Let relays claim DESTINATION again.")
@database_options
@json_option
@click.argument("destination")
def resume(database_url: str, schema: str, as_json: bool, destination: str) -> None:
    """Let relays claim DESTINATION again."""
    result = with_db(database_url, lambda c: pausing.resume(c, schema, destination))
    if as_json:
        echo_json(result.to_json())
    elif result.was_paused:
        echo(f"resumed {destination}: relays claim it again within one poll interval")
    else:
        echo(f"{destination} was not paused; nothing to do")
