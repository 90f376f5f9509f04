"""What a tenant sends again from the portal: one message, or its endpoints' messages of a
time window (counted first, then sent exactly as counted). The replay rules are the
operator's (relay/ops/replay.py): a message goes again only to an endpoint that takes its
event (tenant and type), with the webhook-id it had. The portal adds the tenant's scope: only
its messages, and of an endpoint handed over to it, only those made since."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from outbox.endpoints.portal_tokens import PortalKeys
from relay.db.queries.render import render_ops
from relay.ops.replay import (
    ReplayedEndpoint,
    ReplayedEvent,
    replay_endpoint,
    replay_endpoint_preview,
    replay_event,
)
from relay.ops.selection import Selection
from relay.portal import queries as q
from relay.portal import reads
from relay.portal.changes import Locked
from relay.portal.reads import NotFound
from relay.portal.scope import Scope

MAX_WINDOW = 90 * 86400.0  # seconds: longer than any message log is kept
# Endpoints a window of all the tenant's endpoints counts at most (its selection goes to the
# client and back); beyond, a window names one endpoint.
MAX_RANGE_ENDPOINTS = 50


async def _lock(conn: asyncpg.Connection, scope: Scope, endpoint_id: int) -> Locked:
    row = await conn.fetchrow(render_ops(q.ENDPOINT_LOCK, scope.schema), scope.tenant, endpoint_id)
    if row is None:
        raise NotFound(endpoint_id)
    return Locked(**dict(row))


async def replay_message(conn: asyncpg.Connection, scope: Scope, delivery_id: int) -> ReplayedEvent:
    """Send one message of the tenant again (its delivery back to pending as a replay)."""
    scope.require_write()
    async with conn.transaction():
        found = await reads.message(conn, scope, delivery_id)
        await _lock(conn, scope, found.message.endpoint_id)
        # Read again under the lock: the endpoint is still the tenant's, and so is the message.
        found = await reads.message(conn, scope, delivery_id)
        if not found.event_kept:
            raise NotFound(delivery_id)  # nothing left to send: retention deleted the event
        return await replay_event(
            conn, scope.schema, found.message.event_id, found.message.endpoint_id
        )


@dataclass(frozen=True, slots=True)
class Window:
    """The messages of the tenant's endpoints (or of one) made in the last ``seconds``, or
    the failed ones only."""

    seconds: float
    endpoint_id: int | None = None
    failed_only: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.seconds <= MAX_WINDOW:
            raise ValueError(f"the window must be from 1 s to {MAX_WINDOW / 86400:.0f} days")


@dataclass(frozen=True, slots=True)
class Counted:
    """What a window would send, per endpoint, and what confirms it: per endpoint, the
    window's seconds as counted (no longer than the endpoint has been the tenant's) and the
    selection of its messages."""

    per_endpoint: list[ReplayedEndpoint]
    selections: dict[int, tuple[float, Selection]]

    @property
    def total(self) -> int:
        return sum(r.replayed for r in self.per_endpoint)


async def _endpoints(conn: asyncpg.Connection, scope: Scope, window: Window) -> list[Locked]:
    """The endpoints of the window, each with how long it has been the tenant's."""
    if window.endpoint_id is not None:
        ids = [window.endpoint_id]
    else:
        ids, cursor = [], None
        while True:
            page = await reads.endpoints(conn, scope, limit=reads.MAX_LIMIT, cursor=cursor)
            ids.extend(e.id for e in page.items)
            if len(ids) > MAX_RANGE_ENDPOINTS:
                raise ValueError(
                    f"the tenant has more than {MAX_RANGE_ENDPOINTS} endpoints: name one "
                    "(endpoint_id) to replay a window"
                )
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
    found = []
    for endpoint_id in ids:
        async with conn.transaction():
            found.append(await _lock(conn, scope, endpoint_id))
    return found


def _seconds(window: Window, ep: Locked) -> float:
    """The window, no longer than the endpoint has been the tenant's. Measured when it was
    locked, it starts that many seconds before the replay's own clock: a few milliseconds
    after the handover, so a message made within them is left out, never one made before."""
    if ep.tenant_for is None:
        return window.seconds
    return max(0.001, min(window.seconds, ep.tenant_for))


async def count(conn: asyncpg.Connection, scope: Scope, window: Window) -> Counted:
    """What replay would send (by status, per endpoint), and the selections to confirm."""
    scope.require_write()
    per, selections = [], {}
    for ep in await _endpoints(conn, scope, window):
        counted, selection = await replay_endpoint_preview(
            conn, scope.schema, ep.id, _seconds(window, ep), failed_only=window.failed_only
        )
        per.append(counted)
        selections[ep.id] = (counted.since_s, selection)
    return Counted(per, selections)


async def replay(
    conn: asyncpg.Connection,
    scope: Scope,
    window: Window,
    selections: Mapping[int, tuple[float, Selection]],
) -> list[ReplayedEndpoint]:
    """Send the window's messages again, exactly those counted (``selections`` from
    :func:`count`; SelectionChanged if they changed meanwhile). An endpoint of the window
    without a selection is left out."""
    scope.require_write()
    done = []
    for ep in await _endpoints(conn, scope, window):
        if ep.id not in selections:
            continue
        seconds, within = selections[ep.id]
        # Never longer than the endpoint has been the tenant's now (handed away and back
        # since the count: the selection then differs, and nothing is sent).
        seconds = min(seconds, _seconds(window, ep))
        done.append(
            await replay_endpoint(
                conn, scope.schema, ep.id, seconds, failed_only=window.failed_only, within=within
            )
        )
    return done


# --- a count's selections, to the client and back ----------------------------------------------


def _purpose(scope: Scope, window: Window) -> str:
    w = window
    return f"replay:{scope.schema}:{scope.tenant}:{w.seconds}:{w.endpoint_id}:{w.failed_only}"


def seal(
    keys: PortalKeys,
    scope: Scope,
    window: Window,
    selections: Mapping[int, tuple[float, Selection]],
) -> str:
    """A count's selections as text the client sends back to replay them, sealed with the
    portal key for this tenant and window: a client can neither make one up nor take one to
    another window (its clock, moved, would move the window before a handover)."""
    data = json.dumps(
        {
            str(eid): [sec, sel.rows, sel.max_id, sel.digest, sel.at.isoformat()]
            for eid, (sec, sel) in selections.items()
        },
        sort_keys=True,
    ).encode()
    text = base64.urlsafe_b64encode(data).decode()
    return f"{text}.{keys.seal(_purpose(scope, window), data)}"


def unseal(
    keys: PortalKeys, scope: Scope, window: Window, sealed: str
) -> dict[int, tuple[float, Selection]] | None:
    """The selections :func:`seal` made for this tenant and window, or None."""
    text, _, signature = sealed.partition(".")
    try:
        data = base64.urlsafe_b64decode(text.encode("ascii"))
    except (ValueError, binascii.Error):
        return None
    if not data or not keys.sealed(_purpose(scope, window), data, signature):
        return None
    raw = json.loads(data)
    return {
        int(eid): (sec, Selection(rows, max_id, digest, datetime.fromisoformat(at)))
        for eid, (sec, rows, max_id, digest, at) in raw.items()
    }
