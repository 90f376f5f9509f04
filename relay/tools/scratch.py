"""Throwaway databases for the demo and the benchmark, dropped afterwards."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from outbox import queries
from outbox.dburl import to_asyncpg_dsn


def with_database(url: str, name: str) -> str:
    return urlunsplit(urlsplit(to_asyncpg_dsn(url))._replace(path="/" + name))


@contextlib.asynccontextmanager
async def scratch_database(admin_url: str, prefix: str, keep: bool = False) -> AsyncIterator[str]:
    """Create a fresh database on ``admin_url``'s server; yield its URL; drop it."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(to_asyncpg_dsn(admin_url))
    try:
        await admin.execute(queries.render_database(queries.CREATE_DATABASE, name))
    finally:
        await admin.close()
    try:
        yield with_database(admin_url, name)
    finally:
        if not keep:
            admin = await asyncpg.connect(to_asyncpg_dsn(admin_url))
            try:
                await admin.execute(queries.render_database(queries.DROP_DATABASE, name))
            finally:
                await admin.close()
