"""`show` and `list`: outbox rows in full with an event's deliveries and attempts, and pages
of rows matching filters, newest first, read by keyset."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import asyncpg

from outbox.status import Status
from relay.ops import queries
from relay.ops.common import (
    AdminError,
    Result,
    check_tables,
    from_record,
    has_endpoint_tables,
    origin,
    sql,
)
from relay.ops.text import preview

# --- show -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShownRow(Result):
    id: int
    destination: str
    key: str | None
    status: str
    attempts: int
    last_error: str | None
    created_at: str | None
    run_after: str | None
    delivered_at: str | None
    locked_by: str | None
    locked_until: str | None
    content_type: str
    headers: Any
    payload_bytes: int
    payload_preview: str


@dataclass(frozen=True)
class EventDelivery(Result):
    id: int
    event_id: int
    endpoint_id: int | None
    origin: str | None  # None: the endpoint was deleted
    status: str
    attempts: int
    last_status: int | None
    last_error: str | None
    run_after: str | None
    locked_by: str | None
    created_at: str | None
    finished_at: str | None


@dataclass(frozen=True)
class EventAttempt(Result):
    id: int
    delivery_id: int | None
    event_id: int
    endpoint_id: int | None
    at: str | None
    http_status: int | None
    duration_ms: float | None
    error: str | None
    response: str | None
    replay: bool


@dataclass(frozen=True)
class EventActivity(Result):
    """Events' deliveries to their endpoints, and their attempts (oldest first)."""

    deliveries: list[EventDelivery]
    attempts: list[EventAttempt]


async def show(
    conn: asyncpg.Connection, schema: str, ids: list[int], preview_bytes: int = 512
) -> tuple[list[ShownRow], list[int]]:
    """The rows with these ids, in full; and the ids that do not exist."""
    await check_tables(conn, schema)
    rows = await conn.fetch(sql(queries.SHOW, schema), ids, preview_bytes)
    found = [
        from_record(
            ShownRow,
            r,
            headers=json.loads(r["headers"]),
            payload_preview=preview(
                bytes(r["payload_head"]), r["content_type"], r["payload_bytes"]
            ),
        )
        for r in rows
    ]
    missing = sorted(set(ids) - {r["id"] for r in rows})
    return found, missing


async def event_deliveries(conn: asyncpg.Connection, schema: str, ids: list[int]) -> EventActivity:
    """The deliveries of these events to their endpoints, and their attempts from the message
    log (oldest first); both empty for events of other destinations, or without the tables."""
    if not ids or not await has_endpoint_tables(conn, schema):
        return EventActivity([], [])
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        deliveries = await conn.fetch(sql(queries.SHOW_DELIVERIES, schema), ids)
        attempts = await conn.fetch(sql(queries.SHOW_ATTEMPTS, schema), ids)
    return EventActivity(
        deliveries=[from_record(EventDelivery, d, origin=origin(d["url"])) for d in deliveries],
        attempts=[
            from_record(
                EventAttempt,
                a,
                duration_ms=round(a["duration_ms"], 1) if a["duration_ms"] is not None else None,
            )
            for a in attempts
        ],
    )


# --- list -----------------------------------------------------------------------------------

LIST_DEFAULT_LIMIT = 50
LIST_MAX_LIMIT = 1000
_MAX_ID = 2**63 - 1


@dataclass(frozen=True)
class ListedRow(Result):
    id: int
    destination: str
    key: str | None
    tenant: str | None
    event_type: str | None
    status: str
    attempts: int
    created_at: str | None
    run_after: str | None
    delivered_at: str | None
    last_error: str | None  # whole


@dataclass(frozen=True)
class RowPage(Result):
    rows: list[ListedRow]
    # The next page's before_id; None on the last page.
    next_before_id: int | None


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
) -> RowPage:
    """One page of outbox rows matching every filter given, newest first (id descending).

    ``error_like`` matches ``last_error`` case-insensitively (a plain word anywhere, or a
    LIKE pattern with ``%`` and ``_``). Pages are read by keyset, never OFFSET: pass the
    result's ``next_before_id`` as ``before_id`` for the next page; it is None on the last.
    Raises AdminError for a bad argument."""
    ids = {"min_id": min_id, "max_id": max_id, "before_id": before_id}
    _check_list_args(status, limit, ids)
    await check_tables(conn, schema)
    has_tenant = await conn.fetchval(
        queries.COLUMN_EXISTS, queries.qualified_table(schema), "tenant"
    )
    if not has_tenant and (tenant is not None or event_type is not None):
        raise AdminError(
            f"the outbox in schema {schema!r} has no tenant or event_type column (migration "
            "0006): run `outbox-relay migrate` (with the same --database-url and --schema)"
        )
    values: dict[str, Any] = {
        "destination": destination,
        "key": key,
        "tenant": tenant,
        "event_type": event_type,
        "error_like": like_pattern(error_like),
        **ids,
    }
    statement, args = _list_statement(schema, status, values, has_tenant, limit)
    rows = await conn.fetch(statement, *args)
    more = len(rows) > limit
    rows = rows[:limit]
    return RowPage(
        rows=[from_record(ListedRow, r) for r in rows],
        next_before_id=rows[-1]["id"] if more else None,
    )


def _list_statement(
    schema: str, status: str | None, values: dict[str, Any], has_tenant: bool, limit: int
) -> tuple[str, list[Any]]:
    """The statement of a page, and its arguments: a condition per filter given."""
    # The status is a literal (checked first) so that partial indexes match it; see LIST.
    where = [f"status = '{status}'"] if status is not None else []
    args: list[Any] = []
    for name, condition in queries.LIST_FILTERS.items():
        if values[name] is not None:
            args.append(values[name])
            where.append(condition.format(f"${len(args)}"))
    gather = status in queries.LIST_GATHERED_STATUSES
    statement = (
        sql(queries.LIST_GATHERED if gather else queries.LIST, schema)
        .replace("{tenant}", "tenant" if has_tenant else "NULL::text")
        .replace("{event_type}", "event_type" if has_tenant else "NULL::text")
        .replace("{where}", " AND ".join(where) or "true")
        .replace("{limit}", str(limit + 1))  # one more: is there a next page?
    )
    return statement, args
