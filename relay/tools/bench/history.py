"""``history``: claim latency on an empty table and beside many delivered rows."""

from __future__ import annotations

import time
from typing import Any

import asyncpg

from outbox import queries
from outbox.dburl import to_asyncpg_dsn
from relay.db import queries as relay_queries
from relay.tools.bench.common import (
    DESTINATION,
    FILL_HISTORY,
    VACUUM_ANALYZE,
    percentile,
    prefill,
)


async def _claims(conn: asyncpg.Connection, claim: str, rounds: int, batch: int) -> list[float]:
    times = []
    for _ in range(rounds):
        tx = conn.transaction()
        await tx.start()
        started = time.perf_counter()
        await conn.fetch(claim, DESTINATION, batch, "bench", 30.0, 0, 2**62, 0)
        times.append((time.perf_counter() - started) * 1000)
        await tx.rollback()  # leave the pending rows for the next round
    return times


async def history(db_url: str, *, rows: int, rounds: int, batch: int) -> dict[str, Any]:
    claim = queries.render(relay_queries.CLAIM, queries.qualified_table("public"))
    await prefill(db_url, 5000, 200, 100)
    conn = await asyncpg.connect(
        to_asyncpg_dsn(db_url), server_settings={"plan_cache_mode": "force_custom_plan"}
    )
    try:
        await _claims(conn, claim, 20, batch)
        empty = await _claims(conn, claim, rounds, batch)
        step = 500_000
        for start in range(0, rows, step):
            await conn.execute(FILL_HISTORY, DESTINATION, min(step, rows - start), 200)
        await conn.execute(VACUUM_ANALYZE)
        await _claims(conn, claim, 20, batch)
        full = await _claims(conn, claim, rounds, batch)
    finally:
        await conn.close()
    p50_empty, p50_full = percentile(empty, 50), percentile(full, 50)
    return {
        "delivered_rows": rows,
        "claim_batch": batch,
        "empty_p50_ms": round(p50_empty, 3),
        "empty_p95_ms": round(percentile(empty, 95), 3),
        "history_p50_ms": round(p50_full, 3),
        "history_p95_ms": round(percentile(full, 95), 3),
        "history_vs_empty": round(p50_full / p50_empty, 2),
    }
