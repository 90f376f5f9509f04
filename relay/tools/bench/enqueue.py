"""``enqueue``: what writing events costs an application."""

from __future__ import annotations

import time
from typing import Any

import asyncpg

import outbox
from outbox.dburl import to_asyncpg_dsn
from relay.tools.bench.common import DESTINATION
from relay.tools.bench.steady import BUSINESS, ORDER


async def enqueue(
    db_url: str, *, transactions: int, bulk_rows: int, chunk: int, payload: int
) -> dict[str, Any]:
    body = {"pad": "x" * max(0, payload - 10)}
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(BUSINESS)

        async def txs(with_event: bool) -> float:
            started = time.perf_counter()
            for i in range(transactions):
                async with conn.transaction():
                    order = await conn.fetchval(ORDER, i)
                    if with_event:
                        await outbox.enqueue(
                            conn, destination=DESTINATION, key=str(order), payload=body
                        )
            return time.perf_counter() - started

        await txs(True)  # warm up: prepared statements, caches
        plain = await txs(False)
        with_event = await txs(True)
        events = [
            {"destination": DESTINATION, "key": str(i), "payload": body} for i in range(chunk)
        ]
        started = time.perf_counter()
        written = 0
        while written < bulk_rows:
            async with conn.transaction():
                written += len(await outbox.enqueue_many(conn, events))  # type: ignore[arg-type]
        bulk = time.perf_counter() - started
    finally:
        await conn.close()
    return {
        "transactions": transactions,
        "tx_without_event_ms": round(plain / transactions * 1000, 3),
        "tx_with_event_ms": round(with_event / transactions * 1000, 3),
        "added_per_enqueue_ms": round((with_event - plain) / transactions * 1000, 3),
        "enqueue_tx_per_s": round(transactions / with_event, 1),
        "enqueue_many_rows": written,
        "enqueue_many_chunk": chunk,
        "enqueue_many_rows_per_s": round(written / bulk, 1),
    }
