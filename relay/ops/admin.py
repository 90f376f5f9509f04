"""What the operations commands do, as plain async functions returning JSON-ready data.

``relay.cli`` renders their results for people (or as JSON); tests call the CLI.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import urlsplit

import asyncpg

from outbox.status import Status
from relay.db.snapshots import DEFAULT_WARNING, oldest_holder
from relay.ops import queries

T = TypeVar("T")


class AdminError(Exception):
    """The request cannot be carried out; the message says why and what to do."""


def _iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts is not None else None


def _sql(sql: str, schema: str) -> str:
    return queries.render_ops(sql, schema)


async def _check_tables(conn: asyncpg.Connection, schema: str) -> None:
    for table in ("outbox", queries.PAUSED_TABLE, queries.RELAYS_TABLE):
        if not await conn.fetchval(queries.TABLE_EXISTS, queries.qualified_table(schema, table)):
            raise AdminError(
                f"no {table} table in schema {schema!r}: run `outbox-relay migrate` "
                "(with the same --database-url and --schema)"
            )


# --- endpoints (kind = "endpoints"): what show, status and replay say about them -----------


def origin(url: str | None) -> str | None:
    """``scheme://host[:port]`` of an endpoint's URL, as the relay's errors, logs and metrics
    name it: never the path or query (they often carry tokens), nor credentials. None for an
    endpoint that was deleted."""
    if url is None:
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "(unreadable URL)"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


ENDPOINT_TABLES = ("endpoints", "deliveries", "attempts")


async def _has_endpoint_tables(conn: asyncpg.Connection, schema: str) -> bool:
    """Whether the schema has the endpoint tables (migration 0006)."""
    tables = [queries.qualified_table(schema, f"outbox_{t}") for t in ENDPOINT_TABLES]
    return bool(await conn.fetchval(queries.ENDPOINT_TABLES_EXIST, *tables))


def _seconds(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


# --- status ---------------------------------------------------------------------------------


COUNTS = ("pending", "due_now", "running", "delivered", "failed", "skipped")

# Delivered rows are counted exactly up to this many (an index-only probe, then one pass
# over them); past it `delivered` is estimated from the table's statistics, and
# "delivered_estimated" says so. Pending, running, failed and skipped rows are always counted.
DELIVERED_EXACT_UP_TO = 100_000
# With estimated counts, each destination's last delivery is looked for among this many of
# the newest deliveries (None when it is older).
LATEST_DELIVERIES_READ = 10_000


async def status(
    conn: asyncpg.Connection, schema: str, *, snapshot_warning: float = DEFAULT_WARNING
) -> dict[str, Any]:
    """Per destination: row counts, leases held, failures by error, blocked keys, whether it
    is paused; and the relays. One snapshot (repeatable read), so the parts agree. Then the
    oldest snapshot holding back VACUUM (``snapshot``, None if none), over ``snapshot_warning``
    seconds or not.

    Every count is exact but ``delivered`` when the table keeps more than
    DELIVERED_EXACT_UP_TO delivered rows: it is then estimated (three significant digits,
    ``"delivered_estimated": true``), as counting them would read the whole table."""
    await _check_tables(conn, schema)
    has_endpoints = await _has_endpoint_tables(conn, schema)
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        # Aggregates over the partial indexes: compiling them (JIT) costs more than it saves.
        await conn.execute("SET LOCAL jit = off")
        counts = await conn.fetch(_sql(queries.STATUS_COUNTS, schema))
        ended = await conn.fetch(_sql(queries.STATUS_ENDED, schema))
        counted = {r["destination"]: r["pending"] + r["running"] for r in counts}
        for r in ended:
            counted[r["destination"]] = counted.get(r["destination"], 0) + r["rows"]
        relays = await conn.fetch(_sql(queries.RELAYS, schema))
        served = {d for r in relays for d in r["destinations"]}
        delivered, estimated = await _delivered(conn, schema, counted, served)
        leases = await conn.fetch(_sql(queries.STATUS_LEASES, schema))
        paused = await conn.fetch(_sql(queries.PAUSED_DETAIL, schema))
        blocked = await conn.fetch(_sql(queries.STATUS_BLOCKED_KEYS, schema))
        endpoints = (
            await conn.fetch(_sql(queries.STATUS_ENDPOINTS, schema), STATUS_ENDPOINTS_LISTED)
            if has_endpoints
            else []
        )
    # Once the snapshot of the counts is let go: the holders' own ages, not this one's.
    holder = await oldest_holder(conn)
    dests: dict[str, dict[str, Any]] = {}

    def dest(name: str) -> dict[str, Any]:
        return dests.setdefault(name, _empty_destination(name))

    for r in counts:
        dest(r["destination"]).update(_counts(r))
    for name, (n, last) in delivered.items():
        dest(name).update(delivered=n, last_delivered_at=_iso(last))
    for r in leases:
        left = r["lease_left"]
        dest(r["destination"])["in_flight"].append(
            {
                "relay": r["locked_by"],
                "rows": r["rows"],
                "lease_left_s": round(left, 3) if left is not None else None,
            }
        )
    for r in ended:
        d = dest(r["destination"])
        if r["status"] == Status.FAILED:
            d["failed"] += r["rows"]
            d["failed_errors"].append({"error": r["last_error"], "rows": r["rows"]})
        else:
            d["skipped"] += r["rows"]
    for r in blocked:
        dest(r["destination"])["blocked_keys"].append(
            {
                "key": r["key"],
                "failed_id": r["failed_id"],
                "waiting": r["waiting"],
                "error": r["last_error"],
            }
        )
    for r in paused:
        dest(r["destination"])["paused"] = {
            "since": _iso(r["paused_at"]),
            "by": r["paused_by"],
            "reason": r["reason"],
        }
    rows = [dests[k] for k in sorted(dests)]
    relay_rows = [_relay(r) for r in relays]
    for d in rows:
        d["delivered_estimated"] = estimated
        d.update(_circuit(d["destination"], relay_rows))
    return {
        "schema": schema,
        "destinations": rows,
        "totals": {k: sum(d[k] for d in rows) for k in COUNTS},
        "delivered_estimated": estimated,
        "relays": relay_rows,
        "endpoints": [_endpoint_status(r) for r in endpoints],
        "endpoints_total": endpoints[0]["total"] if endpoints else 0,
        "endpoints_needing_attention": endpoints[0]["needing_attention"] if endpoints else 0,
        "snapshot": holder.as_json(snapshot_warning) if holder is not None else None,
    }


def _empty_destination(name: str) -> dict[str, Any]:
    """A destination in `status` before its rows are counted (one that is only paused)."""
    return {
        "destination": name,
        "paused": None,
        **dict.fromkeys(COUNTS, 0),
        "delivered_estimated": False,
        "oldest_pending_age_s": None,
        "last_delivered_at": None,
        "in_flight": [],
        "failed_errors": [],
        "blocked_keys": [],
    }


def _counts(r: asyncpg.Record) -> dict[str, Any]:
    oldest = r["oldest_pending_age"]
    return {
        "pending": r["pending"],
        "due_now": r["due"],
        "running": r["running"],
        "oldest_pending_age_s": round(oldest, 3) if oldest is not None else None,
    }


Delivered = dict[str, tuple[int, datetime | None]]


async def _delivered(
    conn: asyncpg.Connection, schema: str, counted: dict[str, int], served: set[str]
) -> tuple[Delivered, bool]:
    """Delivered rows and the last delivery per destination, and whether they are estimates;
    ``counted``: the rows of each destination counted otherwise (pending, running, failed,
    skipped); ``served``: the destinations the registered relays serve."""
    few = await conn.fetchval(
        _sql(queries.STATUS_DELIVERED_PROBE, schema), DELIVERED_EXACT_UP_TO + 1
    )
    stats = None
    if few > DELIVERED_EXACT_UP_TO:
        stats = await conn.fetchrow(
            queries.STATUS_ESTIMATE, queries.qualified_table(schema), schema
        )
    if stats is None or not stats["analyzed"] or stats["reltuples"] < 0:
        # Few enough, or never analyzed (autovacuum will): counted.
        exact = await conn.fetch(_sql(queries.STATUS_DELIVERED, schema))
        return {r["destination"]: (r["delivered"], r["last_delivered_at"]) for r in exact}, False
    latest = await conn.fetch(_sql(queries.STATUS_DELIVERED_LATEST, schema), LATEST_DELIVERIES_READ)
    last = {r["destination"]: r["last_delivered_at"] for r in latest}
    shares, rest = _destination_shares(stats)
    if (set(counted) | set(last) | served) - set(shares):
        # A destination the statistics do not list (new since the last ANALYZE): a share
        # would credit its rows to the others, or leave it out. Counted instead, slower.
        exact = await conn.fetch(_sql(queries.STATUS_DELIVERED, schema))
        return {r["destination"]: (r["delivered"], r["last_delivered_at"]) for r in exact}, False
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


# A running relay refreshes its registration at least every 10 s.
RELAY_SILENT_AFTER = 30.0


def _relay(r: asyncpg.Record) -> dict[str, Any]:
    if r["stopped_at"] is not None:
        state = "stopped"
    elif r["seen_age"] > RELAY_SILENT_AFTER:
        state = "silent"  # stopped without saying so (killed), or cut off from the database
    else:
        state = "running"
    return {
        "relay_id": r["relay_id"],
        "state": state,
        "host": r["host"],
        "pid": r["pid"],
        "version": r["version"],
        "destinations": list(r["destinations"]),
        "started_at": _iso(r["started_at"]),
        "seen_at": _iso(r["seen_at"]),
        "seen_age_s": round(r["seen_age"], 3),
        "stopped_at": _iso(r["stopped_at"]),
        "circuits": json.loads(r["circuits"]) if state == "running" else {},
    }


def _circuit(destination: str, relays: list[dict[str, Any]]) -> dict[str, Any]:
    """A destination's circuit across the running relays: open if one has it open (its
    deliveries wait there), half-open if one is probing, else closed."""
    states = {
        r["relay_id"]: r["circuits"][destination] for r in relays if destination in r["circuits"]
    }
    seen = set(states.values())
    circuit = "open" if "open" in seen else "half_open" if "half_open" in seen else "closed"
    return {"circuit": circuit, "circuit_relays": sorted(states)}


# Endpoints listed by `status`, those that need a look first; the others are counted.
STATUS_ENDPOINTS_LISTED = 50


def _endpoint_status(r: asyncpg.Record) -> dict[str, Any]:
    return {
        "id": r["id"],
        "destination": r["destination"],
        "origin": origin(r["url"]),
        "enabled": r["enabled"],
        "disabled_reason": r["disabled_reason"],
        "disabled_at": _iso(r["disabled_at"]),
        "pending": r["pending"],
        "oldest_pending_age_s": _seconds(r["oldest_pending_age"]),
        "failing_since": _iso(r["failing_since"]),
        "last_http_status": r["last_http_status"],
        "last_attempt_at": _iso(r["last_attempt_at"]),
        "last_success_at": _iso(r["last_success_at"]),
        # Open in at least one relay until then (each relay has its own breaker).
        "circuit": "open" if r["circuit_open_until"] is not None else "closed",
        "circuit_open_until": _iso(r["circuit_open_until"]),
    }


# --- show -----------------------------------------------------------------------------------


def preview(payload: bytes, content_type: str, total: int) -> str:
    """Readable start of a payload: text as text, anything else as hex."""
    media = content_type.split(";", 1)[0].strip().lower()
    texty = media.startswith("text/") or media.endswith(("json", "xml")) or "+json" in media
    if texty:
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            text = payload.decode("utf-8", errors="replace")
    else:
        text = payload.hex(" ")
    return text + (f"… ({total} bytes)" if total > len(payload) else "")


async def show(
    conn: asyncpg.Connection, schema: str, ids: list[int], preview_bytes: int = 512
) -> tuple[list[dict[str, Any]], list[int]]:
    """The rows with these ids, in full; and the ids that do not exist."""
    await _check_tables(conn, schema)
    rows = await conn.fetch(_sql(queries.SHOW, schema), ids, preview_bytes)
    found = []
    for r in rows:
        found.append(
            {
                "id": r["id"],
                "destination": r["destination"],
                "key": r["key"],
                "status": r["status"],
                "attempts": r["attempts"],
                "last_error": r["last_error"],
                "created_at": _iso(r["created_at"]),
                "run_after": _iso(r["run_after"]),
                "delivered_at": _iso(r["delivered_at"]),
                "locked_by": r["locked_by"],
                "locked_until": _iso(r["locked_until"]),
                "content_type": r["content_type"],
                "headers": json.loads(r["headers"]),
                "payload_bytes": r["payload_bytes"],
                "payload_preview": preview(
                    bytes(r["payload_head"]), r["content_type"], r["payload_bytes"]
                ),
            }
        )
    missing = sorted(set(ids) - {r["id"] for r in rows})
    return found, missing


async def event_deliveries(
    conn: asyncpg.Connection, schema: str, ids: list[int]
) -> dict[str, list[dict[str, Any]]]:
    """The deliveries of these events to their endpoints, and their attempts from the message
    log (oldest first); both empty for events of other destinations, or without the tables."""
    if not ids or not await _has_endpoint_tables(conn, schema):
        return {"deliveries": [], "attempts": []}
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        deliveries = await conn.fetch(_sql(queries.SHOW_DELIVERIES, schema), ids)
        attempts = await conn.fetch(_sql(queries.SHOW_ATTEMPTS, schema), ids)
    return {
        "deliveries": [
            {
                "id": d["id"],
                "event_id": d["event_id"],
                "endpoint_id": d["endpoint_id"],
                "origin": origin(d["url"]),  # None: the endpoint was deleted
                "status": d["status"],
                "attempts": d["attempts"],
                "last_status": d["last_status"],
                "last_error": d["last_error"],
                "run_after": _iso(d["run_after"]),
                "locked_by": d["locked_by"],
                "created_at": _iso(d["created_at"]),
                "finished_at": _iso(d["finished_at"]),
            }
            for d in deliveries
        ],
        "attempts": [
            {
                "id": a["id"],
                "delivery_id": a["delivery_id"],
                "event_id": a["event_id"],
                "endpoint_id": a["endpoint_id"],
                "at": _iso(a["at"]),
                "http_status": a["http_status"],
                "duration_ms": round(a["duration_ms"], 1) if a["duration_ms"] is not None else None,
                "error": a["error"],
                "response": a["response"],
                "replay": a["replay"],
            }
            for a in attempts
        ],
    }


# --- list -----------------------------------------------------------------------------------

LIST_DEFAULT_LIMIT = 50
LIST_MAX_LIMIT = 1000
_MAX_ID = 2**63 - 1


def like_pattern(text: str | None) -> str | None:
    """An --error-like value as an ILIKE pattern: a plain word matches anywhere in the error;
    with SQL LIKE wildcards (``%``, ``_``) it is the pattern itself."""
    if text is not None and "%" not in text and "_" not in text:
        return f"%{text}%"
    return text


def _check_list_args(status: str | None, limit: int, ids: dict[str, int | None]) -> None:
    valid = [s.value for s in Status]
    if status is not None and status not in valid:
        raise AdminError(f"unknown status {status!r}: use one of {', '.join(valid)}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= LIST_MAX_LIMIT:
        raise AdminError(f"limit must be a whole number from 1 to {LIST_MAX_LIMIT}, not {limit!r}")
    for name, value in ids.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_ID:
            raise AdminError(f"{name} must be a row id (0 to {_MAX_ID}), not {value!r}")


async def list_rows(
    conn: asyncpg.Connection,
    schema: str,
    *,
    status: str | None = None,
    destination: str | None = None,
    key: str | None = None,
    tenant: str | None = None,
    event_type: str | None = None,
    error_like: str | None = None,
    min_id: int | None = None,
    max_id: int | None = None,
    before_id: int | None = None,
    limit: int = LIST_DEFAULT_LIMIT,
) -> dict[str, Any]:
    """One page of outbox rows matching every filter given, newest first (id descending).

    ``error_like`` matches ``last_error`` case-insensitively (a plain word anywhere, or a
    LIKE pattern with ``%`` and ``_``). Pages are read by keyset, never OFFSET: pass the
    result's ``next_before_id`` as ``before_id`` for the next page; it is None on the last.
    Returns ``{"rows": [...], "next_before_id": int | None}``, each row with id, destination,
    key, tenant, event_type, status, attempts, created_at, run_after, delivered_at (ISO
    timestamps) and last_error (whole). Raises AdminError for a bad argument."""
    ids = {"min_id": min_id, "max_id": max_id, "before_id": before_id}
    _check_list_args(status, limit, ids)
    await _check_tables(conn, schema)
    has_tenant = await conn.fetchval(
        queries.COLUMN_EXISTS, queries.qualified_table(schema), "tenant"
    )
    values: dict[str, Any] = {
        "destination": destination,
        "key": key,
        "tenant": tenant,
        "event_type": event_type,
        "error_like": like_pattern(error_like),
        **ids,
    }
    if not has_tenant and (tenant is not None or event_type is not None):
        raise AdminError(
            f"the outbox in schema {schema!r} has no tenant or event_type column (migration "
            "0006): run `outbox-relay migrate` (with the same --database-url and --schema)"
        )
    # The status is a literal (checked above) so that partial indexes match it; see LIST.
    where = [f"status = '{status}'"] if status is not None else []
    args: list[Any] = []
    for name, condition in queries.LIST_FILTERS.items():
        if values[name] is not None:
            args.append(values[name])
            where.append(condition.format(f"${len(args)}"))
    gather = status in queries.LIST_GATHERED_STATUSES
    sql = (
        _sql(queries.LIST_GATHERED if gather else queries.LIST, schema)
        .replace("{tenant}", "tenant" if has_tenant else "NULL::text")
        .replace("{event_type}", "event_type" if has_tenant else "NULL::text")
        .replace("{where}", " AND ".join(where) or "true")
        .replace("{limit}", str(limit + 1))  # one more: is there a next page?
    )
    rows = await conn.fetch(sql, *args)
    more = len(rows) > limit
    rows = rows[:limit]
    return {
        "rows": [
            {
                "id": r["id"],
                "destination": r["destination"],
                "key": r["key"],
                "tenant": r["tenant"],
                "event_type": r["event_type"],
                "status": r["status"],
                "attempts": r["attempts"],
                "created_at": _iso(r["created_at"]),
                "run_after": _iso(r["run_after"]),
                "delivered_at": _iso(r["delivered_at"]),
                "last_error": r["last_error"],
            }
            for r in rows
        ],
        "next_before_id": rows[-1]["id"] if more else None,
    }


# --- previews confirmed later ---------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """The rows a dry run counted, so that acting on them later (a preview confirmed in the
    console) takes exactly those rows or refuses: how many, the highest id (rows that match
    only later, with higher ids, are left out), a digest of the ids (any other change shows
    in it), and the database's clock then (a window such as purge's "older than 7d" stays
    where the dry run put it). Thousands of rows cost the same few numbers."""

    rows: int
    max_id: int
    digest: int
    at: datetime


class SelectionChanged(AdminError):
    """The rows a preview counted changed before it was confirmed; nothing was done."""


async def _selection(conn: asyncpg.Connection, sql: str, schema: str, *args: Any) -> Selection:
    r = await conn.fetchrow(_sql(sql, schema), *args)
    assert r is not None
    return Selection(r["rows"], r["max_id"], int(r["digest"]), r["at"])


def _same(now: Selection, shown: Selection) -> None:
    if (now.rows, now.digest) == (shown.rows, shown.digest):
        return
    if now.rows == shown.rows:
        how = f"as many rows match ({now.rows}), but not the same ones"
    else:
        how = f"it counted {shown.rows} row(s), {now.rows} of them match now"
    raise SelectionChanged(
        f"the rows changed since the preview ({how}: another session retried, purged, "
        "replayed or changed some meanwhile). Nothing changed."
    )


async def _exactly(statement: Awaitable[T]) -> T:
    """A statement of a repeatable-read transaction: a row it would change that another
    session changed since the transaction's snapshot is a changed selection."""
    try:
        return await statement
    except asyncpg.SerializationError:
        raise SelectionChanged(
            "the rows changed since the preview (another session changed some while this "
            "one acted). Nothing changed."
        ) from None


# --- retry ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryFilter:
    destinations: list[str] | None = None
    ids: list[int] | None = None
    since: datetime | None = None
    error_like: str | None = None
    # Only rows up to this id (a confirmed preview's selection).
    max_id: int | None = None

    def args(self) -> tuple[Any, ...]:
        return (
            self.destinations,
            self.ids,
            self.since,
            like_pattern(self.error_like),
            self.max_id,
        )


async def retry_preview(
    conn: asyncpg.Connection, schema: str, flt: RetryFilter
) -> tuple[dict[str, Any], Selection]:
    """retry's dry run, and the selection that confirms it (``retry(within=…)``), read in
    one snapshot so that they agree."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        counted = await retry(conn, schema, flt, dry_run=True)
        selection = await _selection(conn, queries.RETRY_SELECTION, schema, *flt.args())
    return counted, selection


async def retry(
    conn: asyncpg.Connection,
    schema: str,
    flt: RetryFilter,
    *,
    dry_run: bool,
    within: Selection | None = None,
) -> dict[str, Any]:
    """Move matching failed rows back to pending (attempts 0, due now). ``within``: only the
    rows of that selection (from retry_preview), or SelectionChanged if they are no longer
    the rows that match."""
    await _check_tables(conn, schema)
    exact = within is not None and not dry_run
    if within is not None:
        flt = replace(flt, max_id=within.max_id)
    # Exact: one snapshot for the check and the change, so what was checked is what changes.
    async with conn.transaction(isolation="repeatable_read" if exact else None):
        if flt.ids:
            found = {
                r["id"]: r["status"]
                for r in await conn.fetch(_sql(queries.ID_STATUSES, schema), flt.ids)
            }
            missing = [i for i in flt.ids if i not in found]
            if missing:
                raise AdminError(
                    f"no outbox row with id {', '.join(map(str, missing))}; check the id "
                    "(`outbox-relay status` lists failed rows per destination). Nothing changed."
                )
            not_failed = {i: s for i, s in found.items() if s != Status.FAILED}
            if not_failed:
                listed = ", ".join(f"{i} is {s}" for i, s in sorted(not_failed.items()))
                raise AdminError(
                    f"only failed rows can be retried: {listed}. Leave them out. Nothing changed."
                )
        if dry_run:
            groups = await conn.fetch(_sql(queries.RETRY_PREVIEW, schema), *flt.args())
            per = {
                g["destination"]: {
                    "rows": g["rows"],
                    "first_id": g["first_id"],
                    "last_id": g["last_id"],
                }
                for g in groups
            }
            return {"dry_run": True, "rows": sum(g["rows"] for g in groups), "destinations": per}
        if within is not None:
            _same(await _selection(conn, queries.RETRY_SELECTION, schema, *flt.args()), within)
        retried = conn.fetch(_sql(queries.RETRY, schema), *flt.args())
        changed = await (_exactly(retried) if exact else retried)
        if changed:
            await conn.execute(queries.NOTIFY, f"{schema}.outbox")  # wake relays at commit
    per_dest: dict[str, dict[str, Any]] = {}
    for r in changed:
        d = per_dest.setdefault(r["destination"], {"rows": 0, "first_id": r["id"], "last_id": 0})
        d["rows"] += 1
        d["first_id"] = min(d["first_id"], r["id"])
        d["last_id"] = max(d["last_id"], r["id"])
    return {"dry_run": False, "rows": len(changed), "destinations": per_dest}


# --- replay ---------------------------------------------------------------------------------

ENDED = ("delivered", "failed", "cancelled")
# A longer --since is every delivery (PostgreSQL intervals end somewhere).
MAX_REPLAY_WINDOW = 100 * 365 * 86400.0


async def _check_replay_tables(conn: asyncpg.Connection, schema: str) -> None:
    await _check_tables(conn, schema)
    deliveries = queries.qualified_table(schema, "outbox_deliveries")
    if not await conn.fetchval(queries.COLUMN_EXISTS, deliveries, "replay"):
        raise AdminError(
            f"no outbox_deliveries.replay column in schema {schema!r} (migrations 0006 and "
            "0007): run `outbox-relay migrate` (with the same --database-url and --schema)"
        )


async def _endpoint(conn: asyncpg.Connection, schema: str, endpoint_id: int) -> asyncpg.Record:
    endpoint = await conn.fetchrow(_sql(queries.REPLAY_ENDPOINT_ROW, schema), endpoint_id)
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


async def replay_event(
    conn: asyncpg.Connection, schema: str, event_id: int, endpoint_id: int | None = None
) -> dict[str, Any]:
    """Send an event to its endpoints again (to ``endpoint_id`` only, if given), with the same
    webhook-id: its deliveries go back to pending as replays, due now, their attempts afresh,
    whatever their state but running (a relay is sending it). With ``endpoint_id`` and no
    delivery to it yet, one is added."""
    await _check_replay_tables(conn, schema)
    async with conn.transaction():
        event = await conn.fetchrow(_sql(queries.REPLAY_EVENT_ROW, schema), event_id)
        if event is None:
            raise AdminError(
                f"no outbox row with id {event_id}: it was deleted (by retention or purge) or "
                "never existed, so there is no payload to send again. Nothing changed."
            )
        destination = event["destination"]
        endpoint = None
        if endpoint_id is not None:
            endpoint = await _endpoint(conn, schema, endpoint_id)
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
        if event["status"] in (Status.PENDING, Status.RUNNING):
            raise AdminError(
                f"event {event_id} is {event['status']}: no relay has sent it yet (relays fan "
                "it out to its endpoints when they deliver it), so there is nothing to replay. "
                "Nothing changed."
            )
        replay = _sql(queries.REPLAY_EVENT, schema)
        rows = await conn.fetch(replay, event_id, endpoint_id)
        created = False
        if not rows and endpoint is not None:
            added = await conn.fetchval(
                _sql(queries.REPLAY_EVENT_INSERT, schema), event_id, endpoint_id, destination
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
            {
                "endpoint_id": r["endpoint_id"],
                "origin": origin(r["url"]),
                "was": r["status"],
                "replayed": r["replayed"],
                "created": False,
                "held_by": r["locked_by"] if r["status"] == "running" else None,
                "endpoint_deleted": not r["endpoint_exists"],
                "endpoint_enabled": r["enabled"] if r["endpoint_exists"] else None,
                # Why the endpoint no longer takes the event (its tenant or types changed
                # since the fan-out), or None: such a delivery is not replayed.
                "mismatch": (
                    _mismatch(r, event) if r["endpoint_exists"] and not r["takes"] else None
                ),
            }
            for r in rows
        ]
        if created:
            assert endpoint is not None
            deliveries.append(
                {
                    "endpoint_id": endpoint_id,
                    "origin": origin(endpoint["url"]),
                    "was": None,
                    "replayed": True,
                    "created": True,
                    "held_by": None,
                    "endpoint_deleted": False,
                    "endpoint_enabled": endpoint["enabled"],
                    "mismatch": None,
                }
            )
        replayed = [d for d in deliveries if d["replayed"]]
        if replayed:
            # At commit; the payload wakes the relays' endpoint deliveries, not only claims.
            await conn.execute(queries.NOTIFY_ENDPOINTS, f"{schema}.outbox")
    return {
        "event_id": event_id,
        "destination": destination,
        "endpoint_id": endpoint_id,
        "replayed": len(replayed),
        "created": int(created),
        "running": sum(1 for d in deliveries if d["was"] == "running"),
        "endpoint_deleted": sum(1 for d in deliveries if d["endpoint_deleted"]),
        "mismatched": sum(1 for d in deliveries if d["mismatch"] is not None),
        "disabled_endpoints": [d["endpoint_id"] for d in replayed if not d["endpoint_enabled"]],
        "deliveries": deliveries,
    }


async def replay_endpoint_preview(
    conn: asyncpg.Connection, schema: str, endpoint_id: int, since: float, *, failed_only: bool
) -> tuple[dict[str, Any], Selection]:
    """replay_endpoint's dry run, and the selection of deliveries that confirms it
    (``replay_endpoint(within=…)``), read in one snapshot."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        counted = await replay_endpoint(
            conn, schema, endpoint_id, since, failed_only=failed_only, dry_run=True
        )
        window = _replay_window(endpoint_id, since, failed_only, None)
        selection = await _selection(
            conn, queries.REPLAY_ENDPOINT_SELECTION, schema, *window, None, None
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
    those of queries._REPLAY_WINDOW_WITHIN)."""
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
) -> dict[str, Any]:
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
            found = await _selection(conn, queries.REPLAY_ENDPOINT_SELECTION, schema, *args)
            _same(found, within)
        if dry_run:
            sql = queries.REPLAY_ENDPOINT_PREVIEW
            args = args[:3]  # a dry run counts the window as it is now
        else:
            sql = queries.REPLAY_ENDPOINT_WITHIN if exact else queries.REPLAY_ENDPOINT
        replaying = conn.fetch(_sql(sql, schema), *args)
        rows = await (_exactly(replaying) if exact else replaying)
        by_status = dict.fromkeys(statuses, 0)
        gone = mismatched = 0
        for r in rows:
            if not r["found"]:
                gone += r["n"]
            elif not r["takes"]:
                mismatched += r["n"]
            else:
                by_status[r["status"]] += r["n"]
        replayed = sum(by_status.values())
        if replayed and not dry_run:
            await conn.execute(queries.NOTIFY_ENDPOINTS, f"{schema}.outbox")  # as above
    return {
        "endpoint_id": endpoint_id,
        "destination": endpoint["destination"],
        "origin": origin(endpoint["url"]),
        "endpoint_enabled": endpoint["enabled"],
        "since_s": since,
        "failed_only": failed_only,
        "replayed": replayed,
        "by_status": by_status,
        "skipped_event_gone": gone,
        "skipped_not_taken": mismatched,
    }


# --- purge ----------------------------------------------------------------------------------


PurgeStatements = list[tuple[str, str, tuple[Any, ...]]]  # (status, lock statement, its args)


async def purge_preview(
    conn: asyncpg.Connection,
    schema: str,
    *,
    older_than: float,
    failed: bool,
    destinations: list[str] | None,
) -> tuple[dict[str, Any], Selection]:
    """purge's dry run, and the selection that confirms it (``purge(within=…)``), read in
    one snapshot."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        counted = await purge(
            conn,
            schema,
            older_than=older_than,
            failed=failed,
            destinations=destinations,
            batch_size=1,
            dry_run=True,
        )
        selection = await _selection(
            conn, queries.PURGE_SELECTION, schema, older_than, destinations, failed, None, None
        )
    return counted, selection


async def purge(
    conn: asyncpg.Connection,
    schema: str,
    *,
    older_than: float,
    failed: bool,
    destinations: list[str] | None,
    batch_size: int,
    dry_run: bool,
    progress: Callable[[int, int], None] | None = None,
    within: Selection | None = None,
) -> dict[str, Any]:
    """Delete delivered and skipped (and with ``failed``, failed) rows that reached that
    status more than ``older_than`` seconds ago, one small transaction per batch.

    ``progress(deleted, total)`` is called before the first batch and after each: the rows
    deleted so far, of the ``total`` counted first (rows that age meanwhile may be deleted
    too, rows another session has locked are passed over).

    ``within``: only the rows of that selection (from purge_preview: aged as of its clock,
    ids up to its highest), or SelectionChanged if they are no longer the rows that match.
    Checked once, before the batches: rows can only leave that set afterwards (deleted by
    another session, a failed row retried), never join it."""
    await _check_tables(conn, schema)
    if within is not None and not dry_run:
        return await _purge_within(
            conn,
            schema,
            within,
            older_than=older_than,
            failed=failed,
            destinations=destinations,
            batch_size=batch_size,
            progress=progress,
        )
    preview_rows = await conn.fetch(
        _sql(queries.PURGE_PREVIEW, schema), older_than, destinations, failed
    )
    if dry_run:
        per: dict[str, dict[str, int]] = {}
        for r in preview_rows:
            per.setdefault(r["destination"], {})[r["status"]] = r["rows"]
        total = sum(r["rows"] for r in preview_rows)
        return {"dry_run": True, "rows": total, "destinations": per}
    total = sum(r["rows"] for r in preview_rows)
    if progress is not None:
        progress(0, total)
    statements: PurgeStatements = [
        ("delivered", queries.PURGE_DELIVERED, ()),
        ("skipped", queries.PURGE_FINISHED, ([Status.SKIPPED],)),
    ]
    if failed:
        statements.append(("failed", queries.PURGE_FINISHED, ([Status.FAILED],)))
    return await _purge_batches(
        conn, schema, statements, (older_than, destinations, batch_size), total, progress
    )


async def _purge_batches(
    conn: asyncpg.Connection,
    schema: str,
    statements: PurgeStatements,
    args: tuple[Any, ...],
    total: int,
    progress: Callable[[int, int], None] | None,
) -> dict[str, Any]:
    """Each status's rows a batch at a time (``args``: the lock statements' first, the
    batch size third), until a batch takes fewer than a batch size."""
    batch_size = args[2]
    deleted = {"delivered": 0, "skipped": 0, "failed": 0}
    batches = 0
    for status_name, sql, extra in statements:
        rendered = _sql(sql, schema)
        while True:
            taken, n = await _purge_batch(conn, schema, rendered, status_name, *args, *extra)
            deleted[status_name] += n
            batches += 1
            if progress is not None:
                progress(sum(deleted.values()), total)
            if taken < batch_size:
                break
    return {
        "dry_run": False,
        "rows": sum(deleted.values()),
        "deleted": deleted,
        "batches": batches,
    }


async def _purge_batch(
    conn: asyncpg.Connection, schema: str, lock: str, status: str, *args: Any
) -> tuple[int, int]:
    """One batch of a purge, in a transaction of its own: the candidates locked by ``lock``,
    then deleted unless a delivery needs them (queries.DELETE_LOCKED says why in two
    statements); how many it took, and how many it deleted."""
    async with conn.transaction():
        ids = [r[0] for r in await conn.fetch(lock, *args)]
        if not ids:
            return 0, 0
        done = await conn.execute(_sql(queries.DELETE_LOCKED, schema), ids, [status])
    return len(ids), int(done.split()[-1])


async def _purge_within(
    conn: asyncpg.Connection,
    schema: str,
    within: Selection,
    *,
    older_than: float,
    failed: bool,
    destinations: list[str] | None,
    batch_size: int,
    progress: Callable[[int, int], None] | None,
) -> dict[str, Any]:
    bound = (within.at, within.max_id)
    found = await _selection(
        conn, queries.PURGE_SELECTION, schema, older_than, destinations, failed, *bound
    )
    _same(found, within)
    if progress is not None:
        progress(0, within.rows)
    statements: PurgeStatements = [
        ("delivered", queries.PURGE_SELECTED_DELIVERED, ()),
        ("skipped", queries.PURGE_SELECTED_FINISHED, ([Status.SKIPPED],)),
    ]
    if failed:
        statements.append(("failed", queries.PURGE_SELECTED_FINISHED, ([Status.FAILED],)))
    args = (older_than, destinations, batch_size, *bound)
    return await _purge_batches(conn, schema, statements, args, within.rows, progress)


# --- pause / resume -------------------------------------------------------------------------


async def pause(
    conn: asyncpg.Connection, schema: str, destination: str, by: str | None, reason: str | None
) -> dict[str, Any]:
    await _check_tables(conn, schema)
    r = await conn.fetchrow(_sql(queries.PAUSE, schema), destination, by, reason)
    assert r is not None
    return {
        "destination": destination,
        "paused": True,
        "already_paused": not r["inserted"],
        "since": _iso(r["paused_at"]),
    }


async def resume(conn: asyncpg.Connection, schema: str, destination: str) -> dict[str, Any]:
    await _check_tables(conn, schema)
    async with conn.transaction():
        r = await conn.fetchrow(_sql(queries.RESUME, schema), destination)
        if r is not None:
            # Both the claims and the endpoint deliveries of the destination start again.
            await conn.execute(queries.NOTIFY_ENDPOINTS, f"{schema}.outbox")
    return {
        "destination": destination,
        "paused": False,
        "was_paused": r is not None,
        "paused_since": _iso(r["paused_at"]) if r is not None else None,
    }


# --- skip -----------------------------------------------------------------------------------


async def skip(
    conn: asyncpg.Connection, schema: str, ids: list[int], by: str, *, dry_run: bool
) -> dict[str, Any]:
    """Mark failed rows ``skipped`` (never delivered) and let their keys move on."""
    await _check_tables(conn, schema)
    async with conn.transaction():
        rows = await conn.fetch(_sql(queries.ID_STATUSES, schema), ids)
        found = {r["id"]: r["status"] for r in rows}
        missing = [i for i in ids if i not in found]
        if missing:
            raise AdminError(
                f"no outbox row with id {', '.join(map(str, missing))}. Nothing changed."
            )
        not_failed = {i: s for i, s in found.items() if s != Status.FAILED}
        if not_failed:
            listed = ", ".join(f"{i} is {s}" for i, s in sorted(not_failed.items()))
            raise AdminError(f"only failed rows can be skipped: {listed}. Nothing changed.")
        if dry_run:
            per: dict[str, list[int]] = {}
            for r in rows:
                per.setdefault(r["destination"], []).append(r["id"])
            return {
                "dry_run": True,
                "rows": len(found),
                "ids": sorted(found),
                "destinations": {d: {"rows": len(i), "ids": sorted(i)} for d, i in per.items()},
            }
        done = await conn.fetch(_sql(queries.SKIP, schema), ids, by)
        # The key's next row is its head now; wake the relays at commit to claim it.
        await conn.execute(queries.NOTIFY, f"{schema}.outbox")
    return {"dry_run": False, "rows": len(done), "ids": sorted(r["id"] for r in done)}
