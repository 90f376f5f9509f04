"""The portal's pages for a tenant's people: server-rendered (Jinja2, autoescaped), the
console's stylesheet, one small script of its own (portal.js: the link's token out of the
fragment and into a session). Each page reads through relay/portal/reads.py with the
session's scope; each form posts to an action (relay/portal/actions.py)."""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from relay.ops.text import age
from relay.portal import reads, sessions
from relay.portal.scope import Scope
from relay.portal.state import Portal

TEMPLATES = Environment(
    loader=PackageLoader("relay.portal", "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)
TEMPLATES.filters["age"] = age


def visible(text: str | None) -> str:
    r"""A receiver's answer (or a payload) as text, every character that a page would act on
    or not show written as its escape (````, ``‮``: a control, a bidi override, a
    zero-width one), so that an answer cannot hide or reorder what the page shows; line
    breaks and tabs kept. Autoescaping still applies to what is left."""
    if not text:
        return ""
    out = []
    for ch in text:
        if ch in "\n\t":
            out.append(ch)
        elif (
            ord(ch) < 32
            or 127 <= ord(ch) < 160
            or unicodedata.category(ch) in ("Cf", "Cs", "Zl", "Zp")
        ):
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


TEMPLATES.filters["visible"] = visible


def render(request: Request, name: str, code: int = 200, **context: Any) -> HTMLResponse:
    portal: Portal = request.app.state.portal
    scope: Scope | None = request.scope.get("state", {}).get("portal_scope")
    html = TEMPLATES.get_template(name).render(
        base=request.scope.get("root_path", ""),
        scope=scope,
        csrf=sessions.csrf(portal.keys, scope) if scope is not None else "",
        csrf_field=sessions.CSRF_FIELD,
        **context,
    )
    return HTMLResponse(html, status_code=code)


def guarded(
    page: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A page whose failures are pages too: not the tenant's (404, as absent), a refused
    value, the database unavailable; never a traceback."""

    async def run(request: Request) -> Response:
        try:
            return await page(request)
        except reads.NotFound:
            return render(request, "notice.html", 404, title="Not found", text="no such object")
        except (ValueError, asyncpg.DataError) as exc:
            return render(request, "notice.html", 400, title="Refused", text=str(exc))
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            text = "the database cannot answer now: try again shortly"
            return render(request, "notice.html", 503, title="Unavailable", text=text)

    return run


def _scope(request: Request) -> Scope:
    scope: Scope = request.scope["state"]["portal_scope"]
    return scope


async def landing(request: Request) -> Response:
    """The link's page: portal.js posts the token of the fragment; without a script, a
    field to paste it into."""
    portal: Portal = request.app.state.portal
    if sessions.scope_of(request, portal.keys, portal.schema) is not None:
        return RedirectResponse(request.scope.get("root_path", "") + "/endpoints", 303)
    return render(request, "landing.html")


async def endpoints(request: Request) -> Response:
    portal: Portal = request.app.state.portal
    async with portal.connection() as conn:
        page = await reads.endpoints(
            conn, _scope(request), cursor=request.query_params.get("cursor")
        )
    return render(
        request,
        "endpoints.html",
        page=page,
        destinations=portal.policy.destinations,
        offered=portal.event_types(),
    )


async def endpoint(request: Request) -> Response:
    portal: Portal = request.app.state.portal
    endpoint_id = _path_id(request)
    async with portal.connection() as conn:
        found = await reads.endpoint(conn, _scope(request), endpoint_id)
        recent = await reads.messages(
            conn, _scope(request), reads.MessageFilters(endpoint_id=endpoint_id), limit=20
        )
    known = (portal.policy.types or {}).get(found.destination, frozenset())
    unknown = [t for t in found.event_types if t not in known] if portal.policy.types else []
    return render(request, "endpoint.html", endpoint=found, messages=recent, unknown=unknown)


async def event_types(request: Request) -> Response:
    """The event types an endpoint may subscribe to, with their schemas and examples: the
    operator's catalog, the same for every tenant."""
    portal: Portal = request.app.state.portal
    shown = [
        {
            **t,
            "schema_text": json.dumps(t.get("schema"), indent=2, ensure_ascii=False),
            "example_texts": [json.dumps(e, indent=2, ensure_ascii=False) for e in t["examples"]],
        }
        for t in portal.event_types()
    ]
    return render(request, "event_types.html", types=shown, catalog=portal.catalog is not None)


async def messages(request: Request) -> Response:
    portal: Portal = request.app.state.portal
    status = request.query_params.get("status") or None
    filters = reads.MessageFilters(status=status)
    async with portal.connection() as conn:
        page = await reads.messages(
            conn, _scope(request), filters, cursor=request.query_params.get("cursor")
        )
    return render(request, "messages.html", page=page, status=status)


async def message(request: Request) -> Response:
    portal: Portal = request.app.state.portal
    delivery_id = _path_id(request)
    async with portal.connection() as conn:
        found = await reads.message(conn, _scope(request), delivery_id)
        tried = await reads.attempts(conn, _scope(request), delivery_id)
    payload = None
    if found.payload is not None:
        payload = found.payload.decode("utf-8", errors="replace")
    return render(request, "message.html", found=found, attempts=tried.items, payload=payload)


async def replay(request: Request) -> Response:
    """The form of a window's replay: the window, one endpoint or all, failed ones only."""
    portal: Portal = request.app.state.portal
    async with portal.connection() as conn:
        page = await reads.endpoints(conn, _scope(request), limit=reads.MAX_LIMIT)
    return render(request, "replay.html", endpoints=page.items)


def _path_id(request: Request) -> int:
    value = int(request.path_params["id"])
    if not 1 <= value <= 2**63 - 1:
        raise reads.NotFound(value)
    return value
