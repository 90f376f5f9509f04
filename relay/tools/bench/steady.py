"""``steady``: app-like transactions at a fixed rate while a relay runs; commit-to-ack latency.

The load comes from a separate process (as an application would be), so its Python work does
not share the relay's interpreter. Each transaction inserts a business row and its event;
the writer notes the wall-clock time after COMMIT returned, the relay's sink the time the
broker acknowledged, and the difference is the commit-to-ack latency: overall, per window of
commit time, and in the first and the last minute, for runs long enough to show a drift.

The writers keep their commits in arrays and hand them over as binary files (16 bytes an
event), so runs of an hour at thousands of events a second fit in a few hundred MB.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import multiprocessing
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import click

import outbox
from outbox.dburl import to_asyncpg_dsn
from outbox.errors import describe
from outbox.sql import load
from relay.app import Relay
from relay.tools.bench.common import (
    DESTINATION,
    HeldSnapshot,
    Latencies,
    Target,
    TimingSink,
    held_snapshot,
    rss_mb,
    table_stats,
)
from relay.tools.bench.drain import relay_settings

REACHED = 0.95  # of the offered rate, for its latency figures to be printed
TX_PER_S = 500  # transactions per second the writers keep up with, comfortably, on 2 cores
MINUTE = 60.0

# The writers' business statements: their text is in steady.sql beside this module.
_q = load("relay.tools.bench", "steady.sql", binds="numbered")

BUSINESS = _q["business"]
ORDER = _q["order"]


@dataclass
class WriterLoad:
    """What each writer process offers."""

    rate: float
    seconds: float
    conns: int
    per_tx: int
    keys: int
    start_at: float


def _files(out: Path) -> tuple[Path, Path]:
    """Where a writer leaves its commits: the row ids (int64) and their commit times (double)."""
    return out.with_suffix(".ids"), out.with_suffix(".times")


async def _write(db_url: str, load: WriterLoad, out: Path) -> None:
    conns, per_tx, keys = load.conns, load.per_tx, load.keys
    rate, seconds, start_at = load.rate, load.seconds, load.start_at
    pool = await asyncpg.create_pool(to_asyncpg_dsn(db_url), min_size=conns, max_size=conns)
    assert pool is not None
    ids_out: array[int] = array("q")
    times_out: array[float] = array("d")
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
                # One key per transaction (an order's events), spread over --keys keys.
                key = f"key-{order % keys}"
                if per_tx == 1:
                    ids = [
                        await outbox.enqueue(
                            conn,
                            destination=DESTINATION,
                            key=key,
                            payload={"order": order},
                        )
                    ]
                else:
                    ids = await outbox.enqueue_many(
                        conn,
                        [
                            {
                                "destination": DESTINATION,
                                "key": key,
                                "payload": {"order": order, "n": n},
                            }
                            for n in range(per_tx)
                        ],
                    )
            now = time.time()
            ids_out.extend(ids)
            times_out.extend([now] * len(ids))

    await asyncio.gather(*(worker(j) for j in range(conns)))
    elapsed = time.monotonic() - start
    await pool.close()
    ids_file, times_file = _files(out)
    with ids_file.open("wb") as f:
        ids_out.tofile(f)
    with times_file.open("wb") as f:
        times_out.tofile(f)
    out.write_text(json.dumps({"elapsed": elapsed, "events": len(ids_out)}))


def writer_main(db_url: str, load: WriterLoad, out: str) -> None:
    try:
        asyncio.run(_write(db_url, load, Path(out)))
    except Exception as exc:  # reported by the parent, which names what to change
        Path(out).write_text(json.dumps({"error": describe(exc)}))


@dataclass
class Commits:
    """What the writer processes committed: row ids and their commit times (wall clock), side
    by side, and the longest run of the processes."""

    ids: array[int]
    times: array[float]
    elapsed: float

    def __len__(self) -> int:
        return len(self.ids)


def read_commits(outs: list[Path]) -> Commits:
    commits = Commits(array("q"), array("d"), 0.0)
    for out in outs:
        data = json.loads(out.read_text())
        if "error" in data:
            hint = (
                "; lower --writers or --processes (PostgreSQL's max_connections)"
                if "TooManyConnections" in data["error"]
                else ""
            )
            raise click.ClickException(f"the load generator failed: {data['error']}{hint}")
        ids_file, times_file = _files(out)
        with ids_file.open("rb") as f:
            commits.ids.fromfile(f, data["events"])
        with times_file.open("rb") as f:
            commits.times.fromfile(f, data["events"])
        commits.elapsed = max(commits.elapsed, data["elapsed"])
    return commits


async def write_load(
    db_url: str, load: WriterLoad, outs: list[Path], error: Callable[[str], Exception]
) -> Commits:
    """Offer ``load`` from one writer process per file of ``outs``; what they committed.
    ``error``: what a process that failed raises, with its message."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=writer_main, args=(db_url, load, str(out))) for out in outs]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            # The writers stop on their own after --seconds (or as soon as they can after
            # it, when they trail the rate): three times that is a bound, not a pace.
            await asyncio.to_thread(proc.join, load.seconds * 3 + 60)
            if proc.exitcode != 0:
                raise error(f"the load generator failed (exit code {proc.exitcode})")
        return read_commits(outs)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)


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
    ordering: str = "none",
    keys: int = 1000,
    retention: float | None = None,
    hold_snapshot: bool = False,
    hold_insert: float = 0.0,
    window: float = 15.0,
    warmup: float = 15.0,
    claims: str = "auto",
) -> dict[str, Any]:
    await _create_business_table(db_url)
    held: HeldSnapshot | None = None
    async with contextlib.AsyncExitStack() as stack:
        if hold_snapshot:  # before the load, held until the figures below are taken
            held = await stack.enter_async_context(held_snapshot(db_url))
        sink = TimingSink(target.make_sink())
        settings = relay_settings(db_url, batch_size, None, ordering, retention, claims)
        relay = Relay(settings, sinks={DESTINATION: sink})
        task = asyncio.create_task(relay.run())
        await relay.started.wait()
        start_at = time.time() + 2.0  # room for the processes to start and connect
        load = WriterLoad(rate / processes, seconds, writers, per_tx, keys, start_at)
        outs = [tmp / f"commits-{i}.json" for i in range(processes)]
        holder = None
        if hold_insert:
            holder = asyncio.create_task(_hold_insert(db_url, start_at + warmup, hold_insert))
        try:
            commits = await write_load(db_url, load, outs, RuntimeError)
            held_insert = await holder if holder is not None else 0
            deadline = time.monotonic() + 30
            while sink.acked < len(commits) + held_insert and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            idle_cpu = await _idle_cpu(idle_seconds)
        finally:
            if holder is not None and not holder.done():
                holder.cancel()
            relay.stop()
            await task
        report = _report(
            sink, commits, rate, per_tx, processes, idle_cpu, window=window, warmup=warmup
        )
        report.update(ordering=ordering, keys=keys, hold_snapshot=hold_snapshot, claims=claims)
        report.update(insert_held_seconds=hold_insert)
        # While the snapshot is still held: what it kept is in the table.
        report.update(await table_stats(db_url, report["acked"]))
    if held is not None:
        report.update(held.figures())
    return report


async def _hold_insert(db_url: str, at: float, seconds: float) -> int:
    """An application transaction that enqueues one event at ``at`` (wall-clock time) and
    stays open for ``seconds`` before it commits; the events it committed (1). Its event is
    not among the writers' commits, whose latencies are reported."""
    await asyncio.sleep(max(0.0, at - time.time()))
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            await outbox.enqueue(conn, destination=DESTINATION, payload={"held": True})
            await asyncio.sleep(seconds)
    finally:
        await conn.close()
    return 1


async def _create_business_table(db_url: str) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(BUSINESS)
    finally:
        await conn.close()


async def _idle_cpu(seconds: float) -> float:
    """The share of a CPU the relay takes for ``seconds`` with nothing to do: an idle relay
    should cost next to nothing."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    await asyncio.sleep(seconds)
    return (time.process_time() - cpu0) / (time.monotonic() - wall0)


@dataclass
class _Span:
    """Latencies of the events committed in [start, end) seconds after the first commit."""

    start: float
    end: float
    latencies: Latencies

    def figures(self) -> dict[str, Any]:
        return {
            "from_s": _seconds(self.start),
            "to_s": _seconds(self.end),
            "events": self.latencies.count,
            **self.latencies.figures(50, 99),
        }


@dataclass
class _Acks:
    """The commit-to-ack latencies of a run: overall, per window of commit time (with the
    events committed in each), and in the first and the last minute."""

    overall: Latencies
    committed: dict[int, int]  # window -> events committed in it
    windows: dict[int, Latencies]
    first: _Span | None
    last: _Span | None


def _acks(sink: TimingSink, commits: Commits, window: float, warmup: float) -> _Acks:
    acks = _Acks(Latencies(), {}, {}, None, None)
    if not len(commits):
        return acks
    t0, length = min(commits.times), max(commits.times) - min(commits.times)
    # The first minute after the warm-up, and the last minute of the run (not reaching
    # back into the warm-up): they overlap in runs shorter than warm-up + two minutes.
    if length > warmup:
        acks.first = _Span(warmup, min(warmup + MINUTE, length), Latencies())
        # Up to and including the last commit.
        acks.last = _Span(
            max(warmup, length - MINUTE), math.nextafter(length, math.inf), Latencies()
        )
    spans = (acks.first, acks.last)
    base = min(commits.ids)
    acked_at = sink.ack_times(base, max(commits.ids) - base + 1)
    for i, t in zip(commits.ids, commits.times, strict=True):
        at = t - t0
        w = int(at // window)
        acks.committed[w] = acks.committed.get(w, 0) + 1
        acked = acked_at[i - base]
        if math.isnan(acked):
            continue
        ms = (acked - t) * 1000
        acks.overall.add(ms)
        acks.windows.setdefault(w, Latencies()).add(ms)
        for span in spans:
            if span is not None and span.start <= at < span.end:
                span.latencies.add(ms)
    return acks


def _report(
    sink: TimingSink,
    commits: Commits,
    rate: float,
    per_tx: int,
    processes: int,
    idle_cpu: float,
    *,
    window: float = 15.0,
    warmup: float = 15.0,
) -> dict[str, Any]:
    acks = _acks(sink, commits, window, warmup)
    achieved = len(commits) / commits.elapsed if commits.elapsed else 0.0
    report: dict[str, Any] = {
        "offered_per_s": rate,
        "achieved_per_s": round(achieved, 1),
        "rate_reached": achieved >= rate * REACHED,
        "events_per_tx": per_tx,
        "writer_processes": processes,
        "events": len(commits),
        "acked": acks.overall.count,
    }
    rows: list[dict[str, Any]] = []
    for w in range(max(acks.committed, default=-1) + 1):
        row: dict[str, Any] = {"from_s": _seconds(w * window), "events": acks.committed.get(w, 0)}
        if report["rate_reached"]:
            row.update(acks.windows.get(w, Latencies()).figures(50, 99))
        rows.append(row)
    if report["rate_reached"]:
        report.update(acks.overall.figures(50, 95, 99))
        report.update(_minutes(acks, warmup))
    else:
        # Latencies of a lower rate than the one named would be read as the named rate's.
        report["latency"] = (
            f"not reported: the writers offered {achieved:,.0f}/s of {rate:,.0f}/s; "
            "raise --per-tx, --writers or --processes"
        )
    report.update(idle_cpu_percent=round(idle_cpu * 100, 2), max_rss_mb=round(rss_mb(), 1))
    report["window_s"] = window
    report["windows"] = rows
    return report


def _minutes(acks: _Acks, warmup: float) -> dict[str, Any]:
    """The first minute after the warm-up against the last minute of the run."""
    if acks.first is None or acks.last is None:
        return {"first_minute": f"not reported: the run is not longer than --warmup {warmup:g} s"}
    f, last_ = acks.first.figures(), acks.last.figures()
    return {
        "first_minute": f,
        "last_minute": last_,
        "last_minute_p50_ratio": _ratio(last_["p50_ms"], f["p50_ms"]),
        "last_minute_p99_ratio": _ratio(last_["p99_ms"], f["p99_ms"]),
    }


def _seconds(s: float) -> float | int:
    """Whole seconds as ints, so that the tables print 15, not 15.0 (nor 0.0000)."""
    r = round(float(s), 1)
    return int(r) if r.is_integer() else r


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b and not math.isnan(a) and not math.isnan(b) else None


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
