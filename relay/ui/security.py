"""Who may use the console, and the headers every answer carries.

One shared token (``OUTBOX_UI_TOKEN`` or a file) authenticates: scripts send it as
``Authorization: Bearer …``; people enter it once in the sign-in form and keep a cookie
derived from it (HttpOnly, Secure, SameSite=Strict), never the token itself. Every action
also carries a CSRF value derived from the token, checked together with the request's
``Origin`` / ``Sec-Fetch-Site``: a page on another site can neither read the value nor make
the browser send the cookie with its request.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from starlette.requests import Request

TOKEN_VARIABLE = "OUTBOX_UI_TOKEN"  # noqa: S105 - the variable's name
MIN_TOKEN_CHARS = 16
COOKIE = "outbox_console"
CSRF_FIELD = "csrf"

# Nothing from elsewhere: the console's own scripts and styles only (vendored), no inline
# script; uPlot sizes its canvas through the style property, which CSP does not govern.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    # same-origin: a form posted here carries its Origin (with no-referrer, browsers send
    # "Origin: null"), and no URL of the console leaks to another site.
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


class TokenError(Exception):
    """No usable token: the console refuses to start without one."""


def load_token(token_file: str | Path | None = None, environ: dict[str, str] | None = None) -> str:
    """The console's token, from ``token_file`` or ``OUTBOX_UI_TOKEN``."""
    env = os.environ if environ is None else environ
    if token_file is not None:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise TokenError(f"cannot read the console's token file {token_file}: {exc}") from None
        where = f"the token file {token_file}"
    else:
        token = env.get(TOKEN_VARIABLE, "").strip()
        where = TOKEN_VARIABLE
    if not token:
        raise TokenError(
            f"the console needs a token: set {TOKEN_VARIABLE} (or --token-file) to a random "
            'value of at least 16 characters, e.g. `python -c "import secrets; '
            'print(secrets.token_urlsafe(32))"`'
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(
            f"{where} holds a token of {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            "random ones"
        )
    return token


class Guard:
    """Checks requests against the token; never keeps or renders the token itself."""

    def __init__(self, token: str) -> None:
        self._digest = hashlib.sha256(token.encode()).digest()
        key = hashlib.sha256(b"outbox-relay console\x00" + token.encode()).digest()
        self.session = hmac.new(key, b"session", hashlib.sha256).hexdigest()
        self.csrf = hmac.new(key, b"csrf", hashlib.sha256).hexdigest()

    def __repr__(self) -> str:
        return "Guard(<token>)"

    def token_ok(self, offered: str) -> bool:
        return hmac.compare_digest(hashlib.sha256(offered.encode()).digest(), self._digest)

    def bearer(self, request: Request) -> bool:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and self.token_ok(value.strip())

    def signed_in(self, request: Request) -> bool:
        return hmac.compare_digest(request.cookies.get(COOKIE, ""), self.session) or self.bearer(
            request
        )

    def action_allowed(self, request: Request, form_csrf: str | None) -> str | None:
        """Why an action (a POST) must be refused, or None. Scripts authenticated by the
        header need no CSRF value: a cross-site page cannot set that header."""
        if self.bearer(request):
            return None
        if request.headers.get("sec-fetch-site") == "cross-site":
            return "cross-site request refused"
        origin = request.headers.get("origin")
        if origin is not None and origin != _own_origin(request):
            return f"request from another origin ({origin}) refused"
        if not form_csrf or not hmac.compare_digest(form_csrf, self.csrf):
            return "missing or wrong CSRF value: reload the page and try again"
        return None


def _own_origin(request: Request) -> str:
    host = request.headers.get("host", "")
    return f"{request.url.scheme}://{host}"
