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
import time
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


SESSION_SECONDS = 12 * 3600  # a sign-in lasts this long
MAX_FORM_BYTES = 64 * 1024


class Guard:
    """Checks requests against the token; never keeps or renders the token itself."""

    def __init__(self, token: str) -> None:
        self._digest = hashlib.sha256(token.encode()).digest()
        self._key = hashlib.sha256(b"outbox-relay console\x00" + token.encode()).digest()
        self.csrf = self._mac("csrf")

    def __repr__(self) -> str:
        return "Guard(<token>)"

    def _mac(self, what: str) -> str:
        return hmac.new(self._key, what.encode(), hashlib.sha256).hexdigest()

    def token_ok(self, offered: str) -> bool:
        return hmac.compare_digest(hashlib.sha256(offered.encode()).digest(), self._digest)

    def new_session(self, now: float | None = None) -> str:
        """A cookie value: when it expires, signed (nothing to look up, and a new token
        ends every session)."""
        expires = int((now if now is not None else time.time()) + SESSION_SECONDS)
        return f"{expires}.{self._mac(f'session:{expires}')}"

    def session_ok(self, value: str, now: float | None = None) -> bool:
        expires, _, mac = value.partition(".")
        if not (expires.isascii() and expires.isdigit()) or not mac.isascii():
            return False
        if int(expires) < (now if now is not None else time.time()):
            return False
        return hmac.compare_digest(mac.encode(), self._mac(f"session:{expires}").encode())

    def sign(self, message: str) -> str:
        """A signature for a message the console shows after an action (``msg`` in the URL),
        so that a link from elsewhere cannot put its own words on the console's pages."""
        return self._mac(f"msg:{message}")[:32]

    def signed(self, message: str | None, signature: str | None) -> bool:
        if not message or not signature or not signature.isascii():
            return False
        return hmac.compare_digest(signature.encode(), self.sign(message).encode())

    def bearer(self, request: Request) -> bool:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and self.token_ok(value.strip())

    def signed_in(self, request: Request) -> bool:
        cookie = request.cookies.get(cookie_name(request.scope.get("root_path", "")), "")
        return self.session_ok(cookie) or self.bearer(request)

    def action_allowed(self, request: Request, form_csrf: str | None) -> str | None:
        """Why an action (a POST) must be refused, or None. Scripts authenticated by the
        header need no CSRF value: a cross-site page cannot set that header."""
        if self.bearer(request):
            return None
        fetch_site = request.headers.get("sec-fetch-site")
        if fetch_site is not None:
            # Set by the browser itself: reliable behind a proxy that rewrites Host or
            # terminates TLS, where the Origin no longer matches what the console sees.
            if fetch_site != "same-origin":
                return f"{fetch_site} request refused"
        else:
            origin = request.headers.get("origin")
            if origin is not None and origin != _own_origin(request):
                return f"request from another origin ({origin}) refused"
        if not form_csrf or not form_csrf.isascii():
            return "missing or wrong CSRF value: reload the page and try again"
        if not hmac.compare_digest(form_csrf.encode(), self.csrf.encode()):
            return "missing or wrong CSRF value: reload the page and try again"
        return None


def cookie_name(root_path: str) -> str:
    """``__Host-`` when served at the root: the browser then keeps the cookie to this exact
    host and port's scheme, path ``/``, and no subdomain can set it. Mounted under a path
    (``/ui`` in the relay's listener), that prefix is not allowed; the path scopes it."""
    return f"__Host-{COOKIE}" if not root_path else COOKIE


def _own_origin(request: Request) -> str:
    host = request.headers.get("host", "")
    return f"{request.url.scheme}://{host}"
