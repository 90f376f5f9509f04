"""One fan-out run's load on a started relay, and what it measured: the relay's statements
timed, the CPU of its database connections, every delivery accounted for."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import click

from outbox.dburl import to_asyncpg_dsn
from relay.app import Relay
from relay.config import Settings
from relay.sinks.endpoints.sink import EndpointsSink
from relay.tools.bench.common import (
    CLEAR_STATS_SNAPSHOT,
    DESTINATION,
    OTHER_BACKENDS,
    SNAPSHOT_APP,
    percentile,
    rss_mb,
)
from relay.tools.bench.fanout_setup import add_events, running
from relay.tools.bench.fanout_sql import (
    COUNT_ATTEMPTS,
    COUNT_EVENTS,
    DELIVERIES_BY_STATUS,
    FANNED_OUT,
    HEALTHY_DELIVERED,
    LAST_HEALTHY,
    RECORDED_LATENCY,
    RELAY_BACKENDS,
    TABLE_VERSIONS,
)
from relay.tools.bench.receiver import LocalReceiver, LocalReceivers
from relay.tools.bench.steady import (
    BUSINESS,
    REACHED,
    WriterLoad,
    load_shape,
    write_load,
)

KEPT_UP = 1.0  # seconds after the last commit by which a relay keeping up has delivered all


class StatementTimer:
    """Times the endpoints sink's FAN_OUT, DELIVERY_CLAIM and DELIVERY_RECORD calls in the
    running relay (wall time: round trip, database, this event loop) and counts the deliveries
    of each."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.rows: Counter[str] = Counter()

    def attach(self, relay: Relay) -> None:
        sink = relay.sinks[DESTINATION]
        store = sink.deliveries if isinstance(sink, EndpointsSink) else None
        if store is None:
            raise click.ClickException("the endpoints sink has no delivery store to time")
        # The source fans out through fan_out_claiming (fan_out is the same without room).
        self._wrap(store, "fan_out_claiming", lambda r: sum(r[0].values()))
        self._wrap(store, "claim", lambda r: len(r[0]))
        self._wrap(store, "record", len)

    def _wrap(self, store: Any, name: str, rows: Callable[[Any], int]) -> None:
        inner = getattr(store, name)

        async def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                result = await inner(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
                self.calls[name] += 1
            self.rows[name] += rows(result)
            return result

        setattr(store, name, timed)

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, label in (
            ("fan_out_claiming", "fan_out"),
            ("claim", "delivery_claim"),
            ("record", "delivery_record"),
        ):
            rows = max(self.rows[name], 1)
            out[f"{label}_statements"] = self.calls[name]
            out[f"{label}_us_per_delivery"] = round(self.seconds[name] / rows * 1e6, 1)
        out["deliveries_per_claim"] = round(self.rows["claim"] / max(self.calls["claim"], 1), 2)
        return out


class BackendCpu:
    """CPU used by the relay's PostgreSQL connections (their server processes), read from
    /proc: only when the server is on this machine."""

    def __init__(self, db_url: str) -> None:
        host = urlsplit(to_asyncpg_dsn(db_url)).hostname or ""
        self.local = host in ("", "127.0.0.1", "localhost", "::1") and os.path.isdir("/proc/1")
        self.start: dict[int, float] = {}

    async def _sample(self, conn: asyncpg.Connection) -> dict[int, float]:
        if not self.local:
            return {}
        pids = [r[0] for r in await conn.fetch(RELAY_BACKENDS)]
        cpu = {p: LocalReceiver("", p).cpu_seconds() for p in pids}
        return {p: c for p, c in cpu.items() if c == c}  # NaN: gone, or not readable

    async def begin(self, conn: asyncpg.Connection) -> None:
        self.start = await self._sample(conn)

    async def seconds(self, conn: asyncpg.Connection) -> float | None:
        if not self.local:
            return None
        now = await self._sample(conn)
        return sum(c - self.start.get(p, 0.0) for p, c in now.items())


async def _wait_for(
    what: Callable[[], Any], deadline: float, task: asyncio.Task[int], interval: float = 0.02
) -> bool:
    while True:
        done = what()
        if asyncio.iscoroutine(done):
            done = await done
        if done:
            return True
        if time.monotonic() > deadline or task.done():
            return False
        await asyncio.sleep(interval)


async def _healthy_delivered(conn: asyncpg.Connection, ids: list[int]) -> int:
    return int(await conn.fetchval(HEALTHY_DELIVERED, ids))


async def account(
    conn: asyncpg.Connection,
    *,
    healthy_ids: list[int],
    matching: int,
    received: list[tuple[int, int, float]],
    healthy_ports: int,
    backlog: int = 0,
) -> dict[str, Any]:
    """Every delivery accounted for: the rows there are, against those there should be."""
    events = int(await conn.fetchval(COUNT_EVENTS))
    expected = events * matching + backlog
    by_status = {r[0]: int(r[1]) for r in await conn.fetch(DELIVERIES_BY_STATUS)}
    deliveries = sum(by_status.values())
    healthy_delivered = await _healthy_delivered(conn, healthy_ids)
    attempts = int(await conn.fetchval(COUNT_ATTEMPTS))
    healthy_requests = [(i, e) for i, e, _ in received if i < healthy_ports]
    unique = len(set(healthy_requests))
    expected_healthy = events * len(healthy_ids)
    return {
        "events": events,
        "endpoints_matching": matching,
        "deliveries": deliveries,
        "deliveries_expected": expected,
        **{f"deliveries_{s}": by_status.get(s, 0) for s in ("delivered", "pending", "running")},
        **{f"deliveries_{s}": by_status.get(s, 0) for s in ("failed", "cancelled")},
        "healthy_delivered": healthy_delivered,
        "healthy_expected": expected_healthy,
        "healthy_received": unique,
        "healthy_received_twice": len(healthy_requests) - unique,
        "attempts_logged": attempts,
        "accounted": deliveries == expected
        and healthy_delivered == expected_healthy
        and unique == expected_healthy,
    }


def _ms(values: Sequence[float], p: float) -> float:
    return round(percentile(values, p), 2)


async def dead_versions(conn: asyncpg.Connection, settle: float = 5.0) -> dict[str, Any]:
    """The tables' live and dead row versions and sizes (under a held snapshot: every
    version the run left). A backend sends its counts to the statistics as it exits: this
    waits up to ``settle`` seconds for the relay's to be gone (the snapshot's stays)."""
    deadline = time.monotonic() + settle
    while await conn.fetchval(OTHER_BACKENDS, SNAPSHOT_APP) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await conn.execute(CLEAR_STATS_SNAPSHOT)
    return {
        "tables": {
            r["name"]: {k: r[k] for k in ("live", "dead", "table_mb", "indexes_mb")}
            for r in await conn.fetch(TABLE_VERSIONS)
        }
    }


def windows(
    latencies: Sequence[tuple[float, float]], started: float, window: float
) -> list[dict[str, Any]]:
    """Commit-to-delivery latencies per ``window`` seconds of commit time (``latencies``:
    (commit time, ms)): a latency that grows while the run goes on shows here, not in the
    run's overall percentiles."""
    by: dict[int, list[float]] = defaultdict(list)
    for at, ms in latencies:
        by[int(max(0.0, at - started) // window)].append(ms)
    return [
        {
            "from_s": round(w * window, 1),
            "deliveries": len(by[w]),
            "p50_ms": _ms(by[w], 50),
            "p99_ms": _ms(by[w], 99),
            "max_ms": round(max(by[w]), 2),
        }
        for w in sorted(by)
    ]


class Load:
    """One run's load on a started relay, and what it measured."""

    def __init__(
        self,
        conn: asyncpg.Connection,
        db_url: str,
        receivers: LocalReceivers,
        healthy_ids: list[int],
        max_seconds: float,
    ) -> None:
        self.conn = conn
        self.db_url = db_url
        self.receivers = receivers
        self.healthy_ids = healthy_ids
        self.max_seconds = max_seconds
        self.timer = StatementTimer()
        self.backends = BackendCpu(db_url)
        self.commits: dict[int, float] | None = None
        self.load_seconds: float | None = None
        self.figures: dict[str, Any] = {}
        self.started = 0.0
        self.complete = False

    async def begin(self, relay: Relay, task: asyncio.Task[int]) -> None:
        self.relay, self.task = relay, task
        self.timer.attach(relay)
        self.statements0 = Counter(relay.store.statements)
        self.at_once0 = _sent_at_once(relay) or 0
        await self.backends.begin(self.conn)
        self.cpu0, self.receiver0 = time.process_time(), self.receivers.cpu_seconds()

    async def end(self) -> None:
        self.relay_cpu = time.process_time() - self.cpu0
        self.receiver_cpu = self.receivers.cpu_seconds() - self.receiver0
        self.pg_cpu = await self.backends.seconds(self.conn)
        self.statements = Counter(self.relay.store.statements)
        self.statements.subtract(self.statements0)
        # Outcomes not written because their delivery's lease was lost (the deliveries' pipe).
        pipe = next((p for p in self.relay.pipes if p.name == "deliveries"), None)
        self.lost = pipe.leases.stats["lease_lost"] if pipe is not None else None
        at_once = _sent_at_once(self.relay)
        self.at_once = at_once - self.at_once0 if at_once is not None else None

    async def until_delivered(self, expected: int) -> None:
        """Until the receivers have had ``expected`` healthy requests and the table says
        they are delivered (or --max-seconds)."""
        healthy = len(self.healthy_ids)
        counts = self.receivers.counts
        deadline = time.monotonic() + self.max_seconds
        got = await _wait_for(
            lambda: sum(counts[i] for i in range(healthy)) >= expected, deadline, self.task
        )

        async def recorded() -> bool:
            return await _healthy_delivered(self.conn, self.healthy_ids) >= expected

        self.complete = got and await _wait_for(recorded, deadline, self.task, interval=0.1)

    async def run(
        self,
        settings: Settings,
        mode: str,
        events: int,
        steady: tuple[float, float, int],
        tmp: Path,
    ) -> None:
        """The relay started with ``settings``; ``events`` drained, or (``mode`` "steady")
        the ``steady`` load (rate, seconds, writers); until every healthy delivery is
        recorded."""
        async with running(settings) as (relay, task):
            await self.begin(relay, task)
            if mode == "steady":
                rate, seconds, writers = steady
                await self.steady(self.db_url, rate, seconds, writers, tmp)
            else:
                await self.drain(events)
            await self.end()

    async def drain(self, events: int) -> None:
        """``events`` committed at once (one statement); until every healthy delivery is
        recorded."""
        await add_events(self.conn, events)
        self.started = time.time()
        self.relay.wake()
        await self.until_delivered(events * len(self.healthy_ids))

    async def steady(
        self, db_url: str, rate: float, seconds: float, writers: int, tmp: Path
    ) -> None:
        """Events at ``rate`` from writer processes (steady.py's); until every healthy
        delivery is recorded."""
        per_tx, processes = load_shape(rate, None, None)
        await self.conn.execute(BUSINESS)
        self.started = time.time() + 2.0  # room for the processes to start and connect
        outs = [tmp / f"commits-{time.monotonic_ns()}-{i}.json" for i in range(processes)]
        load = WriterLoad(rate / processes, seconds, writers, per_tx, 1000, self.started)
        commits = await write_load(db_url, load, outs, click.ClickException)
        # At most MAX_EVENTS: a dict is small enough.
        self.commits, elapsed = dict(zip(commits.ids, commits.times, strict=True)), commits.elapsed
        achieved = len(self.commits) / elapsed if elapsed else 0.0
        self.load_seconds = elapsed
        self.figures = {
            "offered_per_s": rate,
            "achieved_per_s": round(achieved, 1),
            "rate_reached": achieved >= rate * REACHED,
            "events_per_tx": per_tx,
        }
        await self.until_delivered(len(self.commits) * len(self.healthy_ids))

    async def report(
        self,
        received: list[tuple[int, int, float]],
        matching: int,
        *,
        latency: bool,
        backlog: int = 0,
        per_window: float = 30.0,
    ) -> dict[str, Any]:
        conn, healthy = self.conn, len(self.healthy_ids)
        acc = await account(
            conn,
            healthy_ids=self.healthy_ids,
            matching=matching,
            received=received,
            healthy_ports=healthy,
            backlog=backlog,
        )
        fan = await conn.fetchrow(FANNED_OUT)
        last = await conn.fetchval(LAST_HEALTHY, self.healthy_ids)
        delivered = acc["healthy_delivered"]
        window = (last - self.started) if last else float("nan")
        fan_window = (fan["last"] - self.started) if fan["last"] else float("nan")
        out: dict[str, Any] = {**self.figures, "complete": self.complete}
        out["seconds"] = round(window, 3)
        if self.load_seconds is not None:
            # Deliveries still arriving long after the last commit: the relay fell behind, and
            # the latencies below are mostly the backlog's.
            tail = window - self.load_seconds
            out["tail_after_last_commit_s"] = round(tail, 3)
            out["kept_up"] = tail <= KEPT_UP
        out["events_fanned_out_per_s"] = round(fan["fanned_out"] / fan_window, 1)
        out["healthy_deliveries_per_s"] = round(delivered / window, 1)
        out["fan_out_p50_ms"] = round((fan["p50"] or float("nan")) * 1000, 2)
        out["fan_out_p99_ms"] = round((fan["p99"] or float("nan")) * 1000, 2)
        if latency and self.commits is not None:
            first: dict[tuple[int, int], float] = {}
            for i, e, t in received:
                if i < healthy and (i, e) not in first:
                    first[(i, e)] = t
            timed = [
                (self.commits[e], (t - self.commits[e]) * 1000)
                for (_, e), t in first.items()
                if e in self.commits
            ]
            lat = [ms for _, ms in timed]
            out["p50_ms"] = _ms(lat, 50)
            out["p95_ms"] = _ms(lat, 95)
            out["p99_ms"] = _ms(lat, 99)
            out["max_ms"] = round(max(lat, default=float("nan")), 2)
            out["window_s"] = per_window
            out["windows"] = windows(timed, self.started, per_window)
            recorded = [r[0] for r in await conn.fetch(RECORDED_LATENCY, self.healthy_ids)]
            out["recorded_p50_ms"] = _ms(recorded, 50)
            out["recorded_p99_ms"] = _ms(recorded, 99)
        out.update(self.costs(delivered))
        out.update(acc)
        out["deliveries_lost"] = self.lost
        out["deliveries_sent_at_fan_out"] = self.at_once
        return out

    def costs(self, delivered: int) -> dict[str, Any]:
        per = max(delivered, 1)
        out: dict[str, Any] = {
            "relay_cpu_us_per_delivery": round(self.relay_cpu / per * 1e6, 1),
            "receiver_cpu_us_per_delivery": round(self.receiver_cpu / per * 1e6, 1),
        }
        if self.pg_cpu is not None:
            out["pg_cpu_us_per_delivery"] = round(self.pg_cpu / per * 1e6, 1)
        out.update(self.timer.figures())
        out["delivery_record_statements"] = self.statements["delivery_record"]
        # Every statement the relay counts (hot paths, heartbeats, reaps, health), the outbox's
        # own claim and record too, and each by name: where a delivery's statements go.
        out["sql_statements_per_delivery"] = round(sum(self.statements.values()) / per, 3)
        out["statements"] = {k: v for k, v in sorted(self.statements.items()) if v > 0}
        out["max_rss_mb"] = round(rss_mb(), 1)
        return out


def _sent_at_once(relay: Relay) -> int | None:
    """How many deliveries their fan-out claimed and sent at once so far (no claim statement
    of their own); None without an endpoints destination."""
    pipe = next((p for p in relay.pipes if p.name == "deliveries"), None)
    stats = getattr(pipe.source, "stats", None) if pipe is not None else None
    return int(stats["sent_at_fan_out"]) if stats is not None else None
