"""``steady``: app-like transactions at a fixed rate while a relay runs; commit-to-ack latency.

The load comes from a separate process (as an application would be), so its Python work does
not share the relay's interpreter. Each transaction inserts a business row and its event;
the writer notes the wall-clock time after COMMIT returned, the relay's sink the time the
broker acknowledged, and the difference is the commit-to-ack latency.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

import asyncpg

import outbox
from outbox.dburl import to_asyncpg_dsn
from relay.bench.common import DESTINATION, Target, TimingSink, percentile, rss_mb
from relay.bench.drain import relay_settings
from relay.relay import Relay

BUSINESS = "CREATE TABLE IF NOT EXISTS bench_orders (id bigserial PRIMARY KEY, total int)"
ORDER = "INSERT INTO bench_orders (total) VALUES ($1) RETURNING id"


async def _write(db_url: str, rate: float, seconds: float, conns: int, out: str) -> None:
    pool = await asyncpg.create_pool(to_asyncpg_dsn(db_url), min_size=conns, max_size=conns)
    assert pool is not None
    commits: list[tuple[int, float]] = []
    total = int(rate * seconds)
    start = time.monotonic() + 0.2

    async def worker(j: int) -> None:
        for i in range(j, total, conns):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            async with pool.acquire() as conn, conn.transaction():
                order = await conn.fetchval(ORDER, i)
                eid = await outbox.enqueue(
                    conn, destination=DESTINATION, key=f"order-{order}", payload={"order": order}
                )
            commits.append((eid, time.time()))

    await asyncio.gather(*(worker(j) for j in range(conns)))
    elapsed = time.monotonic() - start
    await pool.close()
    Path(out).write_text(json.dumps({"commits": commits, "elapsed": elapsed}))


def _writer_main(db_url: str, rate: float, seconds: float, conns: int, out: str) -> None:
    asyncio.run(_write(db_url, rate, seconds, conns, out))


async def steady(
    db_url: str,
    target: Target,
    *,
    rate: float,
    seconds: float,
    batch_size: int,
    writers: int,
    idle_seconds: float,
    tmp: Path,
) -> dict[str, Any]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(BUSINESS)
    finally:
        await conn.close()
    sink = TimingSink(target.make_sink())
    relay = Relay(relay_settings(db_url, batch_size, None), sinks={DESTINATION: sink})
    task = asyncio.create_task(relay.run())
    await relay.started.wait()
    out = tmp / "commits.json"
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_writer_main, args=(db_url, rate, seconds, writers, str(out)))
    try:
        proc.start()
        await asyncio.to_thread(proc.join, seconds * 3 + 60)
        if proc.exitcode != 0:
            raise RuntimeError(f"the load generator failed (exit code {proc.exitcode})")
        data = json.loads(out.read_text())
        commits: dict[int, float] = dict(data["commits"])
        deadline = time.monotonic() + 30
        while len(sink.acked) < len(commits) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        # An idle relay should cost next to nothing: measure its CPU for a while.
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.sleep(idle_seconds)
        idle_cpu = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    finally:
        if proc.is_alive():
            proc.kill()
        relay.stop()
        await task
    latencies = [(sink.acked[i] - t) * 1000 for i, t in commits.items() if i in sink.acked]
    return {
        "offered_per_s": rate,
        "achieved_per_s": round(len(commits) / data["elapsed"], 1),
        "events": len(commits),
        "acked": len(latencies),
        "p50_ms": round(percentile(latencies, 50), 2),
        "p95_ms": round(percentile(latencies, 95), 2),
        "p99_ms": round(percentile(latencies, 99), 2),
        "max_ms": round(max(latencies, default=float("nan")), 2),
        "idle_cpu_percent": round(idle_cpu * 100, 2),
        "max_rss_mb": round(rss_mb(), 1),
    }
