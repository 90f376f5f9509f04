"""What the console's handlers share (one :class:`Console` per app, in ``app.state``): the
database, the guard, the templates. Its own module, so that the pages and actions it serves
can name it without importing the app that assembles them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import asyncpg
from jinja2 import Environment
from starlette.requests import Request
from starlette.responses import HTMLResponse

from outbox.dburl import to_asyncpg_dsn
from relay.db.session import SESSION_SETTINGS
from relay.db.snapshots import DEFAULT_WARNING as DEFAULT_SNAPSHOT_WARNING
from relay.ui.security import CSRF_FIELD, Caller, Guard

if TYPE_CHECKING:
    from relay.catalog.view import CatalogView

# Statements of the console are cut short rather than left to load the database.
STATEMENT_TIMEOUT_MS = 10_000


@dataclass
class Console:
    """What the handlers share."""

    database_url: str = field(repr=False)  # holds the password
    schema: str
    guard: Guard
    read_only: bool
    templates: Environment
    # Seconds past which the snapshot holding back VACUUM is named on the pages.
    snapshot_warning: float = DEFAULT_SNAPSHOT_WARNING
    # The event catalog (relay/ui/catalog.py): None when none is configured.
    catalog: CatalogView | None = None
    pool: asyncpg.Pool | None = None
    _opening: asyncio.Lock = field(default_factory=asyncio.Lock)

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        if self.pool is None:
            # Opened on first use: mounted in the relay's listener, no lifespan runs.
            async with self._opening:
                if self.pool is None:
                    self.pool = await asyncpg.create_pool(
                        to_asyncpg_dsn(self.database_url),
                        min_size=1,
                        max_size=4,
                        server_settings={
                            "application_name": "outbox-relay console",
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

    def render(
        self, request: Request, name: str, status_code: int = 200, **context: Any
    ) -> HTMLResponse:
        template = self.templates.get_template(name)
        message = request.query_params.get("msg")
        if not self.guard.signed(message, request.query_params.get("sig")):
            # Only what an action of this console said (signed): a link from elsewhere
            # cannot put its own words on these pages.
            message = None
        signed_in = context.pop("signed_in", True)
        caller: Caller | None = request.scope.get("state", {}).get("caller")
        session = caller.session if caller is not None and signed_in else None
        html = template.render(
            base=request.scope.get("root_path", ""),
            read_only=self.read_only,
            operators=self.guard.operators,
            csrf_field=CSRF_FIELD,
            # A script's pages (bearer token) need none: its actions carry the header.
            csrf=session.csrf if session is not None else "",
            operator=caller.who.operator if caller is not None and signed_in else None,
            schema=self.schema if signed_in else "",
            signed_in=signed_in,
            message=message,
            **context,
        )
        return HTMLResponse(html, status_code=status_code)
