"""What a tenant reads in the portal: its endpoints with their health, its messages (one per
delivery) with filters and keyset pages, a message with its event's payload, a message's
attempts. Each runs one statement of relay/portal/queries.sql, scoped to the tenant; an id that
is not the tenant's is :class:`NotFound`, as one that does not exist."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, TypeVar

import asyncpg

from relay.db.queries.render import render_ops
from relay.portal import cursors
from relay.portal import queries as q
from relay.portal.scope import Scope

T = TypeVar("T")
MAX_LIMIT = 100
STATUSES = ("pending", "running", "delivered", "failed", "cancelled")
MAX_PAYLOAD = 64 * 1024  # bytes of an event's payload shown


class NotFound(LookupError):
    """Not the tenant's, or not there: the same to the caller."""


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    items: list[T]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class EndpointView:
    id: int
    destination: str
    url: str
    event_types: list[str]
    description: str
    rate_limit: int | None
    enabled: bool
    disabled_reason: str | None
    disabled_at: datetime | None
    failing_since: datetime | None
    last_success_at: datetime | None
    circuit_open_until: datetime | None
    created_at: datetime
    updated_at: datetime
    counts: dict[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Message:
    id: int
    event_id: int
    endpoint_id: int
    event_type: str | None
    status: str
    attempts: int
    last_status: int | None
    last_error: str | None
    created_at: datetime
    finished_at: datetime | None
    replay: bool

    @property
    def webhook_id(self) -> str:
        """The ``webhook-id`` the receiver saw: the event's id."""
        return str(self.event_id)


@dataclass(frozen=True, slots=True)
class MessageDetail:
    message: Message
    event_kept: bool
    content_type: str | None
    payload: bytes | None = field(repr=False)
    payload_truncated: bool


@dataclass(frozen=True, slots=True)
class Attempt:
    id: int
    at: datetime
    http_status: int | None
    duration_ms: float | None
    response: str | None
    error: str | None
    replay: bool


@dataclass(frozen=True, slots=True)
class MessageFilters:
    endpoint_id: int | None = None
    status: str | None = None
    event_type: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def __post_init__(self) -> None:
        if self.status is not None and self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}")
        for name in ("since", "until"):
            at = getattr(self, name)
            if at is not None and at.tzinfo is None:
                raise ValueError(f"{name} must hold a time zone")

    def as_map(self) -> Mapping[str, object]:
        return {
            "endpoint_id": self.endpoint_id,
            "status": self.status,
            "event_type": self.event_type,
            "since": self.since.isoformat() if self.since else None,
            "until": self.until.isoformat() if self.until else None,
        }


def _limit(limit: int) -> int:
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be from 1 to {MAX_LIMIT}")
    return limit


def _page(rows: list[Any], limit: int, make: Any, filters: Mapping[str, object]) -> Page[Any]:
    items = [make(r) for r in rows]
    more = len(rows) == limit
    return Page(items, cursors.encode(rows[-1]["id"], filters) if more else None)


async def endpoints(
    conn: asyncpg.Connection, scope: Scope, *, limit: int = 50, cursor: str | None = None
) -> Page[EndpointView]:
    """The tenant's endpoints, newest first."""
    limit = _limit(limit)
    before = cursors.decode(cursor, {"list": "endpoints"})
    sql = render_ops(q.ENDPOINTS, scope.schema)
    rows = await conn.fetch(sql, scope.tenant, before, limit)
    return _page(rows, limit, lambda r: EndpointView(**dict(r)), {"list": "endpoints"})


async def endpoint(conn: asyncpg.Connection, scope: Scope, endpoint_id: int) -> EndpointView:
    """One of the tenant's endpoints, with its deliveries counted by status."""
    if not 1 <= endpoint_id < cursors.FIRST:
        raise NotFound(endpoint_id)  # (the highest id would overflow below)
    sql = render_ops(q.ENDPOINTS, scope.schema)
    # The page below endpoint_id + 1, one row: it, if it is the tenant's.
    rows = await conn.fetch(sql, scope.tenant, endpoint_id + 1, 1)
    if not rows or rows[0]["id"] != endpoint_id:
        raise NotFound(endpoint_id)
    counts = await conn.fetchrow(
        render_ops(q.ENDPOINT_COUNTS, scope.schema), scope.tenant, endpoint_id
    )
    return EndpointView(**dict(rows[0]), counts=dict(counts) if counts else None)


def _message(r: Mapping[str, Any]) -> Message:
    return Message(**{k: r[k] for k in Message.__dataclass_fields__})


async def messages(
    conn: asyncpg.Connection,
    scope: Scope,
    filters: MessageFilters | None = None,
    *,
    limit: int = 50,
    cursor: str | None = None,
) -> Page[Message]:
    """The tenant's messages, newest first, filtered."""
    f = filters or MessageFilters()
    limit = _limit(limit)
    before = cursors.decode(cursor, f.as_map())
    rows = await conn.fetch(
        render_ops(q.MESSAGES, scope.schema),
        scope.tenant,
        before,
        limit,
        f.endpoint_id,
        f.status,
        f.event_type,
        f.since,
        f.until,
    )
    return _page(rows, limit, _message, f.as_map())


async def message(conn: asyncpg.Connection, scope: Scope, delivery_id: int) -> MessageDetail:
    """One message of the tenant, with its event's payload (the first MAX_PAYLOAD bytes) while
    the event is kept."""
    r = await conn.fetchrow(render_ops(q.MESSAGE, scope.schema), scope.tenant, delivery_id)
    if r is None:
        raise NotFound(delivery_id)
    payload = r["payload"]
    if isinstance(payload, str):
        payload = payload.encode()
    return MessageDetail(
        _message(r),
        r["event_kept"],
        r["content_type"],
        payload[:MAX_PAYLOAD] if payload is not None else None,
        payload is not None and len(payload) > MAX_PAYLOAD,
    )


async def attempts(
    conn: asyncpg.Connection,
    scope: Scope,
    delivery_id: int,
    *,
    limit: int = 50,
    cursor: str | None = None,
) -> Page[Attempt]:
    """A message's attempts, newest first; NotFound if the message is not the tenant's."""
    limit = _limit(limit)
    filters = {"list": "attempts", "message": delivery_id}
    before = cursors.decode(cursor, filters)
    rows = await conn.fetch(
        render_ops(q.ATTEMPTS, scope.schema), scope.tenant, delivery_id, before, limit
    )
    if not rows and cursor is None:
        await message(conn, scope, delivery_id)  # NotFound if it is not the tenant's
    return _page(rows, limit, lambda r: Attempt(**dict(r)), filters)
