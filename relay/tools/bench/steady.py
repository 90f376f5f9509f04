"""``steady``: app-like transactions at a fixed rate while a relay runs; commit-to-ack latency.

The load comes from a separate process (as an application would be), so its Python work does
not share the relay's interpreter. Each transaction inserts a business row and its event;
the writer notes the wall-clock time after COMMIT returned, the relay's sink the time the
broker acknowledged, and the difference is the commit-to-ack latency.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import time
from pathlib import Path
from typing import Any

import asyncpg
import click

import outbox
from outbox.dburl import to_asyncpg_dsn
from outbox.errors import describe
from relay.relay import Relay
from relay.tools.bench.common import DESTINATION, Target, TimingSink, percentile, rss_mb
from relay.tools.bench.drain import relay_settings

REACHED = 0.95  # of the offered rate, for its latency figures to be printed
TX_PER_S = 500  # transactions per second the writers keep up with, comfortably, on 2 cores

BUSINESS = "CREATE TABLE IF NOT EXISTS bench_orders (id bigserial PRIMARY KEY, total int)"
ORDER = "INSERT INTO bench_orders (total) VALUES ($1) RETURNING id"


async def _write(
    db_url: str, rate: float, seconds: float, conns: int, per_tx: int, start_at: float, out: str
) -> None:
    pool = await asyncpg.create_pool(to_asyncpg_dsn(db_url), min_size=conns, max_size=conns)
    assert pool is not None
    commits: list[tuple[int, float]] = []
    total = int(rate * seconds / per_tx)  # transactions of this process
    tx_rate = rate / per_tx
    # All writer processes start on the same wall-clock instant.
    start = time.monotonic() + max(0.0, start_at - time.time())

    async def worker(j: int) -> None:
        for i in range(j, total, conns):
            delay = start + i / tx_rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            async with pool.acquire() as conn, conn.transaction():
                order = await conn.fetchval(ORDER, i)
                if per_tx == 1:
                    ids = [
                        await outbox.enqueue(
                            conn,
                            destination=DESTINATION,
                            key=f"order-{order}",
                            payload={"order": order},
                        )
                    ]
                else:
                    ids = await outbox.enqueue_many(
                        conn,
                        [
                            {
                                "destination": DESTINATION,
                                "key": f"order-{order}",
                                "payload": {"order": order, "n": n},
                            }
                            for n in range(per_tx)
                        ],
                    )
            now = time.time()
            commits.extend((eid, now) for eid in ids)

    await asyncio.gather(*(worker(j) for j in range(conns)))
    elapsed = time.monotonic() - start
    await pool.close()
    Path(out).write_text(json.dumps({"commits": commits, "elapsed": elapsed}))


def _writer_main(
    db_url: str, rate: float, seconds: float, conns: int, per_tx: int, start_at: float, out: str
) -> None:
    try:
        asyncio.run(_write(db_url, rate, seconds, conns, per_tx, start_at, out))
    except Exception as exc:  # reported by the parent, which names what to change
        Path(out).write_text(json.dumps({"error": describe(exc)}))


def _read_commits(outs: list[Path]) -> tuple[dict[int, float], float]:
    """What the writer processes committed (row id -> when), and the longest run of them."""
    commits: dict[int, float] = {}
    elapsed = 0.0
    for out in outs:
        data = json.loads(out.read_text())
        if "error" in data:
            hint = (
                "; lower --writers or --processes (PostgreSQL's max_connections)"
                if "TooManyConnections" in data["error"]
                else ""
            )
            raise click.ClickException(f"the load generator failed: {data['error']}{hint}")
        commits.update(dict(data["commits"]))
        elapsed = max(elapsed, data["elapsed"])
    return commits, elapsed


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
    processes: int = 1,
    per_tx: int = 1,
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
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 2.0  # room for the processes to start and connect
    outs = [tmp / f"commits-{i}.json" for i in range(processes)]
    procs = [
        ctx.Process(
            target=_writer_main,
            args=(db_url, rate / processes, seconds, writers, per_tx, start_at, str(out)),
        )
        for out in outs
    ]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            await asyncio.to_thread(proc.join, seconds * 3 + 60)
            if proc.exitcode != 0:
                raise RuntimeError(f"the load generator failed (exit code {proc.exitcode})")
        commits, elapsed = _read_commits(outs)
        deadline = time.monotonic() + 30
        while len(sink.acked) < len(commits) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        # An idle relay should cost next to nothing: measure its CPU for a while.
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.sleep(idle_seconds)
        idle_cpu = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        relay.stop()
        await task
    return _report(sink, commits, elapsed, rate, per_tx, processes, idle_cpu)


def _report(
    sink: TimingSink,
    commits: dict[int, float],
    elapsed: float,
    rate: float,
    per_tx: int,
    processes: int,
    idle_cpu: float,
) -> dict[str, Any]:
    latencies = [(sink.acked[i] - t) * 1000 for i, t in commits.items() if i in sink.acked]
    achieved = len(commits) / elapsed
    report: dict[str, Any] = {
        "offered_per_s": rate,
        "achieved_per_s": round(achieved, 1),
        "rate_reached": achieved >= rate * REACHED,
        "events_per_tx": per_tx,
        "writer_processes": processes,
        "events": len(commits),
        "acked": len(latencies),
    }
    if report["rate_reached"]:
        report.update(
            p50_ms=round(percentile(latencies, 50), 2),
            p95_ms=round(percentile(latencies, 95), 2),
            p99_ms=round(percentile(latencies, 99), 2),
            max_ms=round(max(latencies, default=float("nan")), 2),
        )
    else:
        # Latencies of a lower rate than the one named would be read as the named rate's.
        report["latency"] = (
            f"not reported: the writers offered {achieved:,.0f}/s of {rate:,.0f}/s; "
            "raise --per-tx, --writers or --processes"
        )
    report.update(idle_cpu_percent=round(idle_cpu * 100, 2), max_rss_mb=round(rss_mb(), 1))
    return report


def load_shape(rate: float, per_tx: int | None, processes: int | None) -> tuple[int, int]:
    """Events per transaction and writer processes for ``rate`` when not given: one
    transaction commits about 500 times a second from the writers on this kind of machine
    (fsync and round trips), so higher rates batch events as apps with several events per
    business change do, and use a second process."""
    if per_tx is None:
        per_tx = 1 if rate <= 1000 else math.ceil(rate / TX_PER_S)
    if processes is None:
        # A process also spends Python time per event (building each row): past a few
        # thousand events/s one process trails the rate it offers.
        processes = 1 if rate <= 2000 else 2
    return per_tx, processes
