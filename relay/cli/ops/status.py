"""`outbox-relay status`: per destination, its rows by state, what is in flight, failures by
error, blocked keys; the relays; the endpoints that need a look; a snapshot holding back
VACUUM. Once, with --fail-if-… rules for scripts (relay.ops.status.problems), or again and
again with --watch."""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from typing import Any

import click

from relay.cli import terminal
from relay.cli.options import (
    EXIT_CONDITION,
    Duration,
    database_options,
    json_option,
    snapshot_warning_option,
    with_db,
)
from relay.cli.render import (
    BAD,
    GOOD,
    WAITING,
    Control,
    Tint,
    age,
    echo,
    echo_json,
    line,
    print_table,
    printable,
)
from relay.durations import format_duration
from relay.ops import status as ops
from relay.ops.status import DestinationStatus, EndpointStatus, RelayStatus, StatusReport

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
    report = with_db(
        database_url, lambda c: ops.status(c, schema, snapshot_warning=snapshot_warning)
    )
    problems = ops.problems(
        report, failed=fail_if_failed, pending_older_than=fail_if_pending_older_than
    )
    if as_json:
        echo_json(_json(report, problems))
    else:
        print_status(report)
    if problems:
        if not as_json:
            echo(Tint(f"problem: {'; '.join(problems)}", BAD), err=True)
        sys.exit(EXIT_CONDITION)


def _json(report: StatusReport, problems: list[str]) -> dict[str, Any]:
    return {**report.to_json(), "problems": problems}


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
            report = with_db(
                database_url,
                lambda c: ops.status(c, schema, snapshot_warning=snapshot_warning),
            )
            if as_json:
                echo(json.dumps(_json(report, []), default=str))
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
                print_status(report)
            shown += 1
            _sleep(interval)
    except KeyboardInterrupt:
        if on_screen and not as_json:
            echo()  # the prompt on a line of its own, after ^C


# Clear the screen, cursor to the top left (as click.clear, which a test cannot see).
CLEAR_SCREEN = "\033[2J\033[1;1H"

# Module attributes, so that a test can stand in for a terminal and for the passing time.
_sleep = time.sleep


# --- the report in text -----------------------------------------------------------------------


def print_status(report: StatusReport) -> None:
    dests = report.destinations
    if not dests:
        echo(f"the outbox in schema {report.schema!r} is empty")
    else:
        print_table([STATUS_COLUMNS, *(_status_row(d) for d in dests)], numbers=True)
    _print_relays(report.relays)
    _print_details(dests)
    _print_endpoints(report)
    _print_snapshot(report.snapshot)


def _print_relays(relays: list[RelayStatus]) -> None:
    if not relays:
        return
    echo()
    echo("relays:")
    for r in relays:
        when = {
            "running": f"seen {age(r.seen_age_s)} ago",
            "silent": f"SILENT for {age(r.seen_age_s)} (killed, or cut off from the database)",
            "stopped": f"stopped at {(r.stopped_at or '')[:19]}",
        }[r.state]
        where = f"{r.host} pid {r.pid}" if r.host else "?"
        serves = ", ".join(r.destinations) or "-"
        state = Tint(r.state, RELAY_COLOURS.get(r.state))
        how = f" (claims by {r.claims})" if r.destinations else ""
        echo(f"  {r.relay_id}: ", state, f" on {where}, {when}; serves {serves}{how}")


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


def _status_row(d: DestinationStatus) -> tuple[str, ...]:
    state = Tint("active", GOOD)
    if d.paused:
        p = d.paused
        paused = f"PAUSED since {(p.since or '')[:19]}" + (f" by {p.by}" if p.by else "")
        if p.reason:
            paused += f": {p.reason}"
        state = Tint(paused, WAITING)
    if d.circuit != "closed":
        # Open in a relay: its rows wait there (the relays' /metrics say which endpoint).
        circuit = f"CIRCUIT {d.circuit.upper().replace('_', '-')}"
        state = Tint(f"{state} {circuit}" if d.paused else circuit, BAD)
    # "~": estimated from the planner's statistics on a large table (see `status` in
    # docs/operations.md); every other count is exact.
    delivered = ("~" if d.delivered_estimated else "") + str(d.delivered)
    return (
        d.destination,
        str(d.pending),
        str(d.due_now),
        age(d.oldest_pending_age_s),
        str(d.running),
        delivered,
        Tint(str(d.failed), BAD if d.failed else None),
        str(d.skipped),
        state,
    )


def _endpoint_state(e: EndpointStatus) -> str:
    if e.enabled:
        return Tint("enabled", GOOD)
    reason = e.disabled_reason
    return Tint("DISABLED" + (f": {line(reason, 80)}" if reason else ""), BAD)


ENDPOINT_COLUMNS = (
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


def _endpoint_row(e: EndpointStatus) -> tuple[str, ...]:
    last_http = e.last_http_status
    return (
        str(e.id),
        e.destination,
        e.origin or "-",
        str(e.pending),
        age(e.oldest_pending_age_s),
        (e.failing_since or "-")[:19],
        str(last_http) if last_http else "none" if e.last_attempt_at else "-",
        (e.last_success_at or "-")[:19],
        Tint(f"open until {e.circuit_open_until[11:19]}", BAD)
        if e.circuit_open_until
        else "closed",
        _endpoint_state(e),
    )


def _print_endpoints(report: StatusReport) -> None:
    """The endpoints of `endpoints` destinations: those that need a look first."""
    total = report.endpoints_total
    if not total:
        return
    listed = report.endpoints
    attention = report.endpoints_needing_attention
    echo()
    echo(
        f"endpoints ({total} registered; {attention} with pending deliveries, failing or disabled):"
    )
    print_table([ENDPOINT_COLUMNS, *(_endpoint_row(e) for e in listed)], indent="  ")
    rest = total - len(listed)
    if rest:
        rest_attention = attention - sum(1 for e in listed if e.needs_a_look())
        echo(
            f"  … {rest} more endpoint(s) not listed"
            + (
                f", {rest_attention} of them with pending deliveries, failing or disabled"
                if rest_attention
                else ": enabled, not failing, nothing pending"
            )
            + " (`outbox-relay endpoints list`, `outbox-relay endpoints show ID`)"
        )


def _print_details(dests: list[DestinationStatus]) -> None:
    """What needs attention: leases held, failures by error, blocked keys."""
    leases = [(d.destination, x) for d in dests for x in d.in_flight]
    if leases:
        echo()
        echo("in flight:")
        for name, x in leases:
            left = x.lease_left_s
            lease = (
                f"lease {format_duration(left)} left"
                if left is not None and left >= 0
                else Tint("LEASE EXPIRED", BAD)
            )
            echo(f"  {name}: {x.rows} row(s) held by {x.relay} (", lease, ")")
    errors = [(d.destination, e) for d in dests for e in d.failed_errors]
    if errors:
        echo()
        echo("failed (retry with `outbox-relay retry --destination NAME`):")
        for name, e in errors:
            err = printable(e.error or "no error recorded", 160)
            echo(f"  {name}: {e.rows} x {err}")
    blocked = [(d.destination, b) for d in dests for b in d.blocked_keys]
    if blocked:
        echo()
        echo(
            "keys with a failed row ahead of pending rows (they wait where the destination "
            'has ordering = "key" and poison_policy = "block"; unblock with '
            "`outbox-relay retry --id ID` or `outbox-relay skip ID`):"
        )
        for name, b in blocked:
            echo(
                f"  {name}: key {b.key!r} held by failed row {b.failed_id}, "
                f"{b.waiting} row(s) waiting: {printable(b.error or '', 120)}"
            )
