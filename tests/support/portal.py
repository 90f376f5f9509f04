"""The tenant portal served on loopback for a test: its keys, a token per tenant, a client."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from starlette.applications import Starlette
from starlette.routing import Mount

from outbox.endpoints import portal_tokens as pt
from relay.portal.app import build_portal
from relay.portal.changes import Policy
from relay.portal.state import Portal
from tests.support.asgi import serve

if TYPE_CHECKING:
    from relay.catalog.view import CatalogView

DEST = "customer-events"  # tests/test_endpoint_delivery.py's destination


@dataclass
class Served:
    url: str  # the portal's base, .../portal
    keys: pt.PortalKeys
    state: Portal

    def token(self, tenant: str, *, read_only: bool = False) -> str:
        return pt.portal_token(tenant=tenant, key=self.keys, read_only=read_only)

    def client(self, tenant: str | None = None, *, read_only: bool = False) -> httpx.AsyncClient:
        headers = {}
        if tenant is not None:
            headers["authorization"] = f"Bearer {self.token(tenant, read_only=read_only)}"
        return httpx.AsyncClient(base_url=f"{self.url}/api", headers=headers, timeout=30)


@contextlib.asynccontextmanager
async def served_portal(
    db_url: str,
    policy: Policy | None = None,
    embed_origins: tuple[str, ...] = (),
    catalog: CatalogView | None = None,
) -> AsyncIterator[Served]:
    keys = pt.PortalKeys.parse(pt.new_portal_key())
    policy = policy or Policy((DEST,), allow_private_networks=True)
    inner = build_portal(db_url, keys, policy, embed_origins=embed_origins, catalog=catalog)
    app = Starlette(routes=[Mount("/portal", app=inner)])
    state: Portal = inner.state.portal
    try:
        async with serve(app) as url:
            yield Served(f"{url}/portal", keys, state)
    finally:
        await state.close()
