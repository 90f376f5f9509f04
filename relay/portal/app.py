"""The tenant portal's ASGI app: :func:`build_portal`. Its gate verifies the token of every
request but the OpenAPI document's, turns it into the request's :class:`Scope`, applies the
tenant's rate limits and the body's size limit, and adds the security headers; a token that
does not verify gets one answer whatever the reason (the reason goes to the log)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import structlog
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import RedirectResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Send
from starlette.types import Scope as AsgiScope

from outbox.endpoints.portal_tokens import PortalKeys, PortalTokenRefused, verify_portal_token
from relay.config.portal import check_origins
from relay.portal import actions, api, pages, sessions
from relay.portal.changes import Policy
from relay.portal.scope import Scope
from relay.portal.state import Portal
from relay.ui.security import CONTENT_SECURITY_POLICY, HEADERS

if TYPE_CHECKING:
    from relay.catalog.view import CatalogView

log = structlog.get_logger("relay.portal")

MAX_BODY = 16 * 1024
# Served to anyone: the document (nothing of any tenant), the sign-in page and its form, the
# stylesheet and script.
OPEN = ("/api/openapi.json", "/", "/session", "/session/end")

ROUTES = [
    Route("/api/openapi.json", api.openapi_json, methods=["GET"]),
    Route("/api/endpoints", api.list_endpoints, methods=["GET"]),
    Route("/api/endpoints", api.create_endpoint, methods=["POST"]),
    Route("/api/endpoints/{id:int}", api.get_endpoint, methods=["GET"]),
    Route("/api/endpoints/{id:int}", api.update_endpoint, methods=["PATCH"]),
    Route("/api/endpoints/{id:int}", api.delete_endpoint, methods=["DELETE"]),
    Route("/api/endpoints/{id:int}/disable", api.disable_endpoint, methods=["POST"]),
    Route("/api/endpoints/{id:int}/enable", api.enable_endpoint, methods=["POST"]),
    Route("/api/endpoints/{id:int}/rotate-secret", api.rotate_secret, methods=["POST"]),
    Route("/api/endpoints/{id:int}/test", api.send_test, methods=["POST"]),
    Route("/api/messages", api.list_messages, methods=["GET"]),
    Route("/api/messages/{id:int}", api.get_message, methods=["GET"]),
    Route("/api/messages/{id:int}/attempts", api.list_attempts, methods=["GET"]),
    Route("/api/messages/{id:int}/replay", api.replay_message, methods=["POST"]),
    Route("/api/replays", api.replay_range, methods=["POST"]),
    Route("/api/event-types", api.list_event_types, methods=["GET"]),
    Route("/", pages.landing, methods=["GET"]),
    Route("/session", actions.sign_in, methods=["POST"]),
    Route("/session/end", actions.sign_out, methods=["POST"]),
    Route("/endpoints", pages.guarded(pages.endpoints), methods=["GET"]),
    Route("/endpoints/{id:int}", pages.guarded(pages.endpoint), methods=["GET"]),
    Route("/messages", pages.guarded(pages.messages), methods=["GET"]),
    Route("/messages/{id:int}", pages.guarded(pages.message), methods=["GET"]),
    Route("/replay", pages.guarded(pages.replay), methods=["GET"]),
    Route("/event-types", pages.guarded(pages.event_types), methods=["GET"]),
    Route("/actions/{name}", actions.act, methods=["POST"]),
    # The console's stylesheet, and the portal's script.
    Mount(
        "/static", app=StaticFiles(packages=[("relay.portal", "static"), ("relay.ui", "static")])
    ),
]


def build_portal(
    database_url: str,
    keys: PortalKeys,
    policy: Policy,
    *,
    schema: str = "public",
    embed_origins: tuple[str, ...] = (),
    catalog: CatalogView | None = None,
) -> Starlette:
    """The portal as an ASGI app, served under ``/portal`` (``outbox-relay portal``);
    its pages may be framed by ``embed_origins`` (https://app.example.com) only. With an
    event ``catalog`` (relay.catalog.view.load_view) it lists the types tenants may
    subscribe to and refuses others; without one (or one that failed to load), any type."""
    if catalog is not None and catalog.available:
        policy = dataclasses.replace(policy, types=catalog.declared())
    portal = Portal(
        database_url, schema, keys, policy, check_origins(embed_origins), catalog=catalog
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await portal.close()

    async def not_found(request: Request, exc: Exception) -> Any:
        return api.problem(404, "Not found", "no such path")

    async def not_allowed(request: Request, exc: Exception) -> Any:
        return api.problem(405, "Method not allowed", "not a method of this path")

    app = Starlette(
        routes=ROUTES,
        lifespan=lifespan,
        middleware=[Middleware(_Gate, portal=portal)],
        exception_handlers={404: not_found, 405: not_allowed},
    )
    app.state.portal = portal
    return app


def headers_for(embed_origins: tuple[str, ...]) -> dict[str, str]:
    """The console's headers; framed by the embed origins if any (and by no one else)."""
    if not embed_origins:
        return HEADERS
    ancestors = "frame-ancestors 'self' " + " ".join(embed_origins)
    headers = {k: v for k, v in HEADERS.items() if k != "x-frame-options"}
    headers["content-security-policy"] = CONTENT_SECURITY_POLICY.replace(
        "frame-ancestors 'none'", ancestors
    )
    return headers


class _Gate:
    def __init__(self, app: ASGIApp, portal: Portal) -> None:
        self.app = app
        self.portal = portal
        self.headers = headers_for(portal.embed_origins)

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def headed(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {k.lower() for k, _ in headers}
                headers += [
                    (k.encode(), v.encode())
                    for k, v in self.headers.items()
                    if k.encode() not in present
                ]
                message["headers"] = headers
            await send(message)

        path = scope["path"][len(scope.get("root_path", "")) :] or "/"
        request = Request(scope)
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            # Every path's, the open ones' too (a sign-in form is read whole).
            too_large = api.problem(413, "Too large", f"bodies here are at most {MAX_BODY} bytes")
            await too_large(scope, receive, headed)
            return
        refused = None
        if not (path in OPEN or path.startswith("/static/")):
            refused = self._refused(request, scope, page=not path.startswith("/api/"))
        if refused is not None:
            await refused(scope, receive, headed)
            return
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await headed(message)

        try:
            await self.app(scope, _capped(receive), tracked)
        except api.Problem as exc:  # a body without a length, past the limit, read by a page
            if started:
                raise
            await api.problem(exc.status, exc.title, exc.detail)(scope, receive, headed)

    def _refused(self, request: Request, scope: AsgiScope, *, page: bool) -> Any:
        if page:
            who = sessions.scope_of(request, self.portal.keys, self.portal.schema)
            if who is None:  # not signed in, or the session ended: the sign-in page
                return RedirectResponse(scope.get("root_path", "") + "/", 303)
        else:
            who = self._scope(request)
        if who is None:
            return api.problem(
                401,
                "Unauthorized",
                "send Authorization: Bearer <token>, a portal token of this outbox",
                **{"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )
        scope.setdefault("state", {})["portal_scope"] = who
        wait = self.portal.limits.take(who.tenant)
        if not wait and request.method not in ("GET", "HEAD"):
            wait = self.portal.write_limits.take(who.tenant)
        if wait:
            log.info("relay.portal.rate_limited", tenant=who.tenant, token_id=who.token_id)
            return api.problem(
                429,
                "Too many requests",
                "this tenant's requests are over the portal's rate: try again later",
                **{"Retry-After": str(max(1, math.ceil(wait)))},
            )
        return None

    def _scope(self, request: Request) -> Scope | None:
        kind, _, token = request.headers.get("authorization", "").partition(" ")
        if kind.lower() != "bearer" or not token.strip():
            log.info("relay.portal.token_refused", reason="none")
            return None
        try:
            access = verify_portal_token(
                token.strip(), key=self.portal.keys, schema=self.portal.schema
            )
        except PortalTokenRefused as exc:
            log.info("relay.portal.token_refused", reason=exc.reason)
            return None
        return Scope.of(access, self.portal.schema)


def _capped(receive: Receive) -> Receive:
    """The body, refused past MAX_BODY when it came without a length (chunked)."""
    seen = 0

    async def wrapped() -> Any:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > MAX_BODY:
                raise api.Problem(413, "Too large", f"bodies here are at most {MAX_BODY} bytes")
        return message

    return wrapped
