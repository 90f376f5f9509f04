"""The console's pages: each reads through the operations the commands call (relay/ops)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from outbox.status import Status
from relay.db.queries import render_ops
from relay.ops import rows as row_ops
from relay.ops import status as status_ops
from relay.ops.common import AdminError, origin
from relay.ops.rows import RowPage
from relay.ops.status import StatusReport
from relay.ui import queries

if TYPE_CHECKING:
    from relay.ui.security import Caller
    from relay.ui.state import Console

ROWS_PER_PAGE = 50
ENDPOINTS_PER_PAGE = 500


def console_of(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


def caller_of(request: Request) -> Caller | None:
    """Who makes the request, as the gate found out (None on the sign-in page)."""
    caller: Caller | None = request.scope.get("state", {}).get("caller")
    return caller


def short(text: str | None, limit: int = 120) -> str:
    if not text:
        return ""
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --- sign-in ---------------------------------------------------------------------------------


async def login_form(request: Request) -> Response:
    return console_of(request).render(
        request, "login.html", next=request.query_params.get("next", ""), signed_in=False
    )


# --- overview --------------------------------------------------------------------------------


async def _status(request: Request) -> StatusReport:
    console = console_of(request)
    async with console.connection() as conn:
        return await status_ops.status(
            conn, console.schema, snapshot_warning=console.snapshot_warning
        )


async def overview(request: Request) -> Response:
    data = await _status(request)
    return console_of(request).render(request, "overview.html", status=data)


async def overview_fragment(request: Request) -> Response:
    """The live part of the overview, polled by htmx every few seconds."""
    data = await _status(request)
    return console_of(request).render(request, "_destinations.html", status=data)


async def status_json(request: Request) -> Response:
    """What `outbox-relay status --json` prints, for scripts."""
    return JSONResponse((await _status(request)).to_json())


async def series(request: Request) -> Response:
    """Delivered rows per minute and their lag over the last hour, for the charts."""
    console = console_of(request)
    dest = request.query_params.get("destination") or None
    if dest is not None and "\x00" in dest:
        raise AdminError("destination holds a NUL character")
    async with console.connection() as conn:
        rows = await conn.fetch(render_ops(queries.SERIES, console.schema), dest)
    return JSONResponse(
        {
            "destination": dest,
            "minutes": [r["minute"] for r in rows],
            "delivered": [r["delivered"] for r in rows],
            "lag_avg_s": [_rounded(r["lag_avg"]) for r in rows],
            "lag_max_s": [_rounded(r["lag_max"]) for r in rows],
        }
    )


def _rounded(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


async def destination(request: Request) -> Response:
    name = request.path_params["name"]
    data = await _status(request)
    found = next((d for d in data.destinations if d.destination == name), None)
    console = console_of(request)
    if found is None:
        return console.render(
            request,
            "message.html",
            status_code=404,
            title="No such destination",
            text=f"no rows and no pause for destination {name!r}",
        )
    return console.render(request, "destination.html", d=found, status=data, snapshot=data.snapshot)


# --- rows ------------------------------------------------------------------------------------

FILTERS = (
    "status",
    "destination",
    "key",
    "tenant",
    "event_type",
    "error_like",
    "min_id",
    "max_id",
    "before_id",
)


def _filters(request: Request) -> dict[str, Any]:
    q = request.query_params
    found: dict[str, Any] = {}
    for name in FILTERS:
        value = (q.get(name) or "").strip()
        if not value:
            continue
        if "\x00" in value:
            raise AdminError(f"{name} holds a NUL character")
        if name in ("min_id", "max_id", "before_id"):
            if not (value.isascii() and value.isdigit()) or int(value) > 2**63 - 1:
                raise AdminError(f"{name} must be a whole number, not {value!r}")
            found[name] = int(value)
        else:
            found[name] = value
    return found


async def rows(request: Request) -> Response:
    console = console_of(request)
    try:
        filters = _filters(request)
        async with console.connection() as conn:
            page = await row_ops.list_rows(conn, console.schema, limit=ROWS_PER_PAGE, **filters)
        error = None
    except AdminError as exc:
        filters, page, error = {}, RowPage([], None), str(exc)
    shown = {k: v for k, v in filters.items() if k != "before_id"}
    return console.render(
        request,
        "rows.html",
        page=page,
        filters=shown,
        error=error,
        statuses=[s.value for s in Status],
    )


async def row(request: Request) -> Response:
    console = console_of(request)
    row_id = request.path_params["id"]
    if row_id > 2**63 - 1:
        raise AdminError(f"no outbox row with id {row_id}")
    async with console.connection() as conn:
        found, _ = await row_ops.show(conn, console.schema, [row_id], preview_bytes=16384)
        log = await row_ops.event_deliveries(conn, console.schema, [row_id])
    if not found:
        return console.render(
            request,
            "message.html",
            status_code=404,
            title="No such row",
            text=f"no outbox row with id {row_id} (purged, or never written)",
        )
    r = found[0]
    return console.render(
        request,
        "row.html",
        r=r,
        payload=_pretty(r.payload_preview, r.content_type),
        headers_json=json.dumps(r.headers, indent=2, ensure_ascii=False),
        deliveries=log.deliveries,
        attempts=log.attempts,
    )


def _pretty(text: str, content_type: str) -> str:
    """JSON indented when it parses whole; anything else as the preview gives it."""
    if "json" in content_type.lower():
        try:
            return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
        except ValueError:
            return text
    return text


# --- endpoints and blocked keys ----------------------------------------------------------------


async def endpoints(request: Request) -> Response:
    """A page of endpoints by id, read by keyset (``after_id``, never OFFSET), as rows are."""
    console = console_of(request)
    dest = request.query_params.get("destination") or None
    if dest is not None and "\x00" in dest:
        raise AdminError("destination holds a NUL character")
    after = (request.query_params.get("after_id") or "").strip()
    if after and not (after.isascii() and after.isdigit() and int(after) <= 2**63 - 1):
        raise AdminError(f"after_id must be a whole number, not {after!r}")
    async with console.connection() as conn:
        tables = await conn.fetchval(
            queries.TABLE_EXISTS, f"{_quoted(console.schema)}.outbox_endpoints"
        )
        found = (
            await conn.fetch(
                render_ops(queries.ENDPOINTS, console.schema),
                dest,
                ENDPOINTS_PER_PAGE + 1,  # one more: whether there is a next page
                int(after) if after else 0,
            )
            if tables
            else []
        )
    more = len(found) > ENDPOINTS_PER_PAGE
    found = found[:ENDPOINTS_PER_PAGE]
    listed = [
        {
            "id": e["id"],
            "destination": e["destination"],
            "origin": origin(e["url"]),
            "tenant": e["tenant"],
            "event_types": list(e["event_types"]),
            "rate_limit": e["rate_limit"],
            "description": e["description"],
            "enabled": e["enabled"],
            "disabled_reason": e["disabled_reason"],
            "failing_since": e["failing_since"],
            "last_success_at": e["last_success_at"],
            "pending": e["pending"],
            "circuit_open_until": e["circuit_open_until"],
        }
        for e in found
    ]
    return console.render(
        request,
        "endpoints.html",
        endpoints=listed,
        destination=dest,
        tables=bool(tables),
        next_after_id=listed[-1]["id"] if more else None,
    )


async def blocked(request: Request) -> Response:
    data = await _status(request)
    keys = [
        {"destination": d.destination, **k.to_json()}
        for d in data.destinations
        for k in d.blocked_keys
    ]
    return console_of(request).render(request, "blocked.html", keys=keys, snapshot=data.snapshot)


def _quoted(schema: str) -> str:
    return '"' + schema.replace('"', '""') + '"'


__all__ = ["HTMLResponse", "short"]
