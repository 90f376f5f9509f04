"""An endpoint's tenant_since (migration 0019): set when its tenant changes, whatever writes
the change, and only then. The tenant portal shows a tenant the deliveries made since."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine

import outbox.endpoints
from outbox.dburl import to_asyncpg_dsn
from tests.test_endpoint_delivery import (
    add_endpoint,
    aengine,  # noqa: F401  (fixture)
)
from tests.test_endpoints_cli import cli


async def _since(db_url: str, endpoint_id: int) -> Any:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        return await conn.fetchval(
            "SELECT tenant_since FROM outbox_endpoints WHERE id = $1", endpoint_id
        )
    finally:
        await conn.close()


async def _sql(db_url: str, query: str, *args: Any) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(query, *args)
    finally:
        await conn.close()


async def test_tenant_since_moves_with_the_tenant_only(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
) -> None:
    ep = await add_endpoint(aengine, "http://127.0.0.1:9/in", tenant="a")
    assert await _since(db_url, ep.id) is None  # its tenant since it was created
    async with aengine.begin() as conn:
        await outbox.endpoints.update(
            conn, ep.id, description="other words", event_types=["x"], check_dns=False
        )
        await outbox.endpoints.update(conn, ep.id, tenant="a", check_dns=False)
    assert await _since(db_url, ep.id) is None  # not its tenant: nothing moved
    async with aengine.begin() as conn:
        await outbox.endpoints.update(conn, ep.id, tenant="b", check_dns=False)
    first = await _since(db_url, ep.id)
    assert first is not None
    await _sql(db_url, "UPDATE outbox_endpoints SET tenant = NULL WHERE id = $1", ep.id)
    second = await _since(db_url, ep.id)
    assert second > first  # to every tenant: a change too
    await _sql(db_url, "UPDATE outbox_endpoints SET enabled = false WHERE id = $1", ep.id)
    assert await _since(db_url, ep.id) == second
    # The command runs its own event loop: in a thread, beside this test's.
    out = await asyncio.to_thread(cli, db_url, "update", str(ep.id), "--tenant", "c")
    assert out.exit_code == 0, out.output
    assert await _since(db_url, ep.id) > second


async def test_a_new_endpoints_tenant_since_is_empty_even_if_given(db_url: str) -> None:
    """Only a change sets it: an insert that names one keeps it (an import of endpoints with
    their history), the library's create leaves it empty."""
    await _sql(
        db_url,
        "INSERT INTO outbox_endpoints (destination, url, tenant, secret, tenant_since)"
        " VALUES ('d', 'http://127.0.0.1:9/', 'a', 's', '2026-01-01Z')",
    )
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        got = await conn.fetchval("SELECT tenant_since::text FROM outbox_endpoints")
    finally:
        await conn.close()
    assert got.startswith("2026-01-01")
