"""Every database session of the relay, its console and its commands runs without JIT
(relay/db/session.py). Found while measuring drains: the pending gauges' count over a backlog of
150,000 rows was compiled with LLVM at every stats_interval (1.2 s of CPU for a statement
that runs in 100 ms), a tenth of the machine's CPU on a drain. Each test runs a statement
whose estimated cost passes jit_above_cost on a session opened as the product opens it, and
reads its EXPLAIN for a JIT section; a plain session is the control."""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from relay.cli.options import with_db
from relay.db.store import create_pool
from relay.ui.state import Console

# Ten million rows by the planner's estimate (generate_series' support function): a cost of
# about 150,000 against jit_above_cost's 100,000. EXPLAIN without ANALYZE shows the JIT the
# plan would use without running it.
COSTLY = "EXPLAIN (FORMAT JSON) SELECT sum(x) FROM generate_series(1, 10000000) AS x"


def jitted(plan: Any) -> bool:
    doc = json.loads(plan) if isinstance(plan, str) else plan
    return "JIT" in doc[0]


async def explain(conn: Any) -> bool:
    return jitted(await conn.fetchval(COSTLY))


@pytest.fixture
async def jit_available(db_url: str) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        if not await explain(conn):
            pytest.skip("this server does not JIT-compile such a statement (jit off, or no LLVM)")
    finally:
        await conn.close()


@pytest.mark.usefixtures("jit_available")
async def test_the_relays_sessions_do_not_jit(db_url: str) -> None:
    pool = await create_pool(to_asyncpg_dsn(db_url), "jit-test", 2)
    try:
        async with pool.acquire() as conn:
            assert not await explain(conn)
    finally:
        await pool.close()


@pytest.mark.usefixtures("jit_available")
async def test_the_consoles_sessions_do_not_jit(db_url: str) -> None:
    console = Console(db_url, "public", guard=None, read_only=True, templates=None)  # type: ignore[arg-type]
    try:
        async with console.connection() as conn:
            assert not await explain(conn)
    finally:
        await console.close()


@pytest.mark.usefixtures("jit_available")
def test_the_commands_sessions_do_not_jit(db_url: str) -> None:
    assert with_db(db_url, explain) is False


@pytest.mark.usefixtures("jit_available")
def test_the_endpoint_commands_sessions_do_not_jit(db_url: str) -> None:
    """Their SQLAlchemy connection, for outbox.endpoints, is the command's own session."""
    from sqlalchemy import text

    from relay.ops.endpoints import sqlalchemy_on

    async def explain_through_sqlalchemy(conn: asyncpg.Connection) -> bool:
        async with sqlalchemy_on(conn) as sa:
            return jitted((await sa.execute(text(COSTLY))).scalar_one())

    assert with_db(db_url, explain_through_sqlalchemy) is False
