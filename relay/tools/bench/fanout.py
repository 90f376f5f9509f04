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

import inspect
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import asyncpg

from outbox import endpoint_secrets
from outbox.dburl import to_asyncpg_dsn
from outbox.migrate import migrate
from relay.db.pool import create_pool
from relay.db.store import Store
from relay.sinks.endpoints.base import SCAN
from relay.sinks.endpoints.store import DeliveryRecord, DeliveryStore
from relay.tools.bench.common import DESTINATION, held_snapshot, machine
from relay.tools.bench.fanout_load import Load, dead_versions
from relay.tools.bench.fanout_setup import add_events, register, relay_settings, running
from relay.tools.bench.fanout_sql import (
    ANALYZE_ENDPOINTS,
    COUNT_ENDPOINTS,
    DEAD_BACKLOG,
    FILLER,
    PROBE_CLAIM_ALL,
    TRUNCATE_PROBE,
)
from relay.tools.bench.receiver import LocalReceivers, local_receivers
from relay.tools.localbroker import free_port
from relay.tools.scratch import scratch_database

# Bounds beyond each option's own (cli.py): a benchmark never runs unbounded.
MAX_EVENTS = 200_000  # --rate x --seconds
MAX_DELIVERIES = 2_000_000  # events x endpoints, for one run
MATCH_TENANT = "bench-match"
PROBE_EVENTS = 2000  # events the scale scenario's statement replay fans out and claims


# --- the runner -----------------------------------------------------------------------------


def run(opts: dict[str, Any]) -> dict[str, Any]:
    """Run the scenario(s) ``opts`` name; the results, as emit() prints them."""
    from relay.tools.stopping import run_tool

    return run_tool(_run(opts), opts.get("loop", "auto"), "bench fanout")


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
        hold_snapshot=opts["hold_snapshot"],
        window=opts["window"],
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
    hold_snapshot: bool = False,
    window: float = 30.0,
) -> dict[str, Any]:
    backlog = dead_backlog if slow_dead else 0
    slow = slow_endpoints if slow_dead else 0
    delays = [0.0] * healthy + [slow_delay] * slow
    total = healthy + (slow + 1 if slow_dead else 0)
    # shutdown: room for the slow endpoint's requests in flight to end and be recorded.
    settings = relay_settings(
        db_url, batch_size=batch_size, max_concurrency=max_concurrency, endpoints=total,
        shutdown=slow_delay + 2.0, max_in_flight=max_in_flight, timeout=timeout,
    )  # fmt: skip
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        with local_receivers(delays, tmp) as receivers:
            ids = await _register_isolation(conn, receivers, slow_dead, backlog)
            load = Load(conn, db_url, receivers, ids[:healthy], max_seconds)

            async def measured() -> dict[str, Any]:
                await load.run(settings, mode, events, (rate, seconds, writers), tmp)
                return await load.report(
                    receivers.stop(), total, latency=mode == "steady", backlog=backlog,
                    per_window=window,
                )  # fmt: skip

            report = await _held_around(db_url, conn, hold_snapshot, measured)
    finally:
        await conn.close()
    head: dict[str, Any] = {"mode": mode, "endpoints_healthy": healthy, "slow_and_dead": slow_dead}
    if slow_dead:
        head.update(slow_endpoints=slow, slow_delay_s=slow_delay, dead_backlog=backlog)
    head.update(
        hold_snapshot=hold_snapshot,
        max_concurrency=max_concurrency,
        max_in_flight=settings.relay.max_in_flight,
        timeout_s=timeout,
    )
    return {**head, **report}


async def _held_around(
    db_url: str,
    conn: asyncpg.Connection,
    hold: bool,
    body: Callable[[], Awaitable[dict[str, Any]]],
) -> dict[str, Any]:
    """``body``'s report; with ``hold``, a snapshot held from before it (the relay not yet
    started) until the run's rows are counted, no version the fan-out, the claims and the
    outcomes leave removable: the report then says what the tables kept, and the snapshot."""
    if not hold:
        return await body()
    async with held_snapshot(db_url) as held:
        report = await body()
        report.update(await dead_versions(conn))
    report.update(held.figures())
    return report


async def _register_isolation(
    conn: asyncpg.Connection, receivers: LocalReceivers, slow_dead: bool, backlog: int
) -> list[int]:
    """The receivers' endpoints, and with ``slow_dead`` one where nothing listens, the last,
    given a ``backlog`` of deliveries; their ids."""
    urls = list(receivers.urls)
    if slow_dead:
        urls.append(f"http://127.0.0.1:{free_port()}/dead")  # nothing listens there
    ids = await register(conn, urls)
    if backlog:
        await conn.execute(DEAD_BACKLOG, DESTINATION, ids[-1], backlog)
    return ids


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
            await conn.execute(ANALYZE_ENDPOINTS)
            out: dict[str, Any] = {
                "endpoints_registered": int(await conn.fetchval(COUNT_ENDPOINTS)),
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


async def statement_probe(
    db_url: str, events: int, batch_size: int, per_endpoint: int
) -> dict[str, Any]:
    """FAN_OUT, DELIVERY_CLAIM and DELIVERY_RECORD replayed alone, through the endpoints
    sink's own store on a pool made as the relay makes its own, nothing else running:
    ``events`` fanned out in batches, then claimed as the deliveries source does (``per_endpoint``
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
        deliveries = await _probe_fan_out(store, held, batch_size, spent)
        cursor: int | None = None
        claimed = claims = 0
        while claims < deliveries + 10:  # bounded: every claim but the last takes one or more
            args = _probe_claim_args(names, cursor, batch_size, per_endpoint)
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
            await conn.execute(TRUNCATE_PROBE)
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


async def _probe_fan_out(
    store: DeliveryStore, held: list[tuple[int, int]], batch_size: int, spent: dict[str, float]
) -> int:
    """The probe's events fanned out in batches, timed into ``spent``; the deliveries made."""
    deliveries = 0
    for start in range(0, len(held), batch_size):
        t = time.perf_counter()
        matched = await store.fan_out(held[start : start + batch_size], "no endpoint matched")
        spent["fan_out"] += time.perf_counter() - t
        deliveries += sum(matched.values())
    return deliveries


def _probe_claim_args(
    names: Mapping[str, Any], cursor: int | None, batch_size: int, per_endpoint: int
) -> dict[str, Any]:
    """A claim's arguments as the deliveries source passes them, by the names the store's claim
    takes (``names``: its parameters; they changed over the releases)."""
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
    if "sweep" in names:
        args["sweep"] = False  # the source sweeps every SWEEP_EVERY seconds, not every claim
    return args


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
