"""The portal page's sessions: a link's token (in the URL's fragment, read by portal.js and
posted here once) becomes a session token of its own audience in a cookie (HttpOnly, Secure,
SameSite=Strict; ``__Host-`` at the root), verified by any replica with the portal keys. Every
form carries a CSRF value derived from the session's token id, checked with the request's
``Sec-Fetch-Site`` or ``Origin`` (the console's rule)."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from outbox.endpoints.portal_tokens import (
    PortalAccess,
    PortalKeys,
    PortalTokenRefused,
    session_audience,
    session_token,
    verify_portal_token,
)
from relay.portal.scope import Scope

__all__ = ["PortalTokenRefused", "csrf", "end", "refused", "scope_of", "start"]

COOKIE = "outbox_portal"
CSRF_FIELD = "csrf"


def cookie_name(root_path: str) -> str:
    """``__Host-`` served at the root; mounted under a path, that prefix is not allowed."""
    return f"__Host-{COOKIE}" if not root_path else COOKIE


def start(
    response: Response,
    request: Request,
    keys: PortalKeys,
    schema: str,
    token: str,
    framed: bool = False,
) -> PortalAccess:
    """Sign in with a link's token: the session cookie set on ``response``; raises
    PortalTokenRefused for a token that does not open the portal. ``framed`` (the portal may
    be embedded in another site's page): SameSite=None and partitioned (CHIPS), since a
    cross-site frame gets no SameSite=Strict cookie; the CSRF value and Sec-Fetch-Site then
    carry the defence."""
    access = verify_portal_token(token, key=keys, schema=schema)
    base = request.scope.get("root_path", "")
    response.set_cookie(
        cookie_name(base),
        session_token(access, key=keys, schema=schema),
        max_age=max(1, int(access.expires.timestamp() - time.time())),
        httponly=True,
        secure=True,  # browsers keep it on http://127.0.0.1 and localhost too
        samesite="none" if framed else "strict",
        path=(base or "") + "/",
    )
    if framed:
        # Starlette writes Partitioned on Python 3.14 only: added to the header it wrote.
        name, value = response.raw_headers[-1]
        assert name == b"set-cookie"
        response.raw_headers[-1] = (name, value + b"; Partitioned")
    return access


def end(response: Response, request: Request) -> None:
    base = request.scope.get("root_path", "")
    response.delete_cookie(cookie_name(base), path=(base or "") + "/", secure=True, httponly=True)


def scope_of(request: Request, keys: PortalKeys, schema: str) -> Scope | None:
    """The session's scope, if the request carries a valid session cookie."""
    value = request.cookies.get(cookie_name(request.scope.get("root_path", "")))
    if not value:
        return None
    try:
        access = verify_portal_token(value, key=keys, schema=schema, aud=session_audience(schema))
    except PortalTokenRefused:
        return None
    return Scope.of(access, schema)


def csrf(keys: PortalKeys, scope: Scope) -> str:
    return keys.seal("csrf", scope.token_id.encode())


def refused(request: Request, keys: PortalKeys, scope: Scope, form_csrf: str | None) -> str | None:
    """Why a form's POST must be refused, or None."""
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None:
        if fetch_site != "same-origin":
            return f"{fetch_site} request refused"
    else:
        origin = request.headers.get("origin")
        own = f"{request.url.scheme}://{request.headers.get('host', '')}"
        if origin is not None and origin != own:
            return "request from another origin refused"
    if not form_csrf or not keys.sealed("csrf", scope.token_id.encode(), form_csrf):
        return "missing or wrong CSRF value: reload the page and try again"
    return None
