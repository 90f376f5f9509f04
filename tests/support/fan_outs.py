"""Fixtures of the fan-out tests (tests/test_fan_out_*.py): a connection, three endpoints
registered, and a deliveries store of relay "lanes" whose floors are read. Imported by the
test modules under their fixture names (``name=``), so a parameter never shadows an import."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from relay.db.pool import create_pool
from relay.db.store import Store
from relay.sinks.endpoints.store import DeliveryStore
from relay.tools.bench.fanout_setup import register
from tests.test_delivery_lanes import _claim_all

LEASE = 30.0


@pytest.fixture(name="conn")
async def conn_fixture(db_url: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture(name="endpoints")
async def endpoints_fixture(conn: asyncpg.Connection) -> list[int]:
    return await register(conn, [f"http://127.0.0.1:{9000 + i}/" for i in range(3)])


@pytest.fixture(name="store")
async def store_fixture(db_url: str) -> AsyncIterator[DeliveryStore]:
    pool = await create_pool(to_asyncpg_dsn(db_url), "lanes", 2)
    try:
        s = DeliveryStore(Store(pool, "public", "lanes", LEASE))
        assert await _claim_all(s) == []  # its floors read, as a relay's first claim does
        yield s
    finally:
        await pool.close()
