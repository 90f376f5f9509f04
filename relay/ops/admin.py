"""What the operations commands do, as plain async functions returning JSON-ready data.

``relay.cli`` renders their results for people (or as JSON); tests call the CLI.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from outbox.status import Status
from relay.ops import queries


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


# --- status ---------------------------------------------------------------------------------


COUNTS = ("pending", "due_now", "running", "delivered", "failed", "skipped")


async def status(conn: asyncpg.Connection, schema: str) -> dict[str, Any]:
    """Per destination: row counts, leases held, failures by error, blocked keys, whether it
    is paused; and the relays. One snapshot (repeatable read), so the parts agree."""
    await _check_tables(conn, schema)
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        counts = await conn.fetch(_sql(queries.STATUS_COUNTS, schema))
        leases = await conn.fetch(_sql(queries.STATUS_LEASES, schema))
        errors = await conn.fetch(_sql(queries.STATUS_ERRORS, schema))
        paused = await conn.fetch(_sql(queries.PAUSED_DETAIL, schema))
        blocked = await conn.fetch(_sql(queries.BLOCKED_KEYS, schema), None)
        relays = await conn.fetch(_sql(queries.RELAYS, schema))
    dests: dict[str, dict[str, Any]] = {}

    def dest(name: str) -> dict[str, Any]:
        return dests.setdefault(name, _empty_destination(name))

    for r in counts:
        dest(r["destination"]).update(_counts(r))
    for r in leases:
        left = r["lease_left"]
        dest(r["destination"])["in_flight"].append(
            {
                "relay": r["locked_by"],
                "rows": r["rows"],
                "lease_left_s": round(left, 3) if left is not None else None,
            }
        )
    for r in errors:
        dest(r["destination"])["failed_errors"].append(
            {"error": r["last_error"], "rows": r["rows"]}
        )
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
    return {
        "schema": schema,
        "destinations": rows,
        "totals": {k: sum(d[k] for d in rows) for k in COUNTS},
        "relays": [_relay(r) for r in relays],
    }


def _empty_destination(name: str) -> dict[str, Any]:
    """A destination in `status` before its rows are counted (one that is only paused)."""
    return {
        "destination": name,
        "paused": None,
        **dict.fromkeys(COUNTS, 0),
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
        "delivered": r["delivered"],
        "failed": r["failed"],
        "skipped": r["skipped"],
        "oldest_pending_age_s": round(oldest, 3) if oldest is not None else None,
        "last_delivered_at": _iso(r["last_delivered_at"]),
    }


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


# --- retry ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryFilter:
    destinations: list[str] | None = None
    ids: list[int] | None = None
    since: datetime | None = None
    error_like: str | None = None

    def args(self) -> tuple[Any, ...]:
        pattern = self.error_like
        if pattern is not None and "%" not in pattern and "_" not in pattern:
            pattern = f"%{pattern}%"  # a plain word matches anywhere in the error
        return (self.destinations, self.ids, self.since, pattern)


async def retry(
    conn: asyncpg.Connection, schema: str, flt: RetryFilter, *, dry_run: bool
) -> dict[str, Any]:
    """Move matching failed rows back to pending (attempts 0, due now)."""
    await _check_tables(conn, schema)
    async with conn.transaction():
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
        changed = await conn.fetch(_sql(queries.RETRY, schema), *flt.args())
        if changed:
            await conn.execute(queries.NOTIFY, f"{schema}.outbox")  # wake relays at commit
    per_dest: dict[str, dict[str, Any]] = {}
    for r in changed:
        d = per_dest.setdefault(r["destination"], {"rows": 0, "first_id": r["id"], "last_id": 0})
        d["rows"] += 1
        d["first_id"] = min(d["first_id"], r["id"])
        d["last_id"] = max(d["last_id"], r["id"])
    return {"dry_run": False, "rows": len(changed), "destinations": per_dest}


# --- purge ----------------------------------------------------------------------------------


async def purge(
    conn: asyncpg.Connection,
    schema: str,
    *,
    older_than: float,
    failed: bool,
    destinations: list[str] | None,
    batch_size: int,
    dry_run: bool,
) -> dict[str, Any]:
    """Delete delivered and skipped (and with ``failed``, failed) rows that reached that
    status more than ``older_than`` seconds ago, one small transaction per batch."""
    await _check_tables(conn, schema)
    preview_rows = await conn.fetch(
        _sql(queries.PURGE_PREVIEW, schema), older_than, destinations, failed
    )
    if dry_run:
        per: dict[str, dict[str, int]] = {}
        for r in preview_rows:
            per.setdefault(r["destination"], {})[r["status"]] = r["rows"]
        total = sum(r["rows"] for r in preview_rows)
        return {"dry_run": True, "rows": total, "destinations": per}
    deleted = {"delivered": 0, "skipped": 0, "failed": 0}
    statements: list[tuple[str, str, tuple[Any, ...]]] = [
        ("delivered", queries.PURGE_DELIVERED, ()),
        ("skipped", queries.PURGE_FINISHED, ([Status.SKIPPED],)),
    ]
    if failed:
        statements.append(("failed", queries.PURGE_FINISHED, ([Status.FAILED],)))
    batches = 0
    for status_name, sql, extra in statements:
        rendered = _sql(sql, schema)
        while True:
            result = await conn.execute(rendered, older_than, destinations, batch_size, *extra)
            n = int(result.split()[-1])
            deleted[status_name] += n
            batches += 1
            if n < batch_size:
                break
    return {
        "dry_run": False,
        "rows": sum(deleted.values()),
        "deleted": deleted,
        "batches": batches,
    }


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
            await conn.execute(queries.NOTIFY, f"{schema}.outbox")
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
        found = {
            r["id"]: r["status"] for r in await conn.fetch(_sql(queries.ID_STATUSES, schema), ids)
        }
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
            return {"dry_run": True, "rows": len(ids), "ids": sorted(ids)}
        done = await conn.fetch(_sql(queries.SKIP, schema), ids, by)
        # The key's next row is its head now; wake the relays at commit to claim it.
        await conn.execute(queries.NOTIFY, f"{schema}.outbox")
    return {"dry_run": False, "rows": len(done), "ids": sorted(r["id"] for r in done)}
