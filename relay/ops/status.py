"""`status`: per destination, its rows by state, leases held, failures by error, blocked keys
and whether it is paused or its circuit open; the relays; the endpoints that need a look; the
oldest snapshot holding back VACUUM. Read in one snapshot, so that the parts agree."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from outbox.status import Status
from relay.db.snapshots import DEFAULT_WARNING, oldest_holder
from relay.durations import format_duration
from relay.ops import queries
from relay.ops.common import (
    Result,
    check_tables,
    from_record,
    has_endpoint_tables,
    iso,
    origin,
    seconds,
    sql,
)

COUNTS = ("pending", "due_now", "running", "delivered", "failed", "skipped")

# Delivered rows are counted exactly up to this many (an index-only probe, then one pass
# over them); past it `delivered` is estimated from the table's statistics, and
# "delivered_estimated" says so. Pending, running, failed and skipped rows are always counted.
DELIVERED_EXACT_UP_TO = 100_000
# With estimated counts, each destination's last delivery is looked for among this many of
# the newest deliveries (None when it is older).
LATEST_DELIVERIES_READ = 10_000
# A running relay refreshes its registration at least every 10 s.
RELAY_SILENT_AFTER = 30.0
# Endpoints listed by `status`, those that need a look first; the others are counted.
STATUS_ENDPOINTS_LISTED = 50


@dataclass(frozen=True)
class Lease(Result):
    relay: str
    rows: int
    lease_left_s: float | None


@dataclass(frozen=True)
class FailedError(Result):
    error: str | None
    rows: int


@dataclass(frozen=True)
class BlockedKey(Result):
    key: str
    failed_id: int
    waiting: int
    error: str | None


@dataclass(frozen=True)
class Paused(Result):
    since: str | None
    by: str | None
    reason: str | None


@dataclass(frozen=True)
class DestinationStatus(Result):
    destination: str
    paused: Paused | None
    pending: int
    due_now: int
    running: int
    delivered: int
    failed: int
    skipped: int
    delivered_estimated: bool
    oldest_pending_age_s: float | None
    last_delivered_at: str | None
    in_flight: list[Lease]
    failed_errors: list[FailedError]
    blocked_keys: list[BlockedKey]
    # Across the running relays: open if one has it open, half_open if one probes, else closed.
    circuit: str
    circuit_relays: list[str]


@dataclass(frozen=True)
class Totals(Result):
    pending: int
    due_now: int
    running: int
    delivered: int
    failed: int
    skipped: int


@dataclass(frozen=True)
class RelayStatus(Result):
    relay_id: str
    state: str  # running, silent (killed, or cut off from the database) or stopped
    host: str | None
    pid: int | None
    version: str | None
    destinations: list[str]
    started_at: str | None
    seen_at: str | None
    seen_age_s: float
    stopped_at: str | None
    circuits: dict[str, str]
    claims: str  # how it claims its unordered destinations: batch (leases) or row


@dataclass(frozen=True)
class EndpointStatus(Result):
    id: int
    destination: str
    origin: str | None
    enabled: bool
    disabled_reason: str | None
    disabled_at: str | None
    pending: int
    oldest_pending_age_s: float | None
    failing_since: str | None
    last_http_status: int | None
    last_attempt_at: str | None
    last_success_at: str | None
    # Open in at least one relay until then (each relay has its own breaker).
    circuit: str
    circuit_open_until: str | None

    def needs_a_look(self) -> bool:
        return bool(self.pending or self.failing_since or not self.enabled)


@dataclass(frozen=True)
class StatusReport(Result):
    schema: str
    destinations: list[DestinationStatus]
    totals: Totals
    delivered_estimated: bool
    relays: list[RelayStatus]
    endpoints: list[EndpointStatus]
    endpoints_total: int
    endpoints_needing_attention: int
    # The oldest snapshot holding back VACUUM (relay.db.snapshots), None if there is none.
    snapshot: dict[str, Any] | None


Delivered = dict[str, tuple[int, datetime | None]]


@dataclass(frozen=True)
class _Read:
    """What status reads in its one snapshot."""

    counts: list[Mapping[str, Any]]
    ended: list[asyncpg.Record]
    relays: list[asyncpg.Record]
    delivered: Delivered
    estimated: bool
    leases: list[asyncpg.Record]  # and status_batched's rows
    paused: list[asyncpg.Record]
    blocked: list[asyncpg.Record]
    endpoints: list[asyncpg.Record]


async def status(
    conn: asyncpg.Connection, schema: str, *, snapshot_warning: float = DEFAULT_WARNING
) -> StatusReport:
    """Per destination: row counts, leases held, failures by error, blocked keys, whether it
    is paused; and the relays. One snapshot (repeatable read), so the parts agree. Then the
    oldest snapshot holding back VACUUM (``snapshot``, None if none), over ``snapshot_warning``
    seconds or not.

    Every count is exact but ``delivered`` when the table keeps more than
    DELIVERED_EXACT_UP_TO delivered rows: it is then estimated (three significant digits,
    ``delivered_estimated``), as counting them would read the whole table."""
    await check_tables(conn, schema)
    read = await _read(conn, schema)
    # Once the snapshot of the counts is let go: the holders' own ages, not this one's.
    holder = await oldest_holder(conn)
    relays = [_relay(r) for r in read.relays]
    rows = _destinations(read, relays)
    endpoints = read.endpoints
    return StatusReport(
        schema=schema,
        destinations=rows,
        totals=Totals(**{k: sum(getattr(d, k) for d in rows) for k in COUNTS}),
        delivered_estimated=read.estimated,
        relays=relays,
        endpoints=[_endpoint_status(r) for r in endpoints],
        endpoints_total=endpoints[0]["total"] if endpoints else 0,
        endpoints_needing_attention=endpoints[0]["needing_attention"] if endpoints else 0,
        snapshot=holder.as_json(snapshot_warning) if holder is not None else None,
    )


def _in_batches(
    counts: Sequence[Mapping[str, Any]], batched: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """``counts`` (status_counts) with the rows in flight under batch leases (status_batched)
    counted running, not pending (the table shows them pending, and due)."""
    if not batched:
        return list(counts)
    flying: dict[str, int] = {}
    for r in batched:
        flying[r["destination"]] = flying.get(r["destination"], 0) + r["rows"]
    out: list[Mapping[str, Any]] = []
    for r in counts:
        n = flying.get(r["destination"], 0)
        row = dict(r)
        # A batch's rows are fresh, so pending and due; the counts are of one snapshot.
        row.update(
            pending=max(row["pending"] - n, 0),
            due=max(row["due"] - n, 0),
            running=row["running"] + n,
        )
        out.append(row)
    return out


async def _read(conn: asyncpg.Connection, schema: str) -> _Read:
    has_endpoints = await has_endpoint_tables(conn, schema)
    has_batches = await conn.fetchval(
        queries.TABLE_EXISTS, queries.qualified_table(schema, queries.BATCHES_TABLE)
    )
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        await conn.execute(queries.JIT_OFF)
        counts = await conn.fetch(sql(queries.STATUS_COUNTS, schema))
        batched = await conn.fetch(sql(queries.STATUS_BATCHED, schema)) if has_batches else []
        counts = _in_batches(counts, batched)
        ended = await conn.fetch(sql(queries.STATUS_ENDED, schema))
        counted = {r["destination"]: r["pending"] + r["running"] for r in counts}
        for r in ended:
            counted[r["destination"]] = counted.get(r["destination"], 0) + r["rows"]
        relays = await conn.fetch(sql(queries.RELAYS, schema))
        served = {d for r in relays for d in r["destinations"]}
        delivered, estimated = await _delivered(conn, schema, counted, served)
        return _Read(
            counts=counts,
            ended=ended,
            relays=relays,
            delivered=delivered,
            estimated=estimated,
            leases=[*await conn.fetch(sql(queries.STATUS_LEASES, schema)), *batched],
            paused=await conn.fetch(sql(queries.PAUSED_DETAIL, schema)),
            blocked=await conn.fetch(sql(queries.STATUS_BLOCKED_KEYS, schema)),
            endpoints=(
                await conn.fetch(sql(queries.STATUS_ENDPOINTS, schema), STATUS_ENDPOINTS_LISTED)
                if has_endpoints
                else []
            ),
        )


def _destinations(read: _Read, relays: list[RelayStatus]) -> list[DestinationStatus]:
    """Each destination with rows or a pause, by name."""
    parts = (read.counts, read.leases, read.ended, read.blocked, read.paused)
    names = {r["destination"] for rows in parts for r in rows} | set(read.delivered)
    counts = {r["destination"]: r for r in read.counts}
    paused = {r["destination"]: r for r in read.paused}
    return [
        _destination(name, counts.get(name), paused.get(name), read, relays)
        for name in sorted(names)
    ]


def _destination(
    name: str,
    counts: Mapping[str, Any] | None,
    paused: asyncpg.Record | None,
    read: _Read,
    relays: list[RelayStatus],
) -> DestinationStatus:
    ended = [r for r in read.ended if r["destination"] == name]
    failed = [r for r in ended if r["status"] == Status.FAILED]
    delivered, last = read.delivered.get(name, (0, None))
    oldest = counts["oldest_pending_age"] if counts is not None else None
    return DestinationStatus(
        destination=name,
        paused=Paused(iso(paused["paused_at"]), paused["paused_by"], paused["reason"])
        if paused is not None
        else None,
        pending=counts["pending"] if counts is not None else 0,
        due_now=counts["due"] if counts is not None else 0,
        running=counts["running"] if counts is not None else 0,
        delivered=delivered,
        failed=sum(r["rows"] for r in failed),
        skipped=sum(r["rows"] for r in ended if r["status"] != Status.FAILED),
        delivered_estimated=read.estimated,
        oldest_pending_age_s=round(oldest, 3) if oldest is not None else None,
        last_delivered_at=iso(last),
        in_flight=[
            Lease(r["locked_by"], r["rows"], seconds(r["lease_left"]))
            for r in read.leases
            if r["destination"] == name
        ],
        failed_errors=[FailedError(r["last_error"], r["rows"]) for r in failed],
        blocked_keys=[
            BlockedKey(r["key"], r["failed_id"], r["waiting"], r["last_error"])
            for r in read.blocked
            if r["destination"] == name
        ],
        **_circuit(name, relays),
    )


async def _delivered(
    conn: asyncpg.Connection, schema: str, counted: dict[str, int], served: set[str]
) -> tuple[Delivered, bool]:
    """Delivered rows and the last delivery per destination, and whether they are estimates;
    ``counted``: the rows of each destination counted otherwise (pending, running, failed,
    skipped); ``served``: the destinations the registered relays serve."""
    few = await conn.fetchval(
        sql(queries.STATUS_DELIVERED_PROBE, schema), DELIVERED_EXACT_UP_TO + 1
    )
    stats = None
    if few > DELIVERED_EXACT_UP_TO:
        stats = await conn.fetchrow(
            queries.STATUS_ESTIMATE, queries.qualified_table(schema), schema
        )
    if stats is None or not stats["analyzed"] or stats["reltuples"] < 0:
        # Few enough, or never analyzed (autovacuum will): counted.
        return await _delivered_exactly(conn, schema), False
    latest = await conn.fetch(sql(queries.STATUS_DELIVERED_LATEST, schema), LATEST_DELIVERIES_READ)
    last = {r["destination"]: r["last_delivered_at"] for r in latest}
    shares, rest = _destination_shares(stats)
    if (set(counted) | set(last) | served) - set(shares):
        # A destination the statistics do not list (new since the last ANALYZE): a share
        # would credit its rows to the others, or leave it out. Counted instead, slower.
        return await _delivered_exactly(conn, schema), False
    # The table's rows now, as the planner reckons them: rows per page at the last VACUUM or
    # ANALYZE times the pages it has now.
    rows = stats["reltuples"]
    if stats["relpages"] > 0:
        rows = rows / stats["relpages"] * stats["pages"]
    names = set(counted) | set(last) | set(shares)
    return {
        name: (
            _approximately(max(0.0, rows * shares.get(name, rest) - counted.get(name, 0))),
            last.get(name),
        )
        for name in names
    }, True


async def _delivered_exactly(conn: asyncpg.Connection, schema: str) -> Delivered:
    exact = await conn.fetch(sql(queries.STATUS_DELIVERED, schema))
    return {r["destination"]: (r["delivered"], r["last_delivered_at"]) for r in exact}


def _destination_shares(stats: asyncpg.Record) -> tuple[dict[str, float], float]:
    """Each common destination's share of the rows (pg_stats), and that of any other one."""
    common = list(stats["common"] or [])
    freqs = list(stats["freqs"] or [])
    shares = dict(zip(common, freqs, strict=True))
    distinct = stats["n_distinct"]
    if distinct < 0:  # a fraction of the rows
        distinct = -distinct * max(stats["reltuples"], 0.0)
    others = max(1.0, distinct - len(common))
    rest = max(0.0, 1.0 - sum(freqs) - (stats["null_frac"] or 0.0)) / others
    return shares, rest


def _approximately(n: float) -> int:
    """``n`` to three significant digits: an estimate with the precision it has."""
    whole = round(n)
    digits = len(str(whole)) - 3
    return round(whole, -digits) if digits > 0 else whole


def _relay(r: asyncpg.Record) -> RelayStatus:
    if r["stopped_at"] is not None:
        state = "stopped"
    elif r["seen_age"] > RELAY_SILENT_AFTER:
        state = "silent"  # stopped without saying so (killed), or cut off from the database
    else:
        state = "running"
    return from_record(
        RelayStatus,
        r,
        state=state,
        destinations=list(r["destinations"]),
        seen_age_s=round(r["seen_age"], 3),
        circuits=json.loads(r["circuits"]) if state == "running" else {},
    )


def _circuit(destination: str, relays: list[RelayStatus]) -> dict[str, Any]:
    """A destination's circuit across the running relays: open if one has it open (its
    deliveries wait there), half-open if one is probing, else closed."""
    states = {r.relay_id: r.circuits[destination] for r in relays if destination in r.circuits}
    seen = set(states.values())
    circuit = "open" if "open" in seen else "half_open" if "half_open" in seen else "closed"
    return {"circuit": circuit, "circuit_relays": sorted(states)}


def _endpoint_status(r: asyncpg.Record) -> EndpointStatus:
    return from_record(
        EndpointStatus,
        r,
        origin=origin(r["url"]),
        oldest_pending_age_s=seconds(r["oldest_pending_age"]),
        circuit="open" if r["circuit_open_until"] is not None else "closed",
    )


# --- what `status --fail-if-…` judges ---------------------------------------------------------


def problems(
    report: StatusReport, *, failed: bool = False, pending_older_than: float | None = None
) -> list[str]:
    """What is wrong in ``report``, one phrase each: any failed row (with ``failed``); rows
    pending longer than ``pending_older_than`` seconds, or an enabled endpoint's deliveries."""
    found = []
    if failed and report.totals.failed:
        found.append(f"{report.totals.failed} failed row(s)")
    if pending_older_than is None:
        return found
    older = format_duration(pending_older_than)
    late = [
        d.destination
        for d in report.destinations
        if (d.oldest_pending_age_s or 0) > pending_older_than
    ]
    if late:
        found.append(f"pending rows older than {older} in {', '.join(late)}")
    # Events of endpoints destinations are delivered once fanned out: their waiting is in
    # their deliveries, per endpoint (a disabled endpoint's wait on purpose).
    stuck = [
        f"endpoint {e.id}"
        for e in report.endpoints
        if e.enabled and (e.oldest_pending_age_s or 0) > pending_older_than
    ]
    if stuck:
        found.append(f"pending deliveries older than {older} for {', '.join(stuck)}")
    return found
