"""The relay's HTTP client for webhooks: pooled, keep-alive, no redirects, SSRF-guarded.

Our own HTTP/1.1 client (http1.py) rather than aiohttp: on this machine it sends the same
signed POST for about a quarter of the CPU (docs/performance.md, "A client of our own"), and
aiohttp for a tenth of httpx's before it. Every guarantee of the sink lives here or in the
sink, not in a library's defaults:

- the SSRF guard is in the connect step: a name is resolved once per new connection, refused
  when any answer is outside the destination's policy, and exactly the checked addresses are
  connected to (no second lookup for a rebinding attacker to answer). IP literals are
  checked once, when the target is built (``literal_refusal``);
- one pool per address policy: a connection opened for a destination allowed to reach
  10.0.0.5 is never lent to one that is not;
- no proxy from the environment, no cookies, no decompression (a compressed error body could
  expand far past the bytes we read), redirects not followed.
"""

from __future__ import annotations

import ipaddress
import ssl
from urllib.parse import quote, urlsplit

from yarl import URL

from outbox.webhooks.ssrf import AddressPolicy, AddressRefused
from relay.sinks.webhook.config import WebhookClientSettings
from relay.sinks.webhook.http1 import Pools

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


def pools(settings: WebhookClientSettings, ssl_context: ssl.SSLContext | None = None) -> Pools:
    """The client's pools: one per address policy, ``max_connections`` each in use at once,
    idle connections closed after ``keepalive_expiry``."""
    return Pools(settings.max_connections, settings.keepalive_expiry, ssl_context)
