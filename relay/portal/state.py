"""What the portal's handlers share (one :class:`Portal` per app, in ``app.state``): the
database, the keys that verify tokens and seal previews, the operator's policy, the limits."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import asyncpg

from outbox.dburl import to_asyncpg_dsn
from outbox.endpoints.portal_tokens import PortalKeys
from relay.db.session import SESSION_SETTINGS
from relay.portal.changes import Policy
from relay.portal.limits import Limits, Rate

if TYPE_CHECKING:
    from relay.catalog.view import CatalogView

# A tenant's statement is cut short rather than left to load the database.
STATEMENT_TIMEOUT_MS = 10_000
DEFAULT_RATE = Rate(per_second=10, burst=50)
DEFAULT_WRITE_RATE = Rate(per_second=2, burst=10)


@dataclass
class Portal:
    database_url: str = field(repr=False)  # holds the password
    schema: str
    keys: PortalKeys
    policy: Policy
    # Sites whose pages may frame the portal's (empty: none may).
    embed_origins: tuple[str, ...] = ()
    # The event catalog (None: none configured); its types on the policy's destinations are
    # the ones offered to tenants.
    catalog: CatalogView | None = None
    limits: Limits = field(default_factory=lambda: Limits(DEFAULT_RATE))
    write_limits: Limits = field(default_factory=lambda: Limits(DEFAULT_WRITE_RATE))
    pool: asyncpg.Pool | None = None
    _opening: asyncio.Lock = field(default_factory=asyncio.Lock)

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        if self.pool is None:
            async with self._opening:  # opened on first use, as the console's
                if self.pool is None:
                    self.pool = await asyncpg.create_pool(
                        to_asyncpg_dsn(self.database_url),
                        min_size=1,
                        max_size=4,
                        server_settings={
                            "application_name": "outbox-relay portal",
                            "statement_timeout": str(STATEMENT_TIMEOUT_MS),
                            **SESSION_SETTINGS,
                        },
                    )
        async with self.pool.acquire() as conn:
            yield conn

    async def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            await pool.close()

    def event_types(self) -> list[dict[str, Any]]:
        """The catalog's types carried by the destinations tenants add endpoints to (never a
        type that only Kafka or a webhook of the operator carries); the same for every
        tenant. Empty without a catalog, or with one that could not be loaded."""
        if self.catalog is None or not self.catalog.available:
            return []
        return self.catalog.for_destinations(self.policy.destinations)
