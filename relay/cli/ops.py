"""The operations commands: status, show, list, retry, replay, purge, pause, resume, skip. Each
runs functions of relay/ops/admin.py and prints their result, as text or ``--json``. Those that
change many rows or lose them (retry by filter, purge, skip) show what they will touch and ask
first, on a terminal; elsewhere they need --yes."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import asyncpg
import click

from outbox.status import Status
from relay.cli import terminal
from relay.cli.options import (
    BAD,
    EXIT_CONDITION,
    GOOD,
    STATUS_COLOURS,
    WAITING,
    Control,
    Duration,
    Since,
    Tint,
    age,
    confirm,
    database_options,
    default_by,
    echo,
    echo_json,
    json_option,
    print_table,
    printable,
    snapshot_warning_option,
    with_db,
)
from relay.durations import FORMS, format_duration
from relay.ops import admin

T = TypeVar("T")


# `status --watch`: the interval between snapshots, in seconds.
WATCH_DEFAULT = 2.0
WATCH_MIN = 0.5
WATCH_MAX = 3600.0


@click.command(short_help="Pending, due, failed and in flight, per destination.")
@database_options
@json_option
@click.option(
    "--watch",
    type=click.FloatRange(WATCH_MIN, WATCH_MAX),
    is_flag=False,
    flag_value=WATCH_DEFAULT,
    metavar="[SECONDS]",
    help=f"Show it again every SECONDS (default {WATCH_DEFAULT:g}) until Ctrl-C; with --json, "
    "one document per line.",
)
@click.option("--fail-if-failed", is_flag=True, help=f"Exit {EXIT_CONDITION} if any row is failed.")
@click.option(
    "--fail-if-pending-older-than",
    type=Duration(),
    metavar="DURATION",
    help=f"Exit {EXIT_CONDITION} if the oldest pending row, or an enabled endpoint's oldest "
    "pending delivery, is older than this (e.g. 5m).",
)
@snapshot_warning_option
def status(
    database_url: str,
    schema: str,
    as_json: bool,
    watch: float | None,
    fail_if_failed: bool,
    fail_if_pending_older_than: float | None,
    snapshot_warning: float,
) -> None:
    """Per destination: pending, due now, oldest pending age, in flight, delivered, failed.

    With --watch, again and again until Ctrl-C."""
    if watch is not None:
        if fail_if_failed or fail_if_pending_older_than is not None:
            raise click.UsageError("--fail-if-… judge one snapshot: not with --watch")
        _watch(database_url, schema, as_json, watch, snapshot_warning)
        return
    data = with_db(
        database_url, lambda c: admin.status(c, schema, snapshot_warning=snapshot_warning)
    )
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
        # Events of endpoints destinations are delivered once fanned out: their waiting is
        # in their deliveries, per endpoint (a disabled endpoint's wait on purpose).
        stuck = [
            f"endpoint {e['id']}"
            for e in data.get("endpoints", [])
            if e["enabled"] and (e["oldest_pending_age_s"] or 0) > fail_if_pending_older_than
        ]
        if stuck:
            problems.append(
                f"pending deliveries older than {format_duration(fail_if_pending_older_than)} "
                f"for {', '.join(stuck)}"
            )
    data["problems"] = problems
    if as_json:
        echo_json(data)
    else:
        _print_status(data)
    if problems:
        if not as_json:
            echo(Tint(f"problem: {'; '.join(problems)}", BAD), err=True)
        sys.exit(EXIT_CONDITION)


def _watch(
    database_url: str, schema: str, as_json: bool, interval: float, snapshot_warning: float
) -> None:
    """Status snapshots every ``interval`` seconds (from the end of one to the start of the
    next) until Ctrl-C. On a terminal each replaces the last on a cleared screen; elsewhere
    they follow one another, each after a line with its time. With ``as_json``: one compact
    JSON document per line, as `status --json` gives it."""
    on_screen = terminal.stdout()
    shown = 0
    try:
        while True:
            data = with_db(
                database_url,
                lambda c: admin.status(c, schema, snapshot_warning=snapshot_warning),
            )
            data["problems"] = []
            if as_json:
                echo(json.dumps(data, default=str))
            else:
                at = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
                if on_screen:
                    echo(Control(CLEAR_SCREEN), nl=False, color=True)
                    echo(f"every {interval:g}s, {at} (Ctrl-C to stop)")
                    echo()
                else:
                    if shown:
                        echo()
                    echo(f"--- {at} ---")
                _print_status(data)
            shown += 1
            _sleep(interval)
    except KeyboardInterrupt:
        if on_screen and not as_json:
            echo()  # the prompt on a line of its own, after ^C


# Clear the screen, cursor to the top left (as click.clear, which a test cannot see).
CLEAR_SCREEN = "\033[2J\033[1;1H"

# Module attributes, so that a test can stand in for a terminal and for the passing time.
_sleep = time.sleep


def _print_relays(relays: list[dict[str, Any]]) -> None:
    if not relays:
        return
    echo()
    echo("relays:")
    for r in relays:
        when = {
            "running": f"seen {age(r['seen_age_s'])} ago",
            "silent": f"SILENT for {age(r['seen_age_s'])} (killed, or cut off from the database)",
            "stopped": f"stopped at {(r['stopped_at'] or '')[:19]}",
        }[r["state"]]
        where = f"{r['host']} pid {r['pid']}" if r["host"] else "?"
        serves = ", ".join(r["destinations"]) or "-"
        state = Tint(r["state"], RELAY_COLOURS.get(r["state"]))
        echo(f"  {r['relay_id']}: ", state, f" on {where}, {when}; serves {serves}")


RELAY_COLOURS = {"running": GOOD, "silent": BAD}


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
        echo(f"the outbox in schema {data['schema']!r} is empty")
        _print_relays(data["relays"])
        _print_endpoints(data)
        _print_snapshot(data.get("snapshot"))
        return
    print_table([STATUS_COLUMNS, *(_status_row(d) for d in dests)], numbers=True)
    _print_relays(data["relays"])
    _print_details(dests)
    _print_endpoints(data)
    _print_snapshot(data.get("snapshot"))


def _print_snapshot(s: dict[str, Any] | None) -> None:
    """The snapshot holding back VACUUM: when older than the threshold, or when this role
    cannot tell how old it is (the grant that would tell)."""
    if s is None or not (s["over_threshold"] or not s["visible"]):
        return
    echo()
    if s["over_threshold"]:
        echo(
            Tint(f"snapshot held for {age(s['age_s'])} by {s['holder']}", BAD),
            f" ({s['xid_age']} transactions): VACUUM cannot clean the outbox of the rows it "
            "still sees, and claims slow down while it is held",
        )
        echo(f"  end it: {s['action']}")
    else:
        echo(
            f"oldest snapshot: {s['holder']}, {s['xid_age']} transactions old, held for a "
            f"time hidden from this role: {s['hint']}"
        )


def _status_row(d: dict[str, Any]) -> tuple[str, ...]:
    state = Tint("active", GOOD)
    if d["paused"]:
        p = d["paused"]
        paused = f"PAUSED since {p['since'][:19]}" + (f" by {p['by']}" if p["by"] else "")
        if p["reason"]:
            paused += f": {p['reason']}"
        state = Tint(paused, WAITING)
    if d.get("circuit", "closed") != "closed":
        # Open in a relay: its rows wait there (the relays' /metrics say which endpoint).
        circuit = f"CIRCUIT {d['circuit'].upper().replace('_', '-')}"
        state = Tint(f"{state} {circuit}" if d["paused"] else circuit, BAD)
    counts = (d["pending"], d["due_now"])
    # "~": estimated from the planner's statistics on a large table (see `status` in
    # docs/operations.md); every other count is exact.
    delivered = ("~" if d.get("delivered_estimated") else "") + str(d["delivered"])
    return (
        d["destination"],
        *map(str, counts),
        age(d["oldest_pending_age_s"]),
        str(d["running"]),
        delivered,
        Tint(str(d["failed"]), BAD if d["failed"] else None),
        str(d["skipped"]),
        state,
    )


def _line(text: str | None, limit: int) -> str:
    """Free text on one line, at most ``limit`` characters: its line breaks and other
    controls shown escaped (``\\n``), as everything printed is."""
    return printable(text, limit) if text else "-"


def _needs_a_look(e: dict[str, Any]) -> bool:
    return bool(e["pending"] or e["failing_since"] or not e["enabled"])


def _endpoint_state(e: dict[str, Any]) -> str:
    if e["enabled"]:
        return Tint("enabled", GOOD)
    reason = e["disabled_reason"]
    return Tint("DISABLED" + (f": {_line(reason, 80)}" if reason else ""), BAD)


def _print_endpoints(data: dict[str, Any]) -> None:
    """The endpoints of `endpoints` destinations: those that need a look first."""
    total = data["endpoints_total"]
    if not total:
        return
    listed = data["endpoints"]
    attention = data["endpoints_needing_attention"]
    echo()
    echo(
        f"endpoints ({total} registered; {attention} with pending deliveries, failing or disabled):"
    )
    rows: list[tuple[str, ...]] = [
        (
            "ID",
            "DESTINATION",
            "ORIGIN",
            "PENDING",
            "OLDEST",
            "FAILING SINCE",
            "LAST HTTP",
            "LAST SUCCESS",
            "CIRCUIT",
            "STATE",
        )
    ]
    for e in listed:
        last_http = e["last_http_status"]
        rows.append(
            (
                str(e["id"]),
                e["destination"],
                e["origin"] or "-",
                str(e["pending"]),
                age(e["oldest_pending_age_s"]),
                (e["failing_since"] or "-")[:19],
                str(last_http) if last_http else "none" if e["last_attempt_at"] else "-",
                (e["last_success_at"] or "-")[:19],
                Tint(f"open until {e['circuit_open_until'][11:19]}", BAD)
                if e["circuit_open_until"]
                else "closed",
                _endpoint_state(e),
            )
        )
    print_table(rows, indent="  ")
    rest = total - len(listed)
    if rest:
        rest_attention = attention - sum(1 for e in listed if _needs_a_look(e))
        echo(
            f"  … {rest} more endpoint(s) not listed"
            + (
                f", {rest_attention} of them with pending deliveries, failing or disabled"
                if rest_attention
                else ": enabled, not failing, nothing pending"
            )
            + " (`outbox-relay endpoints list`, `outbox-relay endpoints show ID`)"
        )


def _print_details(dests: list[dict[str, Any]]) -> None:
    """What needs attention: leases held, failures by error, blocked keys."""
    leases = [(d["destination"], x) for d in dests for x in d["in_flight"]]
    if leases:
        echo()
        echo("in flight:")
        for name, x in leases:
            left = x["lease_left_s"]
            lease = (
                f"lease {format_duration(left)} left" if left >= 0 else Tint("LEASE EXPIRED", BAD)
            )
            echo(f"  {name}: {x['rows']} row(s) held by {x['relay']} (", lease, ")")
    errors = [(d["destination"], e) for d in dests for e in d["failed_errors"]]
    if errors:
        echo()
        echo("failed (retry with `outbox-relay retry --destination NAME`):")
        for name, e in errors:
            err = printable(e["error"] or "no error recorded", 160)
            echo(f"  {name}: {e['rows']} x {err}")
    blocked = [(d["destination"], b) for d in dests for b in d["blocked_keys"]]
    if blocked:
        echo()
        echo(
            "keys with a failed row ahead of pending rows (they wait where the destination "
            'has ordering = "key" and poison_policy = "block"; unblock with '
            "`outbox-relay retry --id ID` or `outbox-relay skip ID`):"
        )
        for name, b in blocked:
            echo(
                f"  {name}: key {b['key']!r} held by failed row {b['failed_id']}, "
                f"{b['waiting']} row(s) waiting: {printable(b['error'] or '', 120)}"
            )


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

    async def read(c: asyncpg.Connection) -> tuple[list[Any], list[int], dict[str, Any]]:
        found, missing = await admin.show(c, schema, list(ids), preview_bytes)
        activity = await admin.event_deliveries(c, schema, [r["id"] for r in found])
        return found, missing, activity

    found, missing, activity = with_db(database_url, read)
    if as_json:
        echo_json({"rows": found, "missing": missing, **activity})
    else:
        for i, row in enumerate(found):
            if i:
                echo()
            for k, v in row.items():
                if k == "status":
                    text: str = Tint(v, STATUS_COLOURS.get(v))
                elif k == "headers":
                    text = json.dumps(v, ensure_ascii=False)
                else:
                    text = "-" if v is None else str(v)
                echo(f"{k + ':':<16} ", text)
            _print_event_deliveries(row["id"], activity)
    if missing:
        raise click.ClickException(
            f"no outbox row with id {', '.join(map(str, missing))} (delivered rows are deleted "
            "after relay.retention)"
        )


# `show` in text: an event's deliveries and attempts beyond these are left to --json.
SHOWN_DELIVERIES = 50
SHOWN_ATTEMPTS = 20


def _print_event_deliveries(event_id: int, activity: dict[str, Any]) -> None:
    deliveries = [d for d in activity["deliveries"] if d["event_id"] == event_id]
    attempts = [a for a in activity["attempts"] if a["event_id"] == event_id]
    if not deliveries and not attempts:
        return  # not an event of an `endpoints` destination (or not fanned out yet)
    counts = Counter(d["status"] for d in deliveries)
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    echo(f"{'deliveries:':<16} {len(deliveries)}" + (f" ({summary})" if summary else ""))
    rows: list[tuple[str, ...]]
    if deliveries:
        rows = [("ENDPOINT", "ORIGIN", "STATUS", "ATTEMPTS", "HTTP", "FINISHED", "LAST ERROR")]
        for d in deliveries[:SHOWN_DELIVERIES]:
            rows.append(
                (
                    str(d["endpoint_id"]),
                    d["origin"] or "(deleted)",
                    Tint(d["status"], STATUS_COLOURS.get(d["status"])),
                    str(d["attempts"]),
                    str(d["last_status"] or "-"),
                    (d["finished_at"] or "-")[:19],
                    _line(d["last_error"], 120),
                )
            )
        print_table(rows, indent="  ")
        if len(deliveries) > SHOWN_DELIVERIES:
            echo(f"  … {len(deliveries) - SHOWN_DELIVERIES} more (--json lists them all)")
    if not attempts:
        echo(f"{'attempt_log:':<16} no attempts yet")
        return
    shown = attempts[-SHOWN_ATTEMPTS:]
    older = len(attempts) - len(shown)
    echo(
        f"{'attempt_log:':<16} {len(attempts)} attempt(s), oldest first"
        + (f"; the {older} oldest left out (--json lists them all)" if older else "")
    )
    rows = [("AT", "ENDPOINT", "HTTP", "MS", "REPLAY", "ERROR / RESPONSE")]
    for a in shown:
        ms = a["duration_ms"]
        text = _line(a["error"], 120) if a["error"] else "response: " + _line(a["response"], 80)
        rows.append(
            (
                a["at"][:19],
                str(a["endpoint_id"]),
                str(a["http_status"] or "-"),
                "-" if ms is None else f"{ms:.0f}",
                "replay" if a["replay"] else "-",
                text,
            )
        )
    print_table(rows, indent="  ")


# Ids are bigint: a larger number is a usage error, not a database error.
ROW_ID = click.IntRange(1, 2**63 - 1)


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
    type=click.IntRange(1, admin.LIST_MAX_LIMIT),
    default=admin.LIST_DEFAULT_LIMIT,
    show_default=True,
    help="Rows per page.",
)
def list_(
    database_url: str,
    schema: str,
    as_json: bool,
    status: str | None,
    destination: str | None,
    key: str | None,
    tenant: str | None,
    event_type: str | None,
    error_like: str | None,
    min_id: int | None,
    max_id: int | None,
    before_id: int | None,
    limit: int,
) -> None:
    """List outbox rows, newest first, a page at a time.

    Every filter given must match. The next page: the same command with --before-id the id
    printed at the end (in JSON, next_before_id); pages never skip or repeat a row, however
    far down. A filter no index serves (--error-like, --key or --destination alone) reads
    back until it finds a page: for a rare match add --status, --min-id or --before-id."""
    page = with_db(
        database_url,
        lambda c: admin.list_rows(
            c,
            schema,
            status=status,
            destination=destination,
            key=key,
            tenant=tenant,
            event_type=event_type,
            error_like=error_like,
            min_id=min_id,
            max_id=max_id,
            before_id=before_id,
            limit=limit,
        ),
    )
    if as_json:
        echo_json(page)
        return
    rows = page["rows"]
    if not rows:
        echo("no rows match" + (f" below id {before_id}" if before_id else ""))
        return
    table: list[tuple[str, ...]] = [
        ("ID", "DESTINATION", "KEY", "STATUS", "ATTEMPTS", "CREATED", "RUN AFTER", "LAST ERROR")
    ]
    for r in rows:
        table.append(
            (
                str(r["id"]),
                r["destination"],
                _line(r["key"], 40),
                Tint(r["status"], STATUS_COLOURS.get(r["status"])),
                str(r["attempts"]),
                r["created_at"][:19],
                r["run_after"][:19],
                _line(r["last_error"], LIST_ERROR_CHARS),
            )
        )
    print_table(table)
    if page["next_before_id"] is not None:
        echo(f"… more: the next page is this command with --before-id {page['next_before_id']}")


# `list` in text: a row's last error cut to this (--json has it whole).
LIST_ERROR_CHARS = 80


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
@click.option(
    "--yes",
    is_flag=True,
    help="Do not ask for confirmation (needed off a terminal, but with --id only).",
)
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
    flt = admin.RetryFilter(
        destinations=list(destinations) or None,
        ids=list(ids) or None,
        since=since,
        error_like=error_like,
    )
    by_filter = bool(destinations or since or error_like or all_failed)
    if by_filter and not (dry_run or yes):
        preview = with_db(database_url, lambda c: admin.retry(c, schema, flt, dry_run=True))
        _confirm(
            f"would retry {preview['rows']} failed row(s)",
            _retry_lines(preview),
            "retry them",
            empty=not preview["rows"],
        )
    action = _timed(
        "counting" if dry_run else "retrying",
        lambda c: admin.retry(c, schema, flt, dry_run=dry_run),
        shown=not as_json,
    )
    result = with_db(database_url, action)
    if as_json:
        echo_json(result)
        return
    verb = "would retry" if dry_run else "retried"
    echo(f"{verb} {result['rows']} failed row(s)")
    for line in _retry_lines(result):
        echo(line)


# --- progress on the terminal -------------------------------------------------------------

# A line of progress is redrawn at most this often (seconds); an action says how long it has
# run once it has run this long.
REDRAW = 0.1
ELAPSED_AFTER = 1.0


class ProgressLine:
    """One line on stderr, redrawn in place while a command works (a purge's rows so far, a
    retry's time), and wiped when it is done. Only when stderr is a terminal and `shown`:
    elsewhere, and with --json, it writes nothing."""

    def __init__(self, shown: bool = True) -> None:
        self.shown = shown and terminal.stderr()
        self._drawn = 0  # characters on the line
        self._text = ""
        self._at = 0.0

    def draw(self, text: str, *, now: bool = False) -> None:
        """Show ``text`` instead of the line before, unless one was drawn in the last REDRAW
        seconds (``now``: all the same)."""
        if not self.shown or text == self._text:
            return
        if not (now or time.monotonic() - self._at >= REDRAW):
            return
        self._at = time.monotonic()
        self._text = text
        echo(Control("\r"), text.ljust(self._drawn), err=True, nl=False)
        self._drawn = len(text)

    def wipe(self) -> None:
        if self._drawn:
            echo(Control("\r"), " " * self._drawn, Control("\r"), err=True, nl=False)
            self._drawn = 0
            self._text = ""


def _timed(
    label: str, action: Callable[[asyncpg.Connection], Awaitable[T]], *, shown: bool
) -> Callable[[asyncpg.Connection], Awaitable[T]]:
    """``action``, which is one statement with no progress to tell, saying on the terminal
    ``label… 3s`` once it has run ELAPSED_AFTER seconds: so a long one does not look hung."""

    async def run(conn: asyncpg.Connection) -> T:
        line = ProgressLine(shown)
        if not line.shown:
            return await action(conn)

        async def tick() -> None:
            start = time.monotonic()
            await asyncio.sleep(ELAPSED_AFTER)
            while True:
                line.draw(f"{label}… {time.monotonic() - start:.0f}s", now=True)
                await asyncio.sleep(1)

        ticking = asyncio.create_task(tick())
        try:
            return await action(conn)
        finally:
            ticking.cancel()
            line.wipe()

    return run


def _retry_lines(result: dict[str, Any]) -> list[str]:
    return [
        f"  {name}: {d['rows']} (ids {d['first_id']}…{d['last_id']})"
        for name, d in sorted(result["destinations"].items())
    ]


# The destinations a refusal names on its one line; the question on a terminal lists them all.
REFUSAL_DESTINATIONS = 10


def _confirm(summary: str, lines: list[str], action: str, *, empty: bool) -> None:
    """Show what a command is about to change (``summary``: what it would do, from its dry
    run; ``lines``: per destination) and ask ``action?`` on the terminal. Off a terminal it
    refuses (exit 2): --yes is the answer there. With nothing to change there is no question."""
    if not terminal.stdin():
        named = [x.strip() for x in lines[:REFUSAL_DESTINATIONS]]
        if len(lines) > REFUSAL_DESTINATIONS:
            named.append(f"… {len(lines) - REFUSAL_DESTINATIONS} more destination(s)")
        detail = f" ({'; '.join(named)})" if named else ""
        raise click.UsageError(
            f"{summary}{detail} and there is no terminal to confirm on: pass --yes to "
            f"{action} (--dry-run shows them and changes nothing)"
        )
    if empty:
        return  # nothing to do: the command says so
    echo(f"{summary}:", err=True)
    for line in lines:
        echo(line, err=True)
    confirm(f"{action}?")


@click.command(short_help="Send events to their endpoints again.")
@database_options
@json_option
@click.argument("event_id", metavar="[ID]", type=ROW_ID, required=False)
@click.option(
    "--endpoint",
    "endpoint_id",
    type=ROW_ID,
    metavar="EID",
    help="With ID: only to this endpoint (added if the event never went to it; refused "
    "unless its tenant and event types take the event). With --since: the endpoint whose "
    "deliveries to replay.",
)
@click.option(
    "--since",
    type=Duration(),
    metavar="DURATION",
    help="Instead of ID: every delivery of --endpoint created in the last DURATION (e.g. "
    "6h) that is not running: ended ones and pending ones (a disabled endpoint's backlog).",
)
@click.option("--failed-only", is_flag=True, help="With --since: only the failed deliveries.")
@click.option("--yes", is_flag=True, help="With --since: do not ask for confirmation.")
def replay(
    database_url: str,
    schema: str,
    as_json: bool,
    event_id: int | None,
    endpoint_id: int | None,
    since: float | None,
    failed_only: bool,
    yes: bool,
) -> None:
    """Send events to their endpoints again, with the same webhook-id.

    `replay ID` puts every delivery of event ID (delivered, failed, cancelled or pending) back
    to pending, due now, attempts afresh, its next attempt logged as a replay; `--endpoint EID`
    only the one to that endpoint. A delivery a relay is sending now is left alone, and so is
    one whose endpoint no longer takes the event (its tenant or event types changed): a replay
    never crosses tenants. `replay --endpoint EID --since 6h [--failed-only]` does it for every
    delivery of the endpoint created in that window that is not running (a disabled
    endpoint's backlog too), and asks first unless --yes."""
    if event_id is None and since is None:
        raise click.UsageError(
            "say what to replay: an event ID (with --endpoint EID for one endpoint only), or "
            "--endpoint EID --since DURATION for an endpoint's recent deliveries"
        )
    if event_id is not None and since is not None:
        raise click.UsageError("give an event ID or --since, not both")
    if since is not None and endpoint_id is None:
        raise click.UsageError("--since replays one endpoint's deliveries: give --endpoint EID")
    if failed_only and since is None:
        raise click.UsageError("--failed-only goes with --endpoint EID --since DURATION")
    if event_id is not None:
        result = with_db(
            database_url, lambda c: admin.replay_event(c, schema, event_id, endpoint_id)
        )
        if as_json:
            echo_json(result)
        else:
            _print_replayed_event(result)
        return
    assert since is not None and endpoint_id is not None
    if not yes:
        _confirm_replay(database_url, schema, endpoint_id, since, failed_only)
    result = with_db(
        database_url,
        lambda c: admin.replay_endpoint(c, schema, endpoint_id, since, failed_only=failed_only),
    )
    if as_json:
        echo_json(result)
    else:
        _print_replayed_endpoint(result)


def _confirm_replay(
    database_url: str, schema: str, endpoint_id: int, since: float, failed_only: bool
) -> None:
    what = "failed" if failed_only else "not running"
    if not terminal.stdin():
        raise click.UsageError(
            f"replaying the {what} deliveries of endpoint {endpoint_id} of the last "
            f"{format_duration(since)} sends them again and there is no terminal to confirm "
            "on: pass --yes to replay them"
        )
    # A transaction of its own: none stays open while someone reads the question.
    preview = with_db(
        database_url,
        lambda c: admin.replay_endpoint(
            c, schema, endpoint_id, since, failed_only=failed_only, dry_run=True
        ),
    )
    if not preview["replayed"]:
        return  # nothing to send: the replay says so
    confirm(
        f"send again {preview['replayed']} {what} deliveries ({_by_status(preview)}) of "
        f"endpoint {endpoint_id} ({preview['origin']}) created in the last "
        f"{format_duration(since)}?"
    )


def _by_status(result: dict[str, Any]) -> str:
    return ", ".join(f"{n} {s}" for s, n in result["by_status"].items())


def _endpoint_named(endpoint_id: int, origin: str | None) -> str:
    return f"endpoint {endpoint_id}" + (f" ({origin})" if origin else "")


def _print_replayed_event(r: dict[str, Any]) -> None:
    event_id = r["event_id"]
    if r["replayed"]:
        echo(
            f"replaying event {event_id} to {r['replayed']} endpoint(s) with the same "
            f"webhook-id ({event_id}): relays send it now"
        )
    else:
        echo(f"nothing replayed for event {event_id}")
    for d in r["deliveries"]:
        name = _endpoint_named(d["endpoint_id"], d["origin"])
        if d["created"]:
            echo(f"  {name}: added (the event had not gone to it)")
        elif d["replayed"]:
            echo(f"  {name}: was {d['was']}")
        elif d["was"] == "running":
            echo(f"  {name}: left alone, running: relay {d['held_by'] or '?'} is sending it now")
        elif d.get("mismatch"):
            echo(f"  {name}: left alone, it no longer takes this event: {d['mismatch']}")
        else:
            echo(f"  {name}: left alone, the endpoint was deleted")
    for eid in r["disabled_endpoints"]:
        echo(
            f"endpoint {eid} is disabled: its replay waits until "
            f"`outbox-relay endpoints enable {eid}`"
        )


def _print_replayed_endpoint(r: dict[str, Any]) -> None:
    name = _endpoint_named(r["endpoint_id"], r["origin"])
    what = "failed" if r["failed_only"] else "not running"
    window = format_duration(r["since_s"])
    if r["replayed"]:
        echo(
            f"replaying {r['replayed']} {what} deliveries of {name} created in the last "
            f"{window} ({_by_status(r)}): relays send them now, with their events' webhook-ids"
        )
    else:
        none = "failed deliveries" if r["failed_only"] else "deliveries (other than running ones)"
        echo(f"no {none} of {name} created in the last {window} to replay")
    if r["skipped_event_gone"]:
        echo(
            f"skipped {r['skipped_event_gone']} whose event is gone (deleted by retention or "
            "purge): nothing to send"
        )
    if r.get("skipped_not_taken"):
        echo(
            f"skipped {r['skipped_not_taken']} whose event the endpoint no longer takes (its "
            "tenant or event types changed since): a replay never crosses tenants"
        )
    if r["replayed"] and not r["endpoint_enabled"]:
        echo(
            f"endpoint {r['endpoint_id']} is disabled: the replays wait until "
            f"`outbox-relay endpoints enable {r['endpoint_id']}`"
        )


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
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (needed off a terminal).")
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

    def run(dry: bool, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        return with_db(
            database_url,
            lambda c: admin.purge(
                c,
                schema,
                older_than=older_than,
                failed=failed,
                destinations=list(destinations) or None,
                batch_size=batch_size,
                dry_run=dry,
                progress=progress,
            ),
        )

    older = format_duration(older_than)
    if not (dry_run or yes):
        preview = run(True)
        _confirm(
            f"would delete {preview['rows']} row(s) older than {older}",
            _purge_lines(preview),
            "delete them",
            empty=not preview["rows"],
        )
    bar = ProgressLine(shown=not (as_json or dry_run))

    def progress(deleted: int, total: int) -> None:
        if total:  # else there is nothing to wait for
            share = min(100, deleted * 100 // total)
            bar.draw(f"purging: {deleted} of {total} row(s) deleted ({share}%)")

    try:
        result = run(dry_run, progress if bar.shown else None)
    finally:
        bar.wipe()
    if as_json:
        echo_json(result)
        return
    if dry_run:
        echo(f"would delete {result['rows']} row(s) older than {older}")
        for line in _purge_lines(result):
            echo(line)
        return
    d = result["deleted"]
    what = f"{d['delivered']} delivered, {d['skipped']} skipped" + (
        f" and {d['failed']} failed" if failed else ""
    )
    echo(f"deleted {what} row(s) older than {older} in {result['batches']} batch(es)")


def _purge_lines(result: dict[str, Any]) -> list[str]:
    return [
        f"  {name}: " + ", ".join(f"{n} {s}" for s, n in sorted(per.items()))
        for name, per in sorted(result["destinations"].items())
    ]


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
        database_url, lambda c: admin.pause(c, schema, destination, by or default_by(), reason)
    )
    if as_json:
        echo_json(result)
    elif result["already_paused"]:
        echo(f"{destination} was already paused (since {result['since']})")
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
    result = with_db(database_url, lambda c: admin.resume(c, schema, destination))
    if as_json:
        echo_json(result)
    elif result["was_paused"]:
        echo(f"resumed {destination}: relays claim it again within one poll interval")
    else:
        echo(f"{destination} was not paused; nothing to do")


@click.command(short_help="Give up on failed rows: mark them skipped.")
@database_options
@json_option
@click.argument("ids", nargs=-1, type=int, required=True)
@click.option("--by", help="Who skips (recorded in last_error); default user@host.")
@click.option("--dry-run", is_flag=True, help="Check the rows; change nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (needed off a terminal).")
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

    def run(dry: bool) -> dict[str, Any]:
        return with_db(database_url, lambda c: admin.skip(c, schema, list(ids), who, dry_run=dry))

    if not (dry_run or yes):
        preview = run(True)
        _confirm(
            f"would skip {preview['rows']} failed row(s), never to be delivered",
            [
                f"  {name}: {d['rows']} (ids {', '.join(map(str, d['ids']))})"
                for name, d in sorted(preview["destinations"].items())
            ],
            "skip them",
            empty=not preview["rows"],
        )
    result = run(dry_run)
    if as_json:
        echo_json(result)
        return
    verb = "would skip" if dry_run else "skipped"
    echo(f"{verb} {result['rows']} row(s): {', '.join(map(str, result['ids']))}")
