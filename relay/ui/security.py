"""Who may use the console, and the headers every answer carries.

A shared token (``OUTBOX_UI_TOKEN`` or a file), or a token per operator (``[ui] operators``,
``OUTBOX_UI_OPERATORS``, an operators file), authenticates: scripts send it as
``Authorization: Bearer …``; people enter it once in the sign-in form and get a session, a
random id in a cookie (HttpOnly, Secure, SameSite=Strict) that this process keeps until it
expires or is signed out, never the token itself. Every action also carries the session's
CSRF value, checked together with the request's ``Origin`` / ``Sec-Fetch-Site``: a page on
another site can neither read the value nor make the browser send the cookie with its
request.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.requests import Request

from relay.config.tokens import TOKEN_VARIABLE, TokenError, check_operators

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


SESSION_SECONDS = 12 * 3600  # a sign-in lasts this long
# Sessions kept by one console process at most: past this the nearest to expiring go first.
MAX_SESSIONS = 10_000
MAX_FORM_BYTES = 64 * 1024


@dataclass(frozen=True)
class Who:
    """Who makes a request: an operator by name, or None for the holder of the shared token."""

    operator: str | None

    @property
    def by(self) -> str:
        """How pauses and skipped rows name them (the command line writes user@host)."""
        return "console" if self.operator is None else f"{self.operator} (console)"


@dataclass(frozen=True)
class Session:
    """A sign-in, as this process keeps it."""

    who: Who
    expires: float
    csrf: str


@dataclass(frozen=True)
class Caller:
    """A request's credentials: a session (a browser), or none (a bearer token: a script)."""

    who: Who
    session: Session | None


class Guard:
    """Checks requests against the tokens and keeps the sessions; never keeps or renders a
    token itself (only its digest).

    Sessions live in this process only: signing out ends one for good (the cookie, kept or
    copied, no longer works), a restart ends them all, and another console process does not
    know them (see docs/console.md, several replicas)."""

    def __init__(self, token: str | None, operators: Mapping[str, str] | None = None) -> None:
        if operators is not None:
            if token is not None:
                raise TokenError(
                    "give the console either a shared token or operators with their own, not "
                    "both: with operators, the shared token would act without a name"
                )
            named = check_operators(operators, "operators")
            credentials = [(t, Who(n)) for n, t in sorted(named.items())]
            material = "\x00".join(f"{n}={t}" for n, t in sorted(named.items()))
        elif token is not None:
            credentials = [(token, Who(None))]
            material = token
        else:
            raise TokenError(f"the console needs a token ({TOKEN_VARIABLE}) or operators")
        self._tokens = [(hashlib.sha256(t.encode()).digest(), who) for t, who in credentials]
        # Messages and previews' selections are signed with a key derived from the tokens:
        # every replica configured alike signs alike, and new tokens void the old signatures.
        self._key = hashlib.sha256(b"outbox-relay console\x00" + material.encode()).digest()
        self._sessions: dict[bytes, Session] = {}

    def __repr__(self) -> str:
        return "Guard(<token>)"

    @property
    def operators(self) -> bool:
        """Whether each operator has a token of their own."""
        return self._tokens[0][1].operator is not None

    def _mac(self, what: str) -> str:
        return hmac.new(self._key, what.encode(), hashlib.sha256).hexdigest()

    def identify(self, offered: str) -> Who | None:
        """Whose token this is, if anyone's. Every token is compared, in constant time, so
        the time taken tells nothing of which one (or how much of one) matched."""
        digest = hashlib.sha256(offered.encode()).digest()
        found = None
        for known, who in self._tokens:
            if hmac.compare_digest(digest, known):
                found = who
        return found

    def token_ok(self, offered: str) -> bool:
        return self.identify(offered) is not None

    def new_session(self, who: Who | None = None, now: float | None = None) -> str:
        """A new session for ``who`` (the shared token's holder by default): the cookie's
        value, a random id. Only its digest is kept, with the session."""
        now = time.time() if now is None else now
        if len(self._sessions) >= MAX_SESSIONS:
            self._forget(now)
        sid = secrets.token_urlsafe(32)
        self._sessions[_digest(sid)] = Session(
            who if who is not None else Who(None),
            now + SESSION_SECONDS,
            self._mac(f"csrf:{sid}"),
        )
        return sid

    def _forget(self, now: float) -> None:
        """Drop the expired sessions, then (at the limit still) those nearest to expiring."""
        for key in [k for k, s in self._sessions.items() if s.expires < now]:
            del self._sessions[key]
        while len(self._sessions) >= MAX_SESSIONS:
            del self._sessions[min(self._sessions, key=lambda k: self._sessions[k].expires)]

    def session(self, value: str, now: float | None = None) -> Session | None:
        if not value or not value.isascii() or len(value) > 128:
            return None
        key = _digest(value)
        found = self._sessions.get(key)
        if found is None:
            return None
        if found.expires < (time.time() if now is None else now):
            self._sessions.pop(key, None)
            return None
        return found

    def session_ok(self, value: str, now: float | None = None) -> bool:
        return self.session(value, now) is not None

    def end_session(self, value: str) -> Session | None:
        """Sign-out: the session is forgotten, so its cookie no longer signs anyone in."""
        found = self.session(value)
        if found is not None:
            self._sessions.pop(_digest(value), None)
        return found

    def sign(self, message: str) -> str:
        """A signature for a message the console shows after an action (``msg`` in the URL),
        so that a link from elsewhere cannot put its own words on the console's pages."""
        return self._mac(f"msg:{message}")[:32]

    def signed(self, message: str | None, signature: str | None) -> bool:
        if not message or not signature or not signature.isascii():
            return False
        return hmac.compare_digest(signature.encode(), self.sign(message).encode())

    def seal(self, purpose: str, text: str) -> str:
        """A signature binding ``text`` to ``purpose`` (a preview's selection to its form)."""
        return self._mac(f"{purpose}:{text}")

    def sealed(self, purpose: str, text: str, signature: str) -> bool:
        if not signature.isascii():
            return False
        return hmac.compare_digest(signature.encode(), self.seal(purpose, text).encode())

    def bearer(self, request: Request) -> Who | None:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.identify(value.strip())

    def caller(self, request: Request) -> Caller | None:
        """Who makes this request, or None: not signed in."""
        who = self.bearer(request)
        if who is not None:
            return Caller(who, None)
        cookie = request.cookies.get(cookie_name(request.scope.get("root_path", "")), "")
        found = self.session(cookie)
        return Caller(found.who, found) if found is not None else None

    def signed_in(self, request: Request) -> bool:
        return self.caller(request) is not None

    def action_allowed(self, request: Request, caller: Caller, form_csrf: str | None) -> str | None:
        """Why an action (a POST) must be refused, or None. Scripts authenticated by the
        header need no CSRF value: a cross-site page cannot set that header."""
        if caller.session is None:
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
        if not hmac.compare_digest(form_csrf.encode(), caller.session.csrf.encode()):
            return "missing or wrong CSRF value: reload the page and try again"
        return None


def _digest(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode()).digest()


def cookie_name(root_path: str) -> str:
    """``__Host-`` when served at the root: the browser then keeps the cookie to this exact
    host and port's scheme, path ``/``, and no subdomain can set it. Mounted under a path
    (``/ui`` in the relay's listener), that prefix is not allowed; the path scopes it."""
    return f"__Host-{COOKIE}" if not root_path else COOKIE


def _own_origin(request: Request) -> str:
    host = request.headers.get("host", "")
    return f"{request.url.scheme}://{host}"
