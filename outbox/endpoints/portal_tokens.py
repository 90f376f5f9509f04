"""Portal tokens: what an application mints, without a round trip, so that one tenant's people
open the tenant portal (issue #30), and what the portal checks.

    token = outbox.endpoints.portal_token(tenant="acme", ttl=timedelta(hours=1))
    link = outbox.endpoints.portal_url("https://hooks.example.com/portal", tenant="acme")

A token is a JWT (JWS compact, HS256), so an application in any language mints one with a
stock JWT library (docs/portal.md). Its header is exactly ``{"alg": "HS256", "kid": …,
"typ": "JWT"}``: any other algorithm (``none``, ``RS256``, …) or member is refused before a
key is looked at, which rules out the algorithm-confusion bugs of general verifiers. The
claims: ``iss`` "outbox-relay", ``aud`` "outbox-portal:<schema>" (a token for one outbox
schema opens no other), ``sub`` the tenant, ``scope`` "read" or "read write", ``iat`` and
``exp`` (at most MAX_TTL apart), ``jti`` (the token's id in the audit log, never the token),
and an optional ``nbf``; no other.

Keys are ``opk_`` and at least 32 random bytes in base64url (:func:`new_portal_key`), given
as ``key=`` or in ``OUTBOX_PORTAL_KEY``, several comma-separated during a rotation: the first
signs, every one verifies. The header's ``kid`` is derived from the key (it names the key
without saying anything of it), so a rotation needs nothing configured beside the keys.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from outbox.errors import OutboxError, OutboxValidationError
from outbox.message import MAX_TENANT_BYTES, _label

KEY_VARIABLE = "OUTBOX_PORTAL_KEY"
KEY_PREFIX = "opk_"
MIN_KEY_BYTES = 32
ISSUER = "outbox-relay"
DEFAULT_TTL = timedelta(hours=1)
MAX_TTL = timedelta(days=7)  # Svix's bound for its portal links
LEEWAY = 60  # seconds of clock difference allowed either way, as common JWT verifiers allow
MAX_TOKEN_BYTES = 4096
SCOPES = ("read", "write")
_HEADER_MEMBERS = frozenset({"alg", "kid", "typ"})
_CLAIMS = frozenset({"iss", "aud", "sub", "scope", "iat", "exp", "nbf", "jti"})
_B64URL = re.compile(r"[A-Za-z0-9_-]*")
_KID_CONTEXT = b"outbox-portal kid\0"


class PortalKeyMissing(OutboxError):
    """No portal key: neither ``key=`` nor OUTBOX_PORTAL_KEY."""


class PortalTokenRefused(OutboxError):
    """A token that does not open the portal. ``reason`` is one of malformed, algorithm,
    unknown_key, signature, expired, not_yet, audience, claims; the message never holds the
    token or a key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"portal token refused ({reason}): {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class PortalAccess:
    """What a verified token grants: one tenant, read or read and write, until ``expires``."""

    tenant: str
    token_id: str
    write: bool
    expires: datetime


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    """base64url without padding, canonical only: two spellings of the same bytes (the
    unused low bits of the last character) would let a changed token verify."""
    if not _B64URL.fullmatch(text) or len(text) % 4 == 1:
        raise ValueError("not base64url")
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64(raw) != text:
        raise ValueError("not canonical base64url")
    return raw


def key_id(key: bytes) -> str:
    """The ``kid`` of a key: 8 characters of a hash of it, naming it without revealing it."""
    return _b64(hashlib.sha256(_KID_CONTEXT + key).digest())[:8]


def new_portal_key() -> str:
    """A new portal key (``opk_`` and 32 random bytes): put it in OUTBOX_PORTAL_KEY."""
    return KEY_PREFIX + _b64(secrets.token_bytes(MIN_KEY_BYTES))


class PortalKeys:
    """Portal keys, the first signing, every one verifying (a rotation: ``new,old``)."""

    __slots__ = ("_by_kid", "_signing")

    def __init__(self, keys: list[bytes]) -> None:
        if not keys:
            raise PortalKeyMissing(_missing())
        if any(len(k) < MIN_KEY_BYTES for k in keys):
            # However the keys were made (an empty secret would let anyone mint a token).
            raise OutboxValidationError("key", f"a portal key has fewer than {MIN_KEY_BYTES} bytes")
        self._signing = (key_id(keys[0]), keys[0])
        self._by_kid = {key_id(k): k for k in keys}

    def __repr__(self) -> str:  # never the keys
        return f"PortalKeys(<{len(self._by_kid)} key(s)>)"

    @classmethod
    def parse(cls, text: str, where: str = "key") -> PortalKeys:
        keys = []
        for n, part in enumerate(p.strip() for p in text.split(",")):
            what = f"{where}: key {n + 1}"
            if not part.startswith(KEY_PREFIX):
                raise OutboxValidationError(where, f"{what} does not start with {KEY_PREFIX!r}")
            try:
                raw = _unb64(part[len(KEY_PREFIX) :])
            except ValueError:
                raise OutboxValidationError(where, f"{what} is not base64url") from None
            if len(raw) < MIN_KEY_BYTES:
                raise OutboxValidationError(
                    where, f"{what} is {len(raw)} bytes, fewer than {MIN_KEY_BYTES}"
                )
            keys.append(raw)
        return cls(keys)

    @classmethod
    def of(cls, key: str | PortalKeys | None) -> PortalKeys:
        """``key`` as given, else OUTBOX_PORTAL_KEY."""
        if isinstance(key, PortalKeys):
            return key
        if key is not None:
            return cls.parse(key)
        text = os.environ.get(KEY_VARIABLE, "").strip()
        if not text:
            raise PortalKeyMissing(_missing())
        return cls.parse(text, KEY_VARIABLE)

    def sign(self, claims: Mapping[str, Any]) -> str:
        kid, key = self._signing
        head = _b64(_json({"alg": "HS256", "kid": kid, "typ": "JWT"}))
        body = _b64(_json(claims))
        signed = f"{head}.{body}".encode("ascii")
        return f"{head}.{body}.{_b64(hmac.digest(key, signed, 'sha256'))}"

    def seal(self, purpose: str, data: bytes) -> str:
        """A signature of ``data`` for ``purpose`` (a preview's selection, handed to the
        client and back), with the first key; never valid as a token's."""
        return _b64(hmac.digest(self._signing[1], _sealed(purpose, data), "sha256"))

    def sealed(self, purpose: str, data: bytes, signature: str) -> bool:
        """Whether ``signature`` is :meth:`seal`'s, by any of the keys (one rotated in since
        the seal was made included)."""
        if not isinstance(signature, str) or not signature.isascii():
            return False
        wanted = signature.encode()
        return any(
            hmac.compare_digest(
                wanted, _b64(hmac.digest(k, _sealed(purpose, data), "sha256")).encode()
            )
            for k in self._by_kid.values()
        )

    def claims_of(self, token: str) -> dict[str, Any]:
        """The claims of a token signed by one of these keys (the header checked first)."""
        if not isinstance(token, str) or len(token) > MAX_TOKEN_BYTES:
            raise PortalTokenRefused("malformed", f"not a str of at most {MAX_TOKEN_BYTES} bytes")
        parts = token.split(".")
        if len(parts) != 3 or not all(_B64URL.fullmatch(p) for p in parts):
            raise PortalTokenRefused("malformed", "not three dot-separated base64url parts")
        try:
            header = _strict_json(_unb64(parts[0]))
            signature = _unb64(parts[2])
        except (ValueError, RecursionError):
            raise PortalTokenRefused("malformed", "a part is not base64url JSON") from None
        if not isinstance(header, dict) or set(header) != _HEADER_MEMBERS:
            raise PortalTokenRefused("algorithm", "the header is not alg, kid and typ alone")
        if header["alg"] != "HS256" or header["typ"] != "JWT":
            raise PortalTokenRefused("algorithm", "only alg HS256, typ JWT are taken")
        key = self._by_kid.get(header["kid"]) if isinstance(header["kid"], str) else None
        if key is None:
            raise PortalTokenRefused("unknown_key", "signed by a key not configured here")
        signed = f"{parts[0]}.{parts[1]}".encode("ascii")
        if not hmac.compare_digest(hmac.digest(key, signed, "sha256"), signature):
            raise PortalTokenRefused("signature", "the signature does not match")
        try:
            claims = _strict_json(_unb64(parts[1]))
        except (ValueError, RecursionError):
            raise PortalTokenRefused("malformed", "the claims are not base64url JSON") from None
        if not isinstance(claims, dict):
            raise PortalTokenRefused("claims", "the claims are not a JSON object")
        return claims


def _sealed(purpose: str, data: bytes) -> bytes:
    # A context of its own: a seal is never a token's signature, nor one purpose's another's.
    return b"outbox-portal seal\0" + purpose.encode() + b"\0" + data


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        # Python keeps the last of two members, other readers the first: a token must mean
        # one thing to every reader of it.
        raise ValueError("a member given twice")
    return found


def _strict_json(raw: bytes) -> Any:
    """JSON in UTF-8 only (json.loads would also take UTF-16, UTF-32 and a byte order mark:
    several byte forms of one header), no member twice."""
    return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)


def _json(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _missing() -> str:
    return (
        f"no portal key: pass key= or set {KEY_VARIABLE} (make one with "
        "`outbox-relay endpoints portal-key`; the same value for the application and the portal)"
    )


def _epoch(now: datetime | None) -> float:
    if now is None:
        return time.time()
    if not isinstance(now, datetime) or now.tzinfo is None:
        raise OutboxValidationError("now", "must be a timezone-aware datetime or None")
    return now.timestamp()


def audience(schema: str) -> str:
    if not isinstance(schema, str) or not schema:
        raise OutboxValidationError("schema", "must be a non-empty str")
    return f"outbox-portal:{schema}"


def _seconds(ttl: timedelta | int | float) -> int:
    seconds = ttl.total_seconds() if isinstance(ttl, timedelta) else ttl
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise OutboxValidationError("ttl", "must be a timedelta or a number of seconds")
    if not 1 <= seconds <= MAX_TTL.total_seconds():
        raise OutboxValidationError("ttl", f"must be from 1 s to {MAX_TTL.days} days")
    return int(seconds)


def portal_token(
    *,
    tenant: str,
    ttl: timedelta | int | float = DEFAULT_TTL,
    key: str | PortalKeys | None = None,
    read_only: bool = False,
    schema: str = "public",
    now: datetime | None = None,
) -> str:
    """A signed token that opens the portal for ``tenant`` (read and write, or ``read_only``)
    for ``ttl`` (at most MAX_TTL), for the outbox in ``schema``."""
    label = _label("tenant", tenant, MAX_TENANT_BYTES)
    if label is None:
        raise OutboxValidationError("tenant", "must be a non-empty str")
    iat = int(_epoch(now))
    claims = {
        "iss": ISSUER,
        "aud": audience(schema),
        "sub": label,
        "scope": "read" if read_only else "read write",
        "iat": iat,
        "exp": iat + _seconds(ttl),
        "jti": _b64(secrets.token_bytes(16)),
    }
    return PortalKeys.of(key).sign(claims)


SESSION_HOURS = 12  # a portal session (the page's cookie) lasts at most this long


def session_audience(schema: str) -> str:
    """The audience of the portal page's own session tokens: a session cookie is no bearer
    token of the API, nor a link's token a session."""
    return f"outbox-portal-session:{audience(schema).partition(':')[2]}"


def session_token(
    access: PortalAccess,
    *,
    key: str | PortalKeys | None = None,
    schema: str = "public",
    now: datetime | None = None,
) -> str:
    """The portal page's session for a verified link token: the same tenant, rights and
    token id, until the link's own expiry or SESSION_HOURS, whichever comes first."""
    iat = int(_epoch(now))
    exp = min(int(access.expires.timestamp()), iat + SESSION_HOURS * 3600)
    if exp <= iat:
        raise PortalTokenRefused("expired", "the token has expired: open a new link")
    claims = {
        "iss": ISSUER,
        "aud": session_audience(schema),
        "sub": access.tenant,
        "scope": "read write" if access.write else "read",
        "iat": iat,
        "exp": exp,
        "jti": access.token_id,
    }
    return PortalKeys.of(key).sign(claims)


def portal_url(
    base_url: str,
    *,
    tenant: str,
    ttl: timedelta | int | float = DEFAULT_TTL,
    key: str | PortalKeys | None = None,
    read_only: bool = False,
    schema: str = "public",
) -> str:
    """The portal's link for ``tenant``: ``base_url`` (where the portal is served, such as
    https://hooks.example.com/portal) with the token in its fragment, which a browser never
    sends to a server (nor into a log or a Referer)."""
    token = portal_token(tenant=tenant, ttl=ttl, key=key, read_only=read_only, schema=schema)
    return portal_link(base_url, token)


def portal_link(base_url: str, token: str) -> str:
    """``base_url`` (where the portal is served) with ``token`` in its fragment. The URL must
    be one plain http(s) URL: no user info (``good@evil``), backslash, space, control
    character, query or fragment, any of which could send the browser, and the fragment,
    somewhere else."""
    if not isinstance(base_url, str) or not re.fullmatch(
        r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~!$&'()*+,;=:@%/-]*)?", base_url
    ):
        raise OutboxValidationError(
            "base_url",
            "must be one plain http(s) URL, host and path only (no user info, query, "
            "fragment, space or backslash): where the portal is served",
        )
    return f"{base_url.rstrip('/')}/#token={token}"


def verify_portal_token(
    token: str,
    *,
    key: str | PortalKeys | None = None,
    schema: str = "public",
    now: datetime | None = None,
    aud: str | None = None,
) -> PortalAccess:
    """What ``token`` grants, or :class:`PortalTokenRefused` saying why not. ``aud``: the
    audience expected (the portal's own session tokens have their own)."""
    claims = PortalKeys.of(key).claims_of(token)
    at = _epoch(now)
    if not set(claims) <= _CLAIMS or not {"iss", "aud", "sub", "scope", "iat", "exp", "jti"} <= set(
        claims
    ):
        raise PortalTokenRefused("claims", "claims missing or not known here")
    if claims["iss"] != ISSUER:
        raise PortalTokenRefused("claims", f"iss is not {ISSUER!r}")
    if claims["aud"] != (aud or audience(schema)):
        raise PortalTokenRefused("audience", "minted for another outbox or use")
    times = [claims[c] for c in ("iat", "exp", "nbf") if c in claims]
    if any(isinstance(t, bool) or not isinstance(t, int) for t in times):
        raise PortalTokenRefused("claims", "iat, exp and nbf must be integer seconds")
    iat, exp = claims["iat"], claims["exp"]
    if not 0 < exp - iat <= MAX_TTL.total_seconds():
        raise PortalTokenRefused("claims", f"exp must follow iat by at most {MAX_TTL.days} days")
    if exp <= at - LEEWAY:
        raise PortalTokenRefused("expired", "the token has expired: open a new link")
    if iat >= at + LEEWAY or claims.get("nbf", iat) >= at + LEEWAY:
        raise PortalTokenRefused("not_yet", "the token is not valid yet (clocks apart?)")
    scope, jti, sub = claims["scope"], claims["jti"], claims["sub"]
    words = scope.split(" ") if isinstance(scope, str) else []
    if "read" not in words or not set(words) <= set(SCOPES) or len(set(words)) != len(words):
        raise PortalTokenRefused("claims", "scope must be 'read' or 'read write'")
    if not isinstance(jti, str) or not 16 <= len(jti) <= 64 or not _B64URL.fullmatch(jti):
        raise PortalTokenRefused("claims", "jti must be 16-64 base64url characters")
    try:
        tenant = _label("tenant", sub, MAX_TENANT_BYTES) if isinstance(sub, str) else None
    except OutboxValidationError:
        tenant = None
    if tenant is None:
        raise PortalTokenRefused("claims", "sub is not a tenant")
    return PortalAccess(tenant, jti, "write" in words, datetime.fromtimestamp(exp, UTC))
