"""`outbox-relay replay`: an event sent to its endpoints again, with the same webhook-id; or
an endpoint's deliveries of a recent window, asked first on a terminal."""

from __future__ import annotations

import click

from relay.cli import terminal
from relay.cli.ops.rows import ROW_ID
from relay.cli.options import Duration, database_options, json_option, with_db, yes_option
from relay.cli.render import confirm, echo, echo_json
from relay.durations import format_duration
from relay.ops import replay as ops
from relay.ops.replay import ReplayedEndpoint, ReplayedEvent


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
@yes_option("With --since: do not ask for confirmation.")
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
    _check_usage(event_id, endpoint_id, since, failed_only)
    if event_id is not None:
        event = with_db(database_url, lambda c: ops.replay_event(c, schema, event_id, endpoint_id))
        if as_json:
            echo_json(event.to_json())
        else:
            _print_replayed_event(event)
        return
    assert since is not None and endpoint_id is not None
    if not yes:
        _confirm_replay(database_url, schema, endpoint_id, since, failed_only)
    window = with_db(
        database_url,
        lambda c: ops.replay_endpoint(c, schema, endpoint_id, since, failed_only=failed_only),
    )
    if as_json:
        echo_json(window.to_json())
    else:
        _print_replayed_endpoint(window)


def _check_usage(
    event_id: int | None, endpoint_id: int | None, since: float | None, failed_only: bool
) -> None:
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
        lambda c: ops.replay_endpoint(
            c, schema, endpoint_id, since, failed_only=failed_only, dry_run=True
        ),
    )
    if not preview.replayed:
        return  # nothing to send: the replay says so
    confirm(
        f"send again {preview.replayed} {what} deliveries ({_by_status(preview)}) of "
        f"endpoint {endpoint_id} ({preview.origin}) created in the last "
        f"{format_duration(since)}?"
    )


def _by_status(result: ReplayedEndpoint) -> str:
    return ", ".join(f"{n} {s}" for s, n in result.by_status.items())


def _endpoint_named(endpoint_id: int, origin: str | None) -> str:
    return f"endpoint {endpoint_id}" + (f" ({origin})" if origin else "")


def _print_replayed_event(r: ReplayedEvent) -> None:
    event_id = r.event_id
    if r.replayed:
        echo(
            f"replaying event {event_id} to {r.replayed} endpoint(s) with the same "
            f"webhook-id ({event_id}): relays send it now"
        )
    else:
        echo(f"nothing replayed for event {event_id}")
    for d in r.deliveries:
        name = _endpoint_named(d.endpoint_id, d.origin)
        if d.created:
            echo(f"  {name}: added (the event had not gone to it)")
        elif d.replayed:
            echo(f"  {name}: was {d.was}")
        elif d.was == "running":
            echo(f"  {name}: left alone, running: relay {d.held_by or '?'} is sending it now")
        elif d.mismatch:
            echo(f"  {name}: left alone, it no longer takes this event: {d.mismatch}")
        else:
            echo(f"  {name}: left alone, the endpoint was deleted")
    for eid in r.disabled_endpoints:
        echo(
            f"endpoint {eid} is disabled: its replay waits until "
            f"`outbox-relay endpoints enable {eid}`"
        )


def _print_replayed_endpoint(r: ReplayedEndpoint) -> None:
    name = _endpoint_named(r.endpoint_id, r.origin)
    what = "failed" if r.failed_only else "not running"
    window = format_duration(r.since_s)
    if r.replayed:
        echo(
            f"replaying {r.replayed} {what} deliveries of {name} created in the last "
            f"{window} ({_by_status(r)}): relays send them now, with their events' webhook-ids"
        )
    else:
        none = "failed deliveries" if r.failed_only else "deliveries (other than running ones)"
        echo(f"no {none} of {name} created in the last {window} to replay")
    if r.skipped_event_gone:
        echo(
            f"skipped {r.skipped_event_gone} whose event is gone (deleted by retention or "
            "purge): nothing to send"
        )
    if r.skipped_not_taken:
        echo(
            f"skipped {r.skipped_not_taken} whose event the endpoint no longer takes (its "
            "tenant or event types changed since): a replay never crosses tenants"
        )
    if r.replayed and not r.endpoint_enabled:
        echo(
            f"endpoint {r.endpoint_id} is disabled: the replays wait until "
            f"`outbox-relay endpoints enable {r.endpoint_id}`"
        )
