"""The operator console: server-rendered pages on Starlette and Jinja2, a little htmx for the
live parts, uPlot for the charts (both vendored: it works offline, with no build step).

Every number comes from the operations the commands call (relay/ops), and
every action goes through them too, with the same checks and the same dry-run preview, so
the console and the command line can never disagree. :func:`build_console` makes the ASGI
app; ``outbox-relay ui`` serves it on its own, ``[ui] enabled = true`` mounts it at ``/ui``
in the relay's listener.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
import structlog
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from outbox.errors import describe
from relay.db.snapshots import DEFAULT_WARNING as DEFAULT_SNAPSHOT_WARNING
from relay.db.store import UNAVAILABLE
from relay.ops.common import AdminError
from relay.ops.text import age
from relay.ui import actions, ago, pages
from relay.ui import catalog as catalog_pages
from relay.ui.security import COOKIE, HEADERS, MAX_FORM_BYTES, Guard
from relay.ui.state import Console

if TYPE_CHECKING:
    from relay.catalog.view import CatalogView

log = structlog.get_logger("relay.console")

STATIC = Path(__file__).parent / "static"


def build_console(
    database_url: str,
    token: str | None,
    *,
    schema: str = "public",
    read_only: bool = False,
    operators: Mapping[str, str] | None = None,
    snapshot_warning: float = DEFAULT_SNAPSHOT_WARNING,
    catalog: CatalogView | None = None,
) -> Starlette:
    """The console as an ASGI app, for the holders of ``token`` or, with ``operators``
    (name: token), for each operator under their own name (the shared token is then not
    accepted); the pages name a snapshot holding back VACUUM past ``snapshot_warning``
    seconds, and show ``catalog`` (relay.catalog.view.load_view) at /catalog. It opens a
    small pool of its own on first use (its statements never take the relay's connections)
    and closes it with its lifespan or ``app.state.console.close()``."""
    console = Console(
        database_url,
        schema,
        Guard(token, operators),
        read_only,
        _templates(),
        snapshot_warning=snapshot_warning,
        catalog=catalog,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await console.close()

    app = Starlette(
        routes=ROUTES,
        lifespan=lifespan,
        middleware=[Middleware(_Gate, console=console)],
        exception_handlers={404: _not_found},
    )
    app.state.console = console
    return app


ROUTES = [
    Route("/login", pages.login_form, methods=["GET"]),
    Route("/login", actions.login, methods=["POST"]),
    Route("/logout", actions.logout, methods=["POST"]),
    Route("/", pages.overview),
    Route("/fragments/overview", pages.overview_fragment),
    Route("/api/series", pages.series),
    Route("/api/status", pages.status_json),
    Route("/destinations/{name:path}", pages.destination),
    Route("/rows", pages.rows),
    Route("/rows/{id:int}", pages.row),
    Route("/endpoints", pages.endpoints),
    Route("/blocked", pages.blocked),
    Route("/catalog", catalog_pages.catalog),
    Route("/catalog/asyncapi.json", catalog_pages.asyncapi_json),
    Route("/actions/{name}", actions.act, methods=["POST"]),
    Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
]


def _templates() -> Environment:
    templates = Environment(
        loader=PackageLoader("relay.ui", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    # The oldest pending row's age at a glance: one unit (8m, 3h).
    templates.filters["age"] = functools.partial(age, coarse=True)
    templates.filters["short"] = pages.short
    # Every time shown: "3 min ago", the exact time on hover (relay/ui/ago.py).
    templates.filters["when"] = ago.time_tag
    templates.globals["server_now"] = ago.now_exact
    return templates


class _Gate:
    """Authentication and the security headers, for every request but sign-in and static
    files (which hold nothing of the outbox)."""

    def __init__(self, app: ASGIApp, console: Console) -> None:
        self.app = app
        self.console = console

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        path = scope["path"][len(scope.get("root_path", "")) :] or "/"
        open_path = path in ("/login",) or path.startswith("/static/")

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {k.lower() for k, _ in headers}
                for name, value in HEADERS.items():
                    if name.encode() not in present:
                        headers.append((name.encode(), value.encode()))
                message["headers"] = headers
            await send(message)

        if scope["method"] == "POST" and not _small_enough(request):
            response: Response = PlainTextResponse(
                f"413 request too large: forms here are at most {MAX_FORM_BYTES} bytes\n",
                status_code=413,
            )
            await response(scope, receive, send_with_headers)
            return
        try:
            caller = self.console.guard.caller(request)
        except ValueError:  # a cookie or header that cannot even be compared
            caller = None
        # Handlers and pages read who is asking (for the audit log, the CSRF value).
        scope.setdefault("state", {})["caller"] = caller
        if caller is None and not open_path:
            response = _unauthenticated(self.console, request)
            await response(scope, receive, send_with_headers)
            return
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send_with_headers(message)

        try:
            await self.app(scope, _capped(receive), tracked)
        except Exception as exc:
            # A page that cannot be shown says why, with the same headers, never a bare 500
            # or a traceback.
            if started:
                raise
            response = _failed(self.console, request, exc)
            await response(scope, receive, send_with_headers)


def _small_enough(request: Request) -> bool:
    length = request.headers.get("content-length")
    if length is None:
        return True  # chunked: _capped stops reading at the limit
    return length.isascii() and length.isdigit() and int(length) <= MAX_FORM_BYTES


def _capped(receive: Receive) -> Receive:
    """The request body, cut off past MAX_FORM_BYTES (a body without a length)."""
    seen = 0

    async def wrapped() -> Any:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > MAX_FORM_BYTES:
                raise BodyTooLarge(f"forms here are at most {MAX_FORM_BYTES} bytes")
        return message

    return wrapped


class BodyTooLarge(ValueError):
    """A request body past the console's limit."""


def _failed(console: Console, request: Request, exc: Exception) -> Response:
    """What a request that raised gets: 503 when the database cannot answer, 400 for input
    the database or a parser refused, 413 for a body too large; logged, never shown raw."""
    if isinstance(exc, BodyTooLarge):
        status, title, text = 413, "Too large", str(exc)
    elif isinstance(exc, AdminError):
        status, title, text = 400, "Refused", str(exc)
    elif isinstance(exc, UNAVAILABLE):
        status, title = 503, "Database unavailable"
        text = f"the database cannot answer now: {describe(exc)}; try again shortly"
    elif isinstance(exc, asyncpg.QueryCanceledError):
        status, title = 503, "Too slow"
        text = "the query took longer than the console allows (10 s): narrow the filters"
    elif isinstance(exc, asyncpg.PostgresError | ValueError | OverflowError):
        status, title, text = 400, "Refused", f"the request cannot be carried out: {describe(exc)}"
    else:
        status, title = 500, "Error"
        text = "the console failed on this request; its log has the details"
        log.exception("relay.console.error", path=request.url.path)
    if status != 500:
        log.warning("relay.console.refused", path=request.url.path, status=status, error=text)
    return console.render(request, "message.html", status_code=status, title=title, text=text)


def _unauthenticated(console: Console, request: Request) -> Response:
    """401: the sign-in form for a browser, a line of text for a script."""
    headers = {"www-authenticate": 'Bearer realm="outbox-relay console"'}
    if "text/html" in request.headers.get("accept", ""):
        response = console.render(
            request, "login.html", status_code=401, next=request.url.path, signed_in=False
        )
        response.headers.update(headers)
        return response
    return PlainTextResponse(
        "401 unauthenticated: send Authorization: Bearer <token> (OUTBOX_UI_TOKEN, or the "
        "operator's own), or sign in with a browser\n",
        status_code=401,
        headers=headers,
    )


async def _not_found(request: Request, exc: Exception) -> Response:
    if request.url.path.rstrip("/").endswith("/api/status"):
        return JSONResponse({"error": "not found"}, status_code=404)
    return PlainTextResponse("404 not found\n", status_code=404)


__all__ = ["COOKIE", "Console", "build_console"]
