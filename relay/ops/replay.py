"""`replay`: an event sent to its endpoints again, with the same webhook-id (to one endpoint,
added if it never went there); or an endpoint's deliveries of a window, confirmed first where
a preview counted them (relay/ops/selection.py). A replay goes only where fan-out would send
the event: never to another tenant's endpoint."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg

from outbox.status import Status
from relay.db.queries import serial_key
from relay.ops import queries, replay_queries
from relay.ops.common import AdminError, Result, check_tables, origin, sql
from relay.ops.selection import Selection, exactly, same, select

ENDED = ("delivered", "failed", "cancelled")
# A longer --since is every delivery (PostgreSQL intervals end somewhere).
MAX_REPLAY_WINDOW = 100 * 365 * 86400.0


@dataclass(frozen=True)
class ReplayedDelivery(Result):
    endpoint_id: int
    origin: str | None
    was: str | None  # its status before; None: added by the replay
    replayed: bool
    created: bool
    held_by: str | None  # the relay sending it now (left alone)
    endpoint_deleted: bool
    endpoint_enabled: bool | None
    # Why the endpoint no longer takes the event (its tenant or types changed since the
    # fan-out), or None: such a delivery is not replayed.
    mismatch: str | None


@dataclass(frozen=True)
class ReplayedEvent(Result):
    event_id: int
    destination: str
    endpoint_id: int | None
    replayed: int
    created: int
    running: int
    endpoint_deleted: int
    mismatched: int
    disabled_endpoints: list[int]
    deliveries: list[ReplayedDelivery]


@dataclass(frozen=True)
class ReplayedEndpoint(Result):
    endpoint_id: int
    destination: str
    origin: str | None
    endpoint_enabled: bool
    since_s: float
    failed_only: bool
    replayed: int
    by_status: dict[str, int]
    skipped_event_gone: int
    skipped_not_taken: int


async def _check_replay_tables(conn: asyncpg.Connection, schema: str) -> None:
    await check_tables(conn, schema)
    deliveries = queries.qualified_table(schema, "outbox_deliveries")
    if not await conn.fetchval(queries.COLUMN_EXISTS, deliveries, "replay"):
        raise AdminError(
            f"no outbox_deliveries.replay column in schema {schema!r} (migrations 0006 and "
            "0007): run `outbox-relay migrate` (with the same --database-url and --schema)"
        )


async def _endpoint(conn: asyncpg.Connection, schema: str, endpoint_id: int) -> asyncpg.Record:
    endpoint = await conn.fetchrow(sql(replay_queries.REPLAY_ENDPOINT_ROW, schema), endpoint_id)
    if endpoint is None:
        raise AdminError(
            f"no endpoint {endpoint_id} (`outbox-relay endpoints list` shows them). "
            "Nothing changed."
        )
    return endpoint


def _mismatch(endpoint: Mapping[str, Any], event: Mapping[str, Any]) -> str | None:
    """Why ``endpoint`` does not take ``event`` (the rule fan-out applies), or None."""
    tenant, types = endpoint["tenant"], list(endpoint["event_types"] or ())
    if tenant is not None and tenant != event["tenant"]:
        theirs = "has no tenant" if event["tenant"] is None else f"is of tenant {event['tenant']!r}"
        return f"the endpoint takes tenant {tenant!r} only and the event {theirs}"
    if types and event["event_type"] not in types:
        theirs = (
            "has no event type"
            if event["event_type"] is None
            else f"is of type {event['event_type']!r}"
        )
        return f"the endpoint takes event types {', '.join(types)} only and the event {theirs}"
    return None


# --- one event ------------------------------------------------------------------------------


async def replay_event(
    conn: asyncpg.Connection, schema: str, event_id: int, endpoint_id: int | None = None
) -> ReplayedEvent:
    """Send an event to its endpoints again (to ``endpoint_id`` only, if given), with the same
    webhook-id: its deliveries go back to pending as replays, due now, their attempts afresh,
    whatever their state but running (a relay is sending it). With ``endpoint_id`` and no
    delivery to it yet, one is added, under the fan-outs' lock (held to the commit: called in
    a transaction of the caller's, this holds every relay's fan-outs into ``schema`` until
    that transaction ends)."""
    await _check_replay_tables(conn, schema)
    async with conn.transaction():
        event = await _event(conn, schema, event_id)
        endpoint = None
        if endpoint_id is not None:
            endpoint = await _endpoint(conn, schema, endpoint_id)
            _check_takes(endpoint, endpoint_id, event, event_id)
        _check_sent(event, event_id)
        deliveries = await _replay_deliveries(conn, schema, event, endpoint, endpoint_id)
        replayed = [d for d in deliveries if d.replayed]
        if replayed:
            # At commit; the payload wakes the relays' endpoint deliveries, not only claims.
            await conn.execute(queries.NOTIFY_ENDPOINTS, f"{schema}.outbox")
    return ReplayedEvent(
        event_id=event_id,
        destination=event["destination"],
        endpoint_id=endpoint_id,
        replayed=len(replayed),
        created=sum(1 for d in deliveries if d.created),
        running=sum(1 for d in deliveries if d.was == "running"),
        endpoint_deleted=sum(1 for d in deliveries if d.endpoint_deleted),
        mismatched=sum(1 for d in deliveries if d.mismatch is not None),
        disabled_endpoints=[d.endpoint_id for d in replayed if not d.endpoint_enabled],
        deliveries=deliveries,
    )


async def _event(conn: asyncpg.Connection, schema: str, event_id: int) -> asyncpg.Record:
    """The event, locked; refused if it is gone."""
    event = await conn.fetchrow(sql(replay_queries.REPLAY_EVENT_ROW, schema), event_id)
    if event is None:
        raise AdminError(
            f"no outbox row with id {event_id}: it was deleted (by retention or purge) or "
            "never existed, so there is no payload to send again. Nothing changed."
        )
    return event


def _check_sent(event: asyncpg.Record, event_id: int) -> None:
    """Refuse an event no relay has fanned out yet."""
    if event["status"] in (Status.PENDING, Status.RUNNING):
        raise AdminError(
            f"event {event_id} is {event['status']}: no relay has sent it yet (relays fan "
            "it out to its endpoints when they deliver it), so there is nothing to replay. "
            "Nothing changed."
        )


def _check_takes(
    endpoint: asyncpg.Record, endpoint_id: int, event: asyncpg.Record, event_id: int
) -> None:
    """Refuse a replay to an endpoint fan-out would not send the event to."""
    destination = event["destination"]
    if endpoint["destination"] != destination:
        raise AdminError(
            f"endpoint {endpoint_id} is an endpoint of {endpoint['destination']!r} and "
            f"event {event_id} an event of {destination!r}: an event goes only to the "
            "endpoints of its own destination. Nothing changed."
        )
    if (mismatch := _mismatch(endpoint, event)) is not None:
        raise AdminError(
            f"endpoint {endpoint_id} does not take event {event_id}: {mismatch}. A "
            "replay goes only where fan-out would send the event, so that one "
            "tenant's events never reach another's endpoint. Nothing changed."
        )


async def _replay_deliveries(
    conn: asyncpg.Connection,
    schema: str,
    event: asyncpg.Record,
    endpoint: asyncpg.Record | None,
    endpoint_id: int | None,
) -> list[ReplayedDelivery]:
    """The event's deliveries put back to pending (those left alone too), or the one added
    to ``endpoint``; refused if there is none."""
    event_id, destination = event["id"], event["destination"]
    replay = sql(replay_queries.REPLAY_EVENT, schema)
    rows = await conn.fetch(replay, event_id, endpoint_id)
    created = False
    if not rows and endpoint is not None:
        added = await conn.fetchval(
            sql(replay_queries.REPLAY_EVENT_INSERT, schema),
            event_id,
            endpoint_id,
            destination,
            serial_key(schema),
        )
        created = added is not None
        if not created:  # another session added it meanwhile: replay that one
            rows = await conn.fetch(replay, event_id, endpoint_id)
    if not rows and not created:
        raise AdminError(
            f"event {event_id} of {destination!r} has no deliveries: its destination is not "
            "of kind `endpoints`, or no endpoint took the event. `--endpoint EID` sends it "
            "to one endpoint of its destination. Nothing changed."
        )
    deliveries = [
        ReplayedDelivery(
            endpoint_id=r["endpoint_id"],
            origin=origin(r["url"]),
            was=r["status"],
            replayed=r["replayed"],
            created=False,
            held_by=r["locked_by"] if r["status"] == "running" else None,
            endpoint_deleted=not r["endpoint_exists"],
            endpoint_enabled=r["enabled"] if r["endpoint_exists"] else None,
            mismatch=_mismatch(r, event) if r["endpoint_exists"] and not r["takes"] else None,
        )
        for r in rows
    ]
    if created:
        assert endpoint is not None and endpoint_id is not None
        deliveries.append(
            ReplayedDelivery(
                endpoint_id=endpoint_id,
                origin=origin(endpoint["url"]),
                was=None,
                replayed=True,
                created=True,
                held_by=None,
                endpoint_deleted=False,
                endpoint_enabled=endpoint["enabled"],
                mismatch=None,
            )
        )
    return deliveries


# --- an endpoint's window -------------------------------------------------------------------


async def replay_endpoint_preview(
    conn: asyncpg.Connection, schema: str, endpoint_id: int, since: float, *, failed_only: bool
) -> tuple[ReplayedEndpoint, Selection]:
    """replay_endpoint's dry run, and the selection of deliveries that confirms it
    (``replay_endpoint(within=…)``), read in one snapshot."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        counted = await replay_endpoint(
            conn, schema, endpoint_id, since, failed_only=failed_only, dry_run=True
        )
        window = _replay_window(endpoint_id, since, failed_only, None)
        selection = await select(
            conn, replay_queries.REPLAY_ENDPOINT_SELECTION, schema, *window, None, None
        )
    return counted, selection


def _replay_statuses(failed_only: bool) -> list[str]:
    """The deliveries a window replays: every one not running (a disabled endpoint's
    backlog too), or the failed ones."""
    return ["failed"] if failed_only else [*ENDED, "pending"]


def _replay_window(
    endpoint_id: int, since: float, failed_only: bool, within: Selection | None
) -> tuple[Any, ...]:
    """The arguments of the replay statements: their window, and a selection's bounds (for
    replay_endpoint_within and replay_endpoint_selection in relay/ops/replay.sql)."""
    statuses = _replay_statuses(failed_only)
    window = (endpoint_id, min(since, MAX_REPLAY_WINDOW), statuses)
    return window if within is None else (*window, within.max_id, within.at)


async def replay_endpoint(
    conn: asyncpg.Connection,
    schema: str,
    endpoint_id: int,
    since: float,
    *,
    failed_only: bool,
    dry_run: bool = False,
    within: Selection | None = None,
) -> ReplayedEndpoint:
    """Send again every delivery of an endpoint created in the last ``since`` seconds that
    is not running (only the failed ones with ``failed_only``): ended ones, and pending ones
    (a disabled endpoint's backlog, deliveries backing off), as replays due now. Those whose
    event is gone, and those whose event the endpoint no longer takes (its tenant or event
    types changed since), are counted and left as they are. ``dry_run`` counts and changes
    nothing. ``within``: only
    the deliveries of that selection (from replay_endpoint_preview, the window measured from
    its clock), or SelectionChanged if they are no longer the ones that match."""
    await _check_replay_tables(conn, schema)
    statuses = _replay_statuses(failed_only)
    args = _replay_window(endpoint_id, since, failed_only, within)
    exact = within is not None and not dry_run
    # Exact: one snapshot for the check and the change, as retry does.
    async with conn.transaction(readonly=dry_run, isolation="repeatable_read" if exact else None):
        endpoint = await _endpoint(conn, schema, endpoint_id)
        if exact:
            assert within is not None
            found = await select(conn, replay_queries.REPLAY_ENDPOINT_SELECTION, schema, *args)
            same(found, within)
        if dry_run:
            statement = replay_queries.REPLAY_ENDPOINT_PREVIEW
            args = args[:3]  # a dry run counts the window as it is now
        else:
            statement = (
                replay_queries.REPLAY_ENDPOINT_WITHIN if exact else replay_queries.REPLAY_ENDPOINT
            )
        replaying = conn.fetch(sql(statement, schema), *args)
        rows = await (exactly(replaying) if exact else replaying)
        by_status, gone, mismatched = _tally(rows, statuses)
        replayed = sum(by_status.values())
        if replayed and not dry_run:
            await conn.execute(queries.NOTIFY_ENDPOINTS, f"{schema}.outbox")  # as above
    return ReplayedEndpoint(
        endpoint_id=endpoint_id,
        destination=endpoint["destination"],
        origin=origin(endpoint["url"]),
        endpoint_enabled=endpoint["enabled"],
        since_s=since,
        failed_only=failed_only,
        replayed=replayed,
        by_status=by_status,
        skipped_event_gone=gone,
        skipped_not_taken=mismatched,
    )


def _tally(rows: list[asyncpg.Record], statuses: list[str]) -> tuple[dict[str, int], int, int]:
    """The deliveries replayed by status; those whose event is gone; those whose event the
    endpoint no longer takes."""
    by_status = dict.fromkeys(statuses, 0)
    gone = mismatched = 0
    for r in rows:
        if not r["found"]:
            gone += r["n"]
        elif not r["takes"]:
            mismatched += r["n"]
        else:
            by_status[r["status"]] += r["n"]
    return by_status, gone, mismatched
