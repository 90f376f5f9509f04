"""The relay's HTTP client for webhooks: aiohttp, pooled, keep-alive, no redirects, SSRF-guarded.

aiohttp rather than httpx: on this machine it sends the same signed POST for about a tenth of
the CPU (docs/performance.md, "HTTP clients"). Every guarantee of the sink lives here or in
the sink, not in the library's defaults:

- the SSRF guard is the connector's resolver: it resolves once, refuses the host when any
  answer is outside the destination's policy, and hands the connector exactly the checked
  addresses (no second lookup for a rebinding attacker to answer). aiohttp does not resolve
  IP literals, so the sink checks those itself (``literal_refusal``);
- one session (one connection pool) per address policy: a connection opened for a destination
  allowed to reach 10.0.0.5 is never lent to one that is not;
- no proxy from the environment, no cookies kept between receivers, no decompression (a
  compressed error body could expand far past the bytes we read), redirects not followed.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from outbox.webhooks.ssrf import AddressPolicy, AddressRefused, IPAddress, resolve
from relay.sinks.webhook.config import WebhookClientSettings


class GuardedResolver(AbstractResolver):
    """Resolves a host once and returns only addresses its policy permits, or refuses it."""

    def __init__(self, policy: AddressPolicy) -> None:
        self.policy = policy

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        addresses = await resolve(host, port)
        if not addresses:
            raise OSError(f"DNS lookup of {host} returned no address")
        # One refused address refuses the host: a mix of public and private answers is a
        # classic rebinding set-up, and we would not know which one a retry reaches.
        refused = [a for a in addresses if not self.policy.permits(a)]
        if refused:
            raise AddressRefused(host, refused)
        return [_result(host, ip, port) for ip in addresses]

    async def close(self) -> None:
        return None


def _result(host: str, ip: IPAddress, port: int) -> ResolveResult:
    return {
        "hostname": host,
        "host": str(ip),
        "port": port,
        "family": socket.AF_INET6 if ip.version == 6 else socket.AF_INET,
        "proto": 0,
        "flags": socket.AI_NUMERICHOST,
    }


# Everything printable in ASCII stays as written; spaces and other text are percent-encoded.
_AS_WRITTEN = "".join(chr(c) for c in range(0x21, 0x7F))


def request_url(configured: str) -> URL:
    """The URL to request, its path and query sent as configured: receivers that sign or
    compare the request target must see ``%2F`` and ``%41`` as written, not normalised.
    Only characters that cannot appear in a request line are percent-encoded (as UTF-8);
    the host is IDNA-encoded; a fragment is never sent."""
    parsed = URL(configured)
    parts = urlsplit(configured)
    host = parsed.raw_host or ""
    return URL.build(
        scheme=parsed.scheme,
        host=f"[{host}]" if ":" in host else host,  # encoded: IPv6 brackets are ours to add
        port=parsed.explicit_port,
        path=quote(parts.path or "/", safe=_AS_WRITTEN),
        query_string=quote(parts.query, safe=_AS_WRITTEN),
        encoded=True,
    )


def literal_refusal(host: str, policy: AddressPolicy) -> AddressRefused | None:
    """Why a URL whose host is an IP literal may not be reached, if it may not."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None  # a name: the resolver checks it on each new connection
    return None if policy.permits(ip) else AddressRefused(host, [ip])


class Sessions:
    """One aiohttp session per address policy, created on first use."""

    def __init__(
        self, settings: WebhookClientSettings, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self._settings = settings
        self._ssl = ssl_context or ssl.create_default_context()
        self._sessions: dict[AddressPolicy, aiohttp.ClientSession] = {}

    def get(self, policy: AddressPolicy) -> aiohttp.ClientSession:
        session = self._sessions.get(policy)
        if session is None:
            session = self._sessions[policy] = self._open(policy)
        return session

    def _open(self, policy: AddressPolicy) -> aiohttp.ClientSession:
        s = self._settings
        connector = aiohttp.TCPConnector(
            limit=s.max_connections,
            limit_per_host=0,  # each endpoint's max_concurrency bounds it instead
            keepalive_timeout=s.keepalive_expiry,
            resolver=GuardedResolver(policy),
            ssl=self._ssl,
        )
        headers: dict[str, Any] = {
            "user-agent": s.user_agent,
            "accept-encoding": "identity",
        }
        return aiohttp.ClientSession(
            connector=connector,
            headers=headers,
            trust_env=False,  # an HTTP(S)_PROXY would connect on our behalf, past the guard
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),  # one receiver's cookies are not another's
            timeout=aiohttp.ClientTimeout(total=None),  # per request, from the destination
            raise_for_status=False,
        )

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()
