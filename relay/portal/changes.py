"""What a tenant changes in the portal: its endpoints (add, update, disable, enable, delete,
rotate the secret), a test event to one of them. Each change is one transaction on the
portal's connection: the endpoint locked as the tenant's first (relay/portal/queries.sql,
endpoint_lock; not the tenant's: :class:`NotFound`, as absent), then the endpoints library
(outbox.endpoints) does the change with every check it makes for the application and the
commands: the URL's form and addresses (never a private network unless the operator allows
it), the secret's generation, encryption and rotation window."""

from __future__ import annotations

import difflib
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg

from relay.db.queries import serial_key
from relay.db.queries.render import render_ops
from relay.ops import queries as ops_queries
from relay.ops.common import AdminError
from relay.ops.endpoints import Action, library
from relay.portal import queries as q
from relay.portal.reads import NotFound
from relay.portal.scope import Scope

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

    from outbox.endpoints import Endpoint, Endpoints

T = TypeVar("T")
TEST_EVENT_TYPE = "outbox.test"
UPDATABLE = frozenset({"url", "event_types", "description", "rate_limit"})


class Refused(ValueError):
    """A change the portal does not make: the message says why (it names only the tenant's
    own input)."""


class Conflict(Refused):
    """A change that the endpoint's state or the tenant's bound refuses now."""


@dataclass(frozen=True, slots=True)
class Policy:
    """What the operator lets tenants do: the ``endpoints`` destinations they may add
    endpoints to (the first is the default), at most ``max_endpoints`` each, whether an
    endpoint may be on a private network (a test set-up's loopback receivers), and, with an
    event catalog, the event types it declares per destination (``types``; None: no catalog,
    any type is taken)."""

    destinations: tuple[str, ...]
    max_endpoints: int = 50
    allow_private_networks: bool = False
    types: Mapping[str, frozenset[str]] | None = None

    def check_types(self, destination: str, asked: Sequence[str]) -> None:
        """Refused, naming it, for the first of ``asked`` the catalog does not declare for
        ``destination``: a tenant cannot tell a typo from a type to come, so it is told now
        rather than left waiting for events that never match."""
        if self.types is None:
            return
        known = self.types.get(destination, frozenset())
        # A hint names only what GET /event-types lists (the portal's destinations' types).
        listed = known if destination in self.destinations else frozenset()
        for name in asked:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(listed), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise Refused(
                    f"event_types: {name!r} is not an event type of this destination "
                    f"(GET /event-types lists them){hint}"
                )

    def destination(self, asked: str | None) -> str:
        if not self.destinations:
            raise Refused("no destination takes endpoints from the portal")
        if asked is None:
            return self.destinations[0]
        if asked not in self.destinations:
            raise Refused(f"destination must be one of: {', '.join(self.destinations)}")
        return asked


@dataclass(frozen=True, slots=True)
class Locked:
    id: int
    destination: str
    enabled: bool
    event_types: list[str]
    tenant_for: float | None  # seconds since the endpoint became the tenant's (None: always)


Work = Callable[["Endpoints", "AsyncConnection", Locked], Awaitable[T]]
# What a tenant is told of a URL the library refused: not the library's words, which say
# what the portal host resolves a name to and name the operator's settings (found by review).
URL_REFUSED = (
    "url: not a URL the portal sends to: it must be an http(s) URL whose host resolves to "
    "public addresses only"
)


async def _library(conn: asyncpg.Connection, schema: str, work: Action[T]) -> tuple[T, bool]:
    """relay.ops.endpoints.library, a refused URL told in the portal's own words."""
    try:
        return await library(conn, schema, work)
    except AdminError as exc:
        if getattr(exc.__cause__, "field", None) == "url":
            raise Refused(URL_REFUSED) from None
        raise


async def _guarded(conn: asyncpg.Connection, scope: Scope, endpoint_id: int, work: Work[T]) -> T:
    """``work`` in one transaction, once the endpoint is locked as the tenant's."""

    async def run(e: Endpoints, c: AsyncConnection) -> T:
        async with c.begin():
            # The same connection, in the same transaction, as the library's statements.
            row = await conn.fetchrow(
                render_ops(q.ENDPOINT_LOCK, scope.schema), scope.tenant, endpoint_id
            )
            if row is None:
                raise NotFound(endpoint_id)
            return await work(e, c, Locked(**dict(row)))

    done, _ = await _library(conn, scope.schema, run)
    return done


async def create(
    conn: asyncpg.Connection,
    scope: Scope,
    policy: Policy,
    *,
    url: str,
    event_types: Sequence[str] = (),
    description: str = "",
    rate_limit: int | None = None,
    destination: str | None = None,
) -> Endpoint:
    """Add an endpoint for the tenant; it carries its new secret (shown once)."""
    scope.require_write()
    dest = policy.destination(destination)
    policy.check_types(dest, event_types)

    async def run(e: Endpoints, c: AsyncConnection) -> Endpoint:
        async with c.begin():
            have = await conn.fetchval(render_ops(q.ENDPOINTS_COUNTED, scope.schema), scope.tenant)
            if have >= policy.max_endpoints:
                raise Conflict(
                    f"the tenant has {have} endpoints, the most the portal allows: delete one"
                )
            return await e.create(
                c,
                destination=dest,
                url=url,
                tenant=scope.tenant,
                event_types=list(event_types),
                rate_limit=rate_limit,
                description=description,
                allow_private_networks=policy.allow_private_networks,
                check_dns=True,
            )

    made, _ = await _library(conn, scope.schema, run)
    return made


async def update(
    conn: asyncpg.Connection,
    scope: Scope,
    policy: Policy,
    endpoint_id: int,
    changes: dict[str, Any],
) -> Endpoint:
    """Change an endpoint's url, event types, description or rate limit (not its tenant, nor
    its destination)."""
    scope.require_write()
    if not set(changes) <= UPDATABLE:
        raise Refused(f"only {', '.join(sorted(UPDATABLE))} can be changed")

    async def run(e: Endpoints, c: AsyncConnection, ep: Locked) -> Endpoint:
        if changes.get("event_types"):
            policy.check_types(ep.destination, changes["event_types"])
        return await e.update(
            c,
            endpoint_id,
            **changes,
            allow_private_networks=policy.allow_private_networks,
            check_dns=True,
        )

    return await _guarded(conn, scope, endpoint_id, run)


async def disable(
    conn: asyncpg.Connection, scope: Scope, endpoint_id: int, reason: str | None = None
) -> Endpoint:
    scope.require_write()
    return await _guarded(
        conn, scope, endpoint_id, lambda e, c, _: e.disable(c, endpoint_id, reason=reason)
    )


async def enable(conn: asyncpg.Connection, scope: Scope, endpoint_id: int) -> Endpoint:
    scope.require_write()
    return await _guarded(conn, scope, endpoint_id, lambda e, c, _: e.enable(c, endpoint_id))


async def delete(conn: asyncpg.Connection, scope: Scope, endpoint_id: int) -> int:
    """Delete an endpoint; returns how many of its deliveries were cancelled."""
    scope.require_write()
    return await _guarded(conn, scope, endpoint_id, lambda e, c, _: e.delete(c, endpoint_id))


async def rotate_secret(
    conn: asyncpg.Connection, scope: Scope, endpoint_id: int, keep_previous: timedelta
) -> Endpoint:
    """A new secret (returned, shown once); the previous one still signs for
    ``keep_previous``."""
    scope.require_write()
    return await _guarded(
        conn,
        scope,
        endpoint_id,
        lambda e, c, _: e.rotate_secret(c, endpoint_id, keep_previous=keep_previous),
    )


@dataclass(frozen=True, slots=True)
class SentTest:
    delivery_id: int
    event_id: int


async def send_test(
    conn: asyncpg.Connection, scope: Scope, endpoint_id: int, event_type: str | None = None
) -> SentTest:
    """A test event to one endpoint of the tenant, of ``event_type`` (outbox.test by
    default), which the endpoint must take; the relays send it as any delivery."""
    scope.require_write()
    kind = event_type or TEST_EVENT_TYPE
    if not kind or len(kind) > 255 or any(ord(ch) < 32 for ch in kind):
        raise Refused("event_type must be 1 to 255 characters without control characters")

    async def run(_e: Endpoints, _c: AsyncConnection, ep: Locked) -> SentTest:
        if not ep.enabled:
            raise Conflict("the endpoint is disabled: enable it first")
        if ep.event_types and kind not in ep.event_types:
            raise Refused(f"the endpoint does not take {kind!r}: its event types are listed")
        payload = json.dumps(
            {
                "type": kind,
                "test": True,
                "endpoint_id": endpoint_id,
                "sent_at": datetime.now(UTC).isoformat(),
            }
        ).encode()
        sql = render_ops(q.TEST_SEND, scope.schema)
        row = await conn.fetchrow(
            sql, scope.tenant, endpoint_id, kind, payload, serial_key(scope.schema)
        )
        assert row is not None  # locked as the tenant's just before, in this transaction
        await conn.execute(ops_queries.NOTIFY_ENDPOINTS, f"{scope.schema}.outbox")
        return SentTest(row["id"], row["event_id"])

    return await _guarded(conn, scope, endpoint_id, run)
