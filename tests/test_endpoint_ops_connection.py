"""The endpoints operations (relay/ops/endpoints.py) take the caller's asyncpg connection, as
the other operations do, and run the library over it through SQLAlchemy: they give it back as
they found it (the review of issue #28 found SQLAlchemy's JSON codecs left on it)."""

from __future__ import annotations

import asyncpg

from relay.cli.options import with_db
from relay.ops import endpoints as ops


def test_an_endpoint_operation_leaves_the_callers_connection_as_it_found_it(db_url: str) -> None:
    read = """SELECT '{"a": 1}'::jsonb AS b, '{"a": 1}'::json AS j"""

    async def go(conn: asyncpg.Connection) -> tuple[object, object]:
        before = tuple(await conn.fetchrow(read))
        await ops.list_endpoints(conn, "public", destination=None, tenant=None)
        after = tuple(await conn.fetchrow(read))
        return before, after

    before, after = with_db(db_url, go)
    assert before == after == ('{"a": 1}', '{"a": 1}'), (before, after)
