"""``fanout``: an endpoints destination fanning each event out to many endpoints.

Three scenarios, each in scratch databases of its own, with a real relay in this process and
its endpoints served on loopback ports by one receiver process (receiver.local_receivers):

* ``steady`` (isolation): N healthy endpoints, and by default one that answers after 2 s and
  one that refuses connections (a closed port); ``--slow-endpoints`` makes it several slow
  ones, answering 2xx after ``--slow-delay`` (under ``--timeout``: they never fail, so no
  circuit opens), beside a small ``--max-in-flight``: the fair share's case. Events are
  committed at a fixed rate by a writer process (as steady.py's) and each matches every
  endpoint. Reported: events/s fanned out, deliveries/s to the healthy endpoints, and their
  commit-to-delivery latency: the time the receiver read the request less the time the
  writer's COMMIT returned (both this machine's wall clock). ``--compare`` runs with and
  without the slow and dead ones.
* ``drain``: the same endpoints; ``--events`` committed first (one statement), then the time
  until every healthy endpoint's deliveries are recorded delivered.
* ``scale``: ``--fan-out`` endpoints match each event's tenant, beside ``--registered`` in all
  for the destination (the others have tenants no event carries, inserted with one
  statement), against a run with only the matching ones registered: the cost per delivery of
  the relay (CPU), of PostgreSQL (CPU of the relay's connections), and of FAN_OUT and
  DELIVERY_CLAIM (timed around each call in the relay, and replayed alone on one connection).

Every figure comes with an account of the rows: deliveries expected (events x matching
endpoints), the deliveries table by status, the message log, what the receivers got.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import multiprocessing
import os
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import click

from outbox import endpoint_secrets
from outbox.dburl import to_asyncpg_dsn
from outbox.migrate import migrate
from relay.app import Relay
from relay.config import Settings
from relay.db.store import Store, create_pool
from relay.settings import load_settings
from relay.sinks.endpoints.dispatcher import SCAN
from relay.sinks.endpoints.sink import EndpointsSink
from relay.sinks.endpoints.store import DeliveryRecord, DeliveryStore
from relay.tools.bench.common import DESTINATION, machine, percentile, rss_mb
from relay.tools.bench.receiver import LocalReceiver, LocalReceivers, local_receivers
from relay.tools.bench.steady import (
    BUSINESS,
    REACHED,
    WriterLoad,
    load_shape,
    read_commits,
    writer_main,
)
from relay.tools.localbroker import free_port
from relay.tools.scratch import scratch_database

# Bounds beyond each option's own (cli.py): a benchmark never runs unbounded.
MAX_EVENTS = 200_000  # --rate x --seconds
MAX_DELIVERIES = 2_000_000  # events x endpoints, for one run
MATCH_TENANT = "bench-match"
PROBE_EVENTS = 2000  # events the scale scenario's statement replay fans out and claims
KEPT_UP = 1.0  # seconds after the last commit by which a relay keeping up has delivered all

EVENTS = """
INSERT INTO outbox (destination, key, payload, content_type, tenant, event_type)
SELECT $1, 'key-' || (i % 1000), convert_to(rpad('{"i":' || i || ',"pad":"', $3, 'x') || '"}',
       'UTF8'), 'application/json', $4::text, 'bench.event'
FROM generate_series(1, $2) AS i
"""

ENDPOINTS = """
INSERT INTO outbox_endpoints (destination, url, tenant, secret, description)
SELECT $1, u.url, $3::text, u.secret, 'bench'
FROM unnest($2::text[], $4::text[]) WITH ORDINALITY AS u(url, secret, n)
ORDER BY u.n
RETURNING id, url
"""

# The endpoints no event matches: one statement, whatever their number.
FILLER = """
INSERT INTO outbox_endpoints (destination, url, tenant, secret, description)
SELECT $1, 'http://127.0.0.1:9/never/' || i, 'bench-other-' || i, $3, 'bench filler'
FROM generate_series(1, $2) AS i
"""

# A dead endpoint's backlog from before the run: deliveries waiting out their backoff (as a
# failing endpoint's are). Negative event ids: they name no event and are never due here.
DEAD_BACKLOG = """
INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, run_after, attempts)
SELECT -i, $2, $1, now() + interval '1 day', 3 FROM generate_series(1, $3) AS i
"""

HEALTHY_DELIVERED = """
SELECT count(*) FROM outbox_deliveries WHERE endpoint_id = ANY($1::bigint[])
  AND status = 'delivered'
"""

# Commit-to-recorded, from the database alone: the attempt's log time (the start of the
# statement recording it) less the event's created_at (the start of its transaction).
RECORDED_LATENCY = """
SELECT extract(epoch FROM a.at - o.created_at)::float8 * 1000
FROM outbox_attempts AS a JOIN outbox AS o ON o.id = a.event_id
WHERE a.endpoint_id = ANY($1::bigint[]) AND a.http_status BETWEEN 200 AND 299
"""

# Fan-out lag: an event's recording as fanned out less its created_at.
FANNED_OUT = """
SELECT count(*) FILTER (WHERE status = 'delivered') AS fanned_out,
       extract(epoch FROM max(delivered_at))::float8 AS last,
       percentile_disc(0.5) WITHIN GROUP (ORDER BY lag) FILTER (WHERE lag IS NOT NULL) AS p50,
       percentile_disc(0.99) WITHIN GROUP (ORDER BY lag) FILTER (WHERE lag IS NOT NULL) AS p99
FROM (SELECT status, delivered_at,
             CASE WHEN status = 'delivered'
                  THEN extract(epoch FROM delivered_at - created_at)::float8 END AS lag
      FROM outbox) AS o
"""

LAST_HEALTHY = """
SELECT extract(epoch FROM max(at))::float8 FROM outbox_attempts
WHERE endpoint_id = ANY($1::bigint[]) AND http_status BETWEEN 200 AND 299
"""

RELAY_BACKENDS = """
SELECT pid FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND application_name LIKE 'outbox-relay%'
"""


# --- the runner -----------------------------------------------------------------------------


def run(opts: dict[str, Any]) -> dict[str, Any]:
    """Run the scenario(s) ``opts`` name; the results, as emit() prints them."""
    from relay.runtime import loop

    return loop.run(_run(opts), opts.get("loop", "auto"))


async def _run(opts: dict[str, Any]) -> dict[str, Any]:
    admin = opts["database_url"]
    results: dict[str, Any] = {}
    conditions: dict[str, Any] = {"load_average_before": _load()}
    results["sink"] = "endpoints, served by local receivers (one process, one port each)"
    results["conditions"] = conditions
    scenario = opts["scenario"]
    runs: list[tuple[str, Callable[[str, Path], Any]]] = []
    with_pair = [False, True] if opts["compare"] else [opts["slow_dead"]]
    for k in range(opts["rounds"]):
        tag = f" #{k + 1}" if opts["rounds"] > 1 else ""
        if scenario in ("steady", "drain"):
            for pair in with_pair:
                name = f"{scenario}{' slow+dead' if pair else ''}{tag}"
                runs.append((name, _isolation_run(opts, scenario, pair)))
        else:
            for registered in (opts["fan_out"], opts["registered"]):
                runs.append((f"scale {registered}{tag}", _scale_run(opts, registered)))
    with tempfile.TemporaryDirectory() as tmp:
        for name, job in runs:
            async with scratch_database(admin, "outbox_bench") as db_url:
                await migrate(db_url)
                results.setdefault("machine", await machine(db_url))
                results[name] = await job(db_url, Path(tmp))
    conditions["load_average_after"] = _load()
    ratios = _ratios(results, scenario, opts)
    if ratios:
        results["ratios"] = ratios
    return results


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def _isolation_run(opts: dict[str, Any], mode: str, pair: bool) -> Callable[[str, Path], Any]:
    return lambda db_url, tmp: isolation(
        db_url,
        tmp,
        mode=mode,
        healthy=opts["endpoints"],
        slow_dead=pair,
        slow_delay=opts["slow_delay"],
        rate=opts["rate"],
        seconds=opts["seconds"],
        events=opts["events"],
        writers=opts["writers"],
        max_concurrency=opts["max_concurrency"],
        batch_size=opts["batch_size"],
        max_seconds=opts["max_seconds"],
        dead_backlog=opts["dead_backlog"],
        slow_endpoints=opts["slow_endpoints"],
        max_in_flight=opts["max_in_flight"],
        timeout=opts["timeout"],
    )


def _scale_run(opts: dict[str, Any], registered: int) -> Callable[[str, Path], Any]:
    return lambda db_url, tmp: scale(
        db_url,
        tmp,
        registered=registered,
        fan_out=opts["fan_out"],
        events=opts["events"],
        max_concurrency=opts["max_concurrency"],
        batch_size=opts["batch_size"],
        max_seconds=opts["max_seconds"],
        probe=opts["probe"],
    )


# --- pieces the scenarios share -------------------------------------------------------------


def relay_settings(
    db_url: str,
    *,
    batch_size: int,
    max_concurrency: int,
    endpoints: int,
    shutdown: float,
    max_in_flight: int | None = None,
    timeout: float = 15.0,
) -> Settings:
    in_flight = max_in_flight or batch_size * 4
    return load_settings(
        None,
        database_url=db_url,
        log_level="warning",
        relay={
            "batch_size": min(batch_size, in_flight),
            "max_in_flight": in_flight,
            "poll_interval": 0.5,
            "shutdown_timeout": shutdown,
        },
        destinations={
            DESTINATION: {
                "kind": "endpoints",
                # The receivers are on loopback.
                "allow_private_networks": True,
                "max_concurrency": max_concurrency,
                "timeout": timeout,
            }
        },
        # Room for every endpoint's requests, so they never wait on each other's connections.
        webhooks={"max_connections": max(100, endpoints * max_concurrency)},
        # No metrics listener: a benchmark must not take the port of a relay on this host.
        http={"enabled": False},
    )


@contextlib.asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[tuple[Relay, asyncio.Task[int]]]:
    relay = Relay(settings)
    task = asyncio.create_task(relay.run())
    started = asyncio.create_task(relay.started.wait())
    await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED, timeout=60)
    if not relay.started.is_set():
        started.cancel()
        if task.done():
            task.result()
        relay.stop()
        await asyncio.gather(task, return_exceptions=True)
        raise click.ClickException("the relay did not start within 60 s")
    try:
        yield relay, task
    finally:
        relay.stop()
        await asyncio.wait_for(task, settings.relay.shutdown_timeout + 60)


class StatementTimer:
    """Times the endpoints sink's FAN_OUT and DELIVERY_CLAIM calls in the running relay (wall
    time: round trip, database, this event loop) and counts the deliveries of each."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.rows: Counter[str] = Counter()

    def attach(self, relay: Relay) -> None:
        sink = relay.sinks[DESTINATION]
        store = sink.deliveries if isinstance(sink, EndpointsSink) else None
        if store is None:
            raise click.ClickException("the endpoints sink has no delivery store to time")
        self._wrap(store, "fan_out", lambda r: sum(r.values()))
        self._wrap(store, "claim", lambda r: len(r[0]))

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
        for name, label in (("fan_out", "fan_out"), ("claim", "delivery_claim")):
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


async def register(
    conn: asyncpg.Connection, urls: Sequence[str], tenant: str | None = None
) -> list[int]:
    """Endpoints for ``urls`` (one statement), each with a secret of its own; their ids."""
    secrets = [endpoint_secrets.generate() for _ in urls]
    rows = await conn.fetch(ENDPOINTS, DESTINATION, list(urls), tenant, secrets)
    by_url = {r["url"]: r["id"] for r in rows}
    return [by_url[u] for u in urls]


async def add_events(conn: asyncpg.Connection, events: int, tenant: str | None = None) -> None:
    step = 100_000
    for start in range(0, events, step):
        await conn.execute(EVENTS, DESTINATION, min(step, events - start), 198, tenant)


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
    events = int(await conn.fetchval("SELECT count(*) FROM outbox"))
    expected = events * matching + backlog
    by_status = {
        r[0]: int(r[1])
        for r in await conn.fetch("SELECT status, count(*) FROM outbox_deliveries GROUP BY 1")
    }
    deliveries = sum(by_status.values())
    healthy_delivered = await _healthy_delivered(conn, healthy_ids)
    attempts = int(await conn.fetchval("SELECT count(*) FROM outbox_attempts"))
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


# --- scenario A: isolation (steady and drain) ----------------------------------------------


async def isolation(
    db_url: str,
    tmp: Path,
    *,
    mode: str,
    healthy: int,
    slow_dead: bool,
    slow_delay: float,
    rate: float,
    seconds: float,
    events: int,
    writers: int,
    max_concurrency: int,
    batch_size: int,
    max_seconds: float,
    dead_backlog: int = 0,
    slow_endpoints: int = 1,
    max_in_flight: int | None = None,
    timeout: float = 15.0,
) -> dict[str, Any]:
    backlog = dead_backlog if slow_dead else 0
    slow = slow_endpoints if slow_dead else 0
    delays = [0.0] * healthy + [slow_delay] * slow
    total = healthy + (slow + 1 if slow_dead else 0)
    settings = relay_settings(
        db_url,
        batch_size=batch_size,
        max_concurrency=max_concurrency,
        endpoints=total,
        # Room for the slow endpoint's requests in flight to end and be recorded.
        shutdown=slow_delay + 2.0,
        max_in_flight=max_in_flight,
        timeout=timeout,
    )
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        with local_receivers(delays, tmp) as receivers:
            urls = list(receivers.urls)
            if slow_dead:
                urls.append(f"http://127.0.0.1:{free_port()}/dead")  # nothing listens there
            ids = await register(conn, urls)
            if backlog:
                await conn.execute(DEAD_BACKLOG, DESTINATION, ids[-1], backlog)
            load = Load(conn, db_url, receivers, ids[:healthy], max_seconds)
            async with running(settings) as (relay, task):
                await load.begin(relay, task)
                if mode == "steady":
                    await load.steady(db_url, rate, seconds, writers, tmp)
                else:
                    await load.drain(events)
                await load.end()
            received = receivers.stop()
        report = await load.report(received, total, latency=mode == "steady", backlog=backlog)
    finally:
        await conn.close()
    head: dict[str, Any] = {
        "mode": mode,
        "endpoints_healthy": healthy,
        "slow_and_dead": slow_dead,
    }
    if slow_dead:
        head["slow_endpoints"] = slow
        head["slow_delay_s"] = slow_delay
        head["dead_backlog"] = backlog
    head["max_concurrency"] = max_concurrency
    head["max_in_flight"] = settings.relay.max_in_flight
    head["timeout_s"] = timeout
    return {**head, **report}


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
        await self.backends.begin(self.conn)
        self.cpu0, self.receiver0 = time.process_time(), self.receivers.cpu_seconds()

    async def end(self) -> None:
        self.relay_cpu = time.process_time() - self.cpu0
        self.receiver_cpu = self.receivers.cpu_seconds() - self.receiver0
        self.pg_cpu = await self.backends.seconds(self.conn)
        self.statements = Counter(self.relay.store.statements)
        self.statements.subtract(self.statements0)
        dispatcher = getattr(self.relay.sinks[DESTINATION], "dispatcher", None)
        self.lost = dispatcher.stats["lost"] if dispatcher is not None else None

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
        ctx = multiprocessing.get_context("spawn")
        load = WriterLoad(rate / processes, seconds, writers, per_tx, 1000, self.started)
        procs = [ctx.Process(target=writer_main, args=(db_url, load, str(o))) for o in outs]
        try:
            for proc in procs:
                proc.start()
            for proc in procs:
                await asyncio.to_thread(proc.join, seconds * 3 + 60)
                if proc.exitcode != 0:
                    raise click.ClickException(
                        f"the load generator failed (exit code {proc.exitcode})"
                    )
            commits = read_commits(outs)  # at most MAX_EVENTS: a dict is small enough
            self.commits, elapsed = (
                dict(zip(commits.ids, commits.times, strict=True)),
                commits.elapsed,
            )
            achieved = len(self.commits) / elapsed if elapsed else 0.0
            self.load_seconds = elapsed
            self.figures = {
                "offered_per_s": rate,
                "achieved_per_s": round(achieved, 1),
                "rate_reached": achieved >= rate * REACHED,
                "events_per_tx": per_tx,
            }
            await self.until_delivered(len(self.commits) * len(self.healthy_ids))
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)

    async def report(
        self,
        received: list[tuple[int, int, float]],
        matching: int,
        *,
        latency: bool,
        backlog: int = 0,
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
            lat = [(t - self.commits[e]) * 1000 for (_, e), t in first.items() if e in self.commits]
            out["p50_ms"] = _ms(lat, 50)
            out["p95_ms"] = _ms(lat, 95)
            out["p99_ms"] = _ms(lat, 99)
            out["max_ms"] = round(max(lat, default=float("nan")), 2)
            recorded = [r[0] for r in await conn.fetch(RECORDED_LATENCY, self.healthy_ids)]
            out["recorded_p50_ms"] = _ms(recorded, 50)
            out["recorded_p99_ms"] = _ms(recorded, 99)
        out.update(self.costs(delivered))
        out.update(acc)
        out["deliveries_lost"] = self.lost
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
        # Every statement of the relay's hot paths, the outbox's own claim and record too.
        out["sql_statements_per_delivery"] = round(sum(self.statements.values()) / per, 3)
        out["max_rss_mb"] = round(rss_mb(), 1)
        return out


# --- scenario B: scale (many registered endpoints, few matching) -------------------------


async def scale(
    db_url: str,
    tmp: Path,
    *,
    registered: int,
    fan_out: int,
    events: int,
    max_concurrency: int,
    batch_size: int,
    max_seconds: float,
    probe: bool,
) -> dict[str, Any]:
    settings = relay_settings(
        db_url,
        batch_size=batch_size,
        max_concurrency=max_concurrency,
        endpoints=fan_out,
        shutdown=2.0,
    )
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        with local_receivers([0.0] * fan_out, tmp) as receivers:
            ids = await register(conn, receivers.urls, MATCH_TENANT)
            if registered > fan_out:
                secret = endpoint_secrets.generate()  # never used: no event matches them
                await conn.execute(FILLER, DESTINATION, registered - fan_out, secret)
            await conn.execute("ANALYZE outbox_endpoints")
            out: dict[str, Any] = {
                "endpoints_registered": int(
                    await conn.fetchval("SELECT count(*) FROM outbox_endpoints")
                ),
                "fan_out": fan_out,
                "max_concurrency": max_concurrency,
            }
            if probe:
                out.update(
                    await statement_probe(
                        db_url, min(events, PROBE_EVENTS), batch_size, max_concurrency
                    )
                )
            load = Load(conn, db_url, receivers, ids, max_seconds)
            async with running(settings) as (relay, task):
                await load.begin(relay, task)
                await add_events(conn, events, MATCH_TENANT)
                load.started = time.time()
                relay.wake()
                await load.until_delivered(events * fan_out)
                await load.end()
            received = receivers.stop()
        out.update(await load.report(received, fan_out, latency=False))
    finally:
        await conn.close()
    return out


# The probe's events, claimed at once by the probe's relay id: (id, fencing token), by id.
PROBE_CLAIM_ALL = """
UPDATE outbox SET status = 'running', locked_by = $1, locked_until = now() + interval '1 hour',
    claims = claims + 1
WHERE status = 'pending'
RETURNING id, claims
"""


async def statement_probe(
    db_url: str, events: int, batch_size: int, per_endpoint: int
) -> dict[str, Any]:
    """FAN_OUT, DELIVERY_CLAIM and DELIVERY_RECORD replayed alone, through the endpoints
    sink's own store on a pool made as the relay makes its own, nothing else running:
    ``events`` fanned out in batches, then claimed as the dispatcher does (``per_endpoint``
    per endpoint, the cursor carried) and recorded delivered until none is left. Wall time
    per delivery of each: on an idle loopback connection, PostgreSQL's time and a round trip.
    The rows are removed afterwards."""
    dsn = to_asyncpg_dsn(db_url)
    relay_id = "bench-probe"
    pool = await create_pool(dsn, relay_id, 1)
    store = DeliveryStore(Store(pool, "public", relay_id, 30.0))
    # The claim's arguments by name: they follow the store's signature.
    names = inspect.signature(store.claim).parameters
    spent: dict[str, float] = defaultdict(float)
    try:
        async with pool.acquire() as conn:
            await add_events(conn, events, MATCH_TENANT)
            # Held as a claim holds them: the fan-out records its events under their claim.
            held = sorted((r[0], r[1]) for r in await conn.fetch(PROBE_CLAIM_ALL, relay_id))
        deliveries = 0
        for start in range(0, len(held), batch_size):
            t = time.perf_counter()
            matched = await store.fan_out(held[start : start + batch_size], "no endpoint matched")
            spent["fan_out"] += time.perf_counter() - t
            deliveries += sum(matched.values())
        cursor: int | None = None
        claimed = claims = 0
        while claims < deliveries + 10:  # bounded: every claim but the last takes one or more
            args: dict[str, Any] = {
                "destinations": [DESTINATION],
                "limit": batch_size * 4,
                "skip": [],
                "scan": SCAN,
                "cursor": cursor,
            }
            if "start" in names:
                args.update(max_concurrency=[per_endpoint], start=[per_endpoint], caps={})
            elif "caps" in names:
                args.update(max_concurrency=[per_endpoint], caps={})
            elif "in_hand" in names:
                args.update(max_concurrency=[per_endpoint], in_hand={})
            else:
                args["per_endpoint"] = per_endpoint
            t = time.perf_counter()
            answer = await store.claim(**args)
            spent["claim"] += time.perf_counter() - t
            claims += 1
            got, cursor = answer[0], answer[1]
            if got:
                t = time.perf_counter()
                await store.record([_delivered(c) for c in got])
                spent["record"] += time.perf_counter() - t
                claimed += len(got)
            elif cursor is None:
                break
        async with pool.acquire() as conn:
            await conn.execute("TRUNCATE outbox, outbox_deliveries, outbox_attempts")
    finally:
        await pool.close()
    per = max(deliveries, 1)
    return {
        "probe_deliveries": deliveries,
        "probe_claimed": claimed,
        "probe_claims": claims,
        "probe_fan_out_us_per_delivery": round(spent["fan_out"] / per * 1e6, 1),
        "probe_claim_us_per_delivery": round(spent["claim"] / per * 1e6, 1),
        "probe_record_us_per_delivery": round(spent["record"] / per * 1e6, 1),
    }


def _delivered(c: Any) -> DeliveryRecord:
    return DeliveryRecord(
        id=c.id,
        token=c.token,
        status="delivered",
        counted=1,
        delay=0.0,
        error=None,
        http_status=204,
        event_id=c.event_id,
        endpoint_id=c.endpoint_id,
        duration_ms=1.0,
        response="",
        replay=c.replay,
    )


# --- ratios ------------------------------------------------------------------------------


ISOLATION_RATIOS: tuple[str, ...] = ("p50_ms", "p99_ms", "healthy_deliveries_per_s")
SCALE_RATIOS: tuple[str, ...] = (
    "healthy_deliveries_per_s",
    "relay_cpu_us_per_delivery",
    "pg_cpu_us_per_delivery",
    "fan_out_us_per_delivery",
    "delivery_claim_us_per_delivery",
    "probe_fan_out_us_per_delivery",
    "probe_claim_us_per_delivery",
)
# Costs the target holds within 20% (the others are printed for the reader).
SCALE_TARGET = (
    "relay_cpu_us_per_delivery",
    "pg_cpu_us_per_delivery",
    "probe_fan_out_us_per_delivery",
    "probe_claim_us_per_delivery",
)


def _ratios(results: dict[str, Any], scenario: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Per round, the run with the slow and dead pair (or all endpoints registered) against
    the one without; the median over rounds."""
    rounds = opts["rounds"]
    tags = [f" #{k + 1}" if rounds > 1 else "" for k in range(rounds)]
    if scenario == "scale":
        pairs = [(f"scale {opts['fan_out']}{t}", f"scale {opts['registered']}{t}") for t in tags]
        keys, label = SCALE_RATIOS, "registered_vs_matching_only"
    elif opts["compare"]:
        pairs = [(f"{scenario}{t}", f"{scenario} slow+dead{t}") for t in tags]
        keys = ISOLATION_RATIOS if scenario == "steady" else ("healthy_deliveries_per_s",)
        label = "slow_dead_vs_without"
    else:
        return {}
    ratios: dict[str, Any] = {}
    for key in keys:
        values = [
            results[b][key] / results[a][key]
            for a, b in pairs
            if results.get(a, {}).get(key) and results.get(b, {}).get(key) is not None
        ]
        if values:
            ratios[f"{key} {label}"] = round(statistics.median(values), 3)
    if scenario == "steady" and opts["compare"]:
        p99 = ratios.get(f"p99_ms {label}")
        ratios["target_p99_within_2x"] = p99 is not None and p99 <= 2.0
    if scenario == "scale":
        costs = [ratios.get(f"{k} {label}") for k in SCALE_TARGET]
        ratios["target_costs_within_20pct"] = all(c is not None and c <= 1.2 for c in costs if c)
    if rounds > 1:
        ratios["rounds"] = rounds
    return ratios
