"""The relay's one shared HTTP client: pooled, keep-alive, no redirects, SSRF-guarded."""

from __future__ import annotations

import ssl

import httpcore
import httpx

from relay.sinks.webhook.config import WebhookClientSettings
from relay.sinks.webhook.ssrf import PUBLIC_ONLY, AddressPolicy, GuardedBackend

# Request extension naming the AddressPolicy a request must obey (httpcore ignores it).
POLICY = "outbox_address_policy"


class GuardedTransport(httpx.AsyncBaseTransport):
    """Routes each request to a connection pool dedicated to its address policy.

    A pooled connection was checked against the policy of the request that opened it, so
    pools are never shared between policies: a destination allowed to reach 10.0.0.5 cannot
    lend that connection to one that is not. Nearly every relay has one policy, one pool.
    """

    def __init__(
        self, settings: WebhookClientSettings, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self._settings = settings
        self._ssl = ssl_context or httpx.create_ssl_context()
        self._pools: dict[AddressPolicy, httpx.AsyncHTTPTransport] = {}

    def _pool(self, policy: AddressPolicy) -> httpx.AsyncHTTPTransport:
        transport = self._pools.get(policy)
        if transport is None:
            s = self._settings
            transport = httpx.AsyncHTTPTransport(verify=self._ssl, trust_env=False)
            # httpx offers no network_backend option, so we swap its pool for one built with
            # ours; httpx keeps mapping httpcore's exceptions and streams as usual.
            if not isinstance(getattr(transport, "_pool", None), httpcore.AsyncConnectionPool):
                raise RuntimeError("unsupported httpx version: AsyncHTTPTransport._pool changed")
            transport._pool = httpcore.AsyncConnectionPool(
                ssl_context=self._ssl,
                max_connections=s.max_connections,
                max_keepalive_connections=s.max_keepalive_connections,
                keepalive_expiry=s.keepalive_expiry,
                network_backend=GuardedBackend(policy),
            )
            self._pools[policy] = transport
        return transport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        policy = request.extensions.get(POLICY, PUBLIC_ONLY)
        if not isinstance(policy, AddressPolicy):
            raise TypeError(f"request extension {POLICY!r} must be an AddressPolicy")
        return await self._pool(policy).handle_async_request(request)

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for transport in pools:
            await transport.aclose()


def build_client(settings: WebhookClientSettings) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=GuardedTransport(settings),
        follow_redirects=False,  # a 3xx is an answer, not an instruction: it may point inside
        trust_env=False,  # an HTTP(S)_PROXY would connect on our behalf, past the guard
        headers={
            "user-agent": settings.user_agent,
            # Compressed error bodies could expand far past the cap we read.
            "accept-encoding": "identity",
        },
    )
