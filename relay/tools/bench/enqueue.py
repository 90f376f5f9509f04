"""``enqueue``: what writing events costs an application, with and without the event catalog's
validation (outbox.catalog, issue #31)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

import outbox
from outbox import Outbox
from outbox.dburl import to_asyncpg_dsn
from relay.tools.bench.common import DESTINATION
from relay.tools.bench.steady import BUSINESS, ORDER

TYPE = "bench.order"
# Rounds of each transaction phase, interleaved (A B C D A B C D …) so that a drift of this
# machine's speed during the run touches every phase alike; the medians are reported.
ROUNDS = 5
# Catalog checks timed alone (no database), per payload size.
CHECKS = 10_000


def bench_catalog(payload: int, validate: str) -> Any:
    """A catalog of one type, ``bench.order``: an order with lines and a pad field of about
    ``payload`` bytes, the shape applications declare (nested objects, an enum, bounds)."""
    from outbox.catalog import Catalog, EventType

    schema = {
        "type": "object",
        "required": ["order_id", "currency", "lines", "pad"],
        "additionalProperties": False,
        "properties": {
            "order_id": {"type": "integer", "minimum": 1},
            "currency": {"enum": ["EUR", "USD", "GBP"]},
            "placed_at": {"type": "string", "format": "date-time"},
            "lines": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["sku", "quantity"],
                    "properties": {
                        "sku": {"type": "string", "minLength": 1, "maxLength": 64},
                        "quantity": {"type": "integer", "minimum": 1},
                    },
                },
            },
            "pad": {"type": "string", "maxLength": max(payload, 1) * 2},
        },
    }
    catalog = Catalog(title="bench", validate=validate)  # type: ignore[arg-type]
    catalog.add(EventType.from_schema(TYPE, schema, destinations=[DESTINATION]))
    return catalog


def body(payload: int) -> dict[str, Any]:
    """A valid ``bench.order`` of about ``payload`` bytes as JSON."""
    lines = [{"sku": f"SKU-{i}", "quantity": i + 1} for i in range(3)]
    start = {"order_id": 1, "currency": "EUR", "placed_at": "2026-12-07T06:00:00Z", "lines": lines}
    return {**start, "pad": "x" * max(0, payload - 160)}


Writer = tuple[Callable[..., Awaitable[Any]], dict[str, Any]]


def writers(payload: int, many: bool) -> dict[str, Writer]:
    """The phases: an untyped event, a typed one with validation off, and on (reject)."""
    typed = {"event_type": TYPE}
    out: dict[str, Writer] = {"": (outbox.enqueue_many if many else outbox.enqueue, {})}
    for label, mode in (("typed_", "off"), ("validated_", "reject")):
        box = Outbox(catalog=bench_catalog(payload, mode))
        out[label] = (box.enqueue_many if many else box.enqueue, typed)
    return out


async def enqueue(
    db_url: str, *, transactions: int, bulk_rows: int, chunk: int, payload: int
) -> dict[str, Any]:
    event = body(payload)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(BUSINESS)
        times = await _transactions(conn, transactions, event, writers(payload, many=False))
        bulk = {
            prefix: await _bulk(conn, write, event, bulk_rows, chunk, extra)
            for prefix, (write, extra) in writers(payload, many=True).items()
        }
    finally:
        await conn.close()
    med = {k: statistics.median(v) / transactions * 1000 for k, v in times.items()}
    out: dict[str, Any] = {"transactions": transactions, "rounds": ROUNDS}
    for name, ms in med.items():
        out[f"tx_{name}_ms"] = round(ms, 3)
    out["added_per_enqueue_ms"] = round(med["with_event"] - med["without_event"], 3)
    out["added_per_validation_ms"] = round(med["with_validated_event"] - med["with_typed_event"], 3)
    out["enqueue_tx_per_s"] = round(1000 / med["with_event"], 1)
    out["enqueue_many_chunk"] = chunk
    for prefix, (rows, seconds) in bulk.items():
        out[f"enqueue_many_{prefix}rows"] = rows
        out[f"enqueue_many_{prefix}rows_per_s"] = round(rows / seconds, 1)
    out.update(validation_cost())
    return out


async def _transactions(
    conn: asyncpg.Connection, n: int, event: dict[str, Any], phases: dict[str, Writer]
) -> dict[str, list[float]]:
    """Seconds of ``n`` application transactions per phase (and without an event), ROUNDS
    times, interleaved."""

    async def txs(write: Callable[..., Awaitable[Any]] | None, extra: dict[str, Any]) -> float:
        started = time.perf_counter()
        for i in range(n):
            async with conn.transaction():
                order = await conn.fetchval(ORDER, i)
                if write is not None:
                    await write(
                        conn, destination=DESTINATION, key=str(order), payload=event, **extra
                    )
        return time.perf_counter() - started

    named = {f"with_{p}event" if p else "with_event": w for p, w in phases.items()}
    for write, extra in named.values():
        await txs(write, extra)  # warm up: prepared statements, caches, the validator
    times: dict[str, list[float]] = {"without_event": [], **{k: [] for k in named}}
    for _ in range(ROUNDS):
        times["without_event"].append(await txs(None, {}))
        for name, (write, extra) in named.items():
            times[name].append(await txs(write, extra))
    return times


async def _bulk(
    conn: asyncpg.Connection,
    write: Callable[..., Awaitable[Any]],
    event: dict[str, Any],
    rows: int,
    chunk: int,
    extra: dict[str, Any],
) -> tuple[int, float]:
    events = [
        {"destination": DESTINATION, "key": str(i), "payload": event, **extra} for i in range(chunk)
    ]
    started = time.perf_counter()
    written = 0
    while written < rows:
        async with conn.transaction():
            written += len(await write(conn, events))
    return written, time.perf_counter() - started


def validation_cost() -> dict[str, Any]:
    """The catalog's check alone (``Catalog.check``: the type looked up, the payload validated
    by jsonschema-rs), µs per event at 200 B, 1 KB and 10 KB: below a transaction's noise, so
    timed apart from one."""
    from outbox.message import build_message

    out: dict[str, Any] = {}
    for size, label in ((200, "200b"), (1_000, "1kb"), (10_000, "10kb")):
        catalog = bench_catalog(size, "reject")
        event = body(size)
        message = build_message(destination=DESTINATION, payload=event, event_type=TYPE)
        catalog.check(message, event)  # compiles the validator
        spent = []
        for _ in range(CHECKS):
            started = time.perf_counter_ns()
            catalog.check(message, event)
            spent.append(time.perf_counter_ns() - started)
        spent.sort()
        out[f"validate_{label}_us_p50"] = round(spent[len(spent) // 2] / 1000, 2)
        out[f"validate_{label}_us_p99"] = round(spent[int(len(spent) * 0.99)] / 1000, 2)
    return out
