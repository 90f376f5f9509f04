"""The ``outbox-relay bench`` commands."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import click

from outbox.migrate import migrate
from relay.runtime import loop
from relay.tools.bench.common import Target, emit, machine
from relay.tools.bench.options import (
    as_json,
    common,
    database_url,
    event_loop,
    hold_snapshot,
    max_seconds,
    shown,
    window,
)
from relay.tools.bench.receiver import local_receiver
from relay.tools.localbroker import LocalBroker
from relay.tools.scratch import scratch_database

Scenario = Callable[[str, Target], Awaitable[dict[str, Any]]]


@contextlib.asynccontextmanager
async def target(opts: dict[str, Any]) -> AsyncIterator[Target]:
    sink, bootstrap = opts["sink"], opts.get("bootstrap")
    with contextlib.ExitStack() as stack:
        broker = None
        if sink == "kafka" and not bootstrap:
            broker = stack.enter_context(LocalBroker())
            bootstrap = broker.bootstrap
        url = opts.get("webhook_url")
        receiver = None
        if sink == "webhook" and not url:
            receiver = stack.enter_context(local_receiver())
            url = receiver.url
        idempotence = opts.get("idempotence")
        yield Target(
            kind=sink,
            bootstrap=bootstrap,
            idempotent=idempotence if idempotence is not None else broker is None,
            webhook_url=url,
            webhook_concurrency=opts.get("webhook_concurrency", 64),
            receiver_cpu=receiver.cpu_seconds if receiver else None,
        )


async def run_scenarios(opts: dict[str, Any], scenarios: dict[str, Scenario]) -> dict[str, Any]:
    database_url = opts["database_url"]
    results: dict[str, Any] = {}
    async with target(opts) as t:
        results["sink"] = t.describe()
        results["event_loop"] = loop.name()
        for name, scenario in scenarios.items():
            # Each scenario gets a database of its own, so none measures another's leftovers.
            async with scratch_database(database_url, "outbox_bench") as db_url:
                await migrate(db_url)
                results.setdefault("machine", await machine(db_url))
                results[name] = await scenario(db_url, t)
    return results


def execute(
    opts: dict[str, Any],
    scenarios: dict[str, Scenario],
    derive: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    from relay.obs.logs import configure
    from relay.tools.stopping import run_tool

    configure("warning", "console")
    results = run_tool(run_scenarios(opts, scenarios), opts.get("loop", "auto"), "bench")
    if derive is not None:
        derive(results)
    emit(results, opts["as_json"])
    return results


@click.group(short_help="Measure throughput, latency and database cost.")
def bench() -> None:
    """Measure throughput, latency and database cost on this machine.

    Every run uses a scratch database that it drops afterwards, and bounds its own time.
    """


CLAIMS = shown(
    "--claims", "auto", type=click.Choice(["auto", "row", "batch"]), help="relay.claims."
)


def _drain_scenarios(opts: dict[str, Any]) -> dict[str, Scenario]:
    from relay.tools.bench.drain import drain, naive
    from relay.tools.bench.simple import simple

    def run(ordering: str) -> Scenario:
        return lambda db, t: drain(
            db,
            t,
            events=opts["events"],
            payload=opts["payload"],
            keys=opts["keys"],
            batch_size=opts["batch_size"],
            relays=opts["relays"],
            max_in_flight=opts["max_in_flight"],
            max_seconds=opts["max_seconds"],
            ordering=ordering,
            retention=opts["retention"],
            hold_snapshot=opts["hold_snapshot"],
            claims=opts["claims"],
        )

    scenarios: dict[str, Scenario] = {}
    if opts["ordering"] in ("none", "both"):
        scenarios["drain"] = run("none")
    if opts["ordering"] in ("key", "both"):
        scenarios["drain ordering=key"] = run("key")
    if opts["compare_naive"]:
        scenarios["naive loop"] = lambda db, t: naive(
            db,
            t,
            events=opts["naive_events"],
            payload=opts["payload"],
            keys=opts["keys"],
            max_seconds=opts["max_seconds"],
        )
    if opts["compare_simple"]:
        scenarios["simple loop"] = lambda db, t: simple(
            db,
            t,
            events=opts["events"],
            payload=opts["payload"],
            keys=opts["keys"],
            max_seconds=opts["max_seconds"],
        )
    return scenarios


def _ratios(results: dict[str, Any]) -> None:
    rate = {
        k: v["events_per_s"]
        for k, v in results.items()
        if isinstance(v, dict) and "events_per_s" in v
    }
    ratios = {}
    if "drain" in rate and "naive loop" in rate:
        ratios["relay_vs_naive"] = round(rate["drain"] / rate["naive loop"], 1)
    if "drain ordering=key" in rate and "naive loop" in rate:
        ratios["ordered_vs_naive"] = round(rate["drain ordering=key"] / rate["naive loop"], 1)
    if "drain" in rate and "simple loop" in rate:
        ratios["relay_vs_simple"] = round(rate["drain"] / rate["simple loop"], 2)
    if "drain" in rate and "drain ordering=key" in rate:
        ratios["ordered_vs_unordered"] = round(rate["drain ordering=key"] / rate["drain"], 2)
    if ratios:
        results["ratios"] = ratios


@bench.command("drain", short_help="Time the relay emptying a prefilled table.")
@common
@shown("--events", 200_000, type=click.IntRange(1))
@shown("--payload", 200, help="Payload bytes.")
@shown("--keys", 1000, help="Distinct message keys.")
@shown("--batch-size", 500)
@shown("--relays", 1, help="Relays (in this process).")
@click.option("--max-in-flight", type=int, help="Default: 4 batches.")
@shown(
    "--ordering",
    "none",
    type=click.Choice(["none", "key", "both"]),
    help="Destination ordering; both: run unordered and ordered and print the ratio.",
)
@click.option(
    "--retention",
    type=float,
    help="relay.retention in seconds (default: the relay's); 0 deletes rows as they are recorded.",
)
@hold_snapshot("from after the prefill, before the relay starts, to the drain's end")
@CLAIMS
@click.option("--compare-naive", is_flag=True, help="Also run the one-row-per-round loop.")
@shown("--naive-events", 3000)
@click.option(
    "--compare-simple",
    is_flag=True,
    help="Also run a simple batched loop (4 loops of claim 100, send, mark) on as many events.",
)
@shown("--max-seconds", 120.0, help="Stop a phase after this.")
def drain_cmd(**opts: Any) -> None:
    """Prefill events, then time the relay emptying the table."""
    execute(opts, _drain_scenarios(opts), derive=_ratios)


# The options of bench steady that steady() takes as they are.
STEADY_OPTIONS = (
    *("rate", "seconds", "batch_size", "writers", "idle_seconds", "processes", "per_tx"),
    *("ordering", "keys", "retention", "hold_snapshot", "hold_insert", "window", "warmup"),
    "claims",
)


@bench.command("steady", short_help="Commit-to-ack latency at a fixed rate.")
@common
@shown("--rate", 1000.0, help="Events offered per second.")
@shown(
    "--seconds",
    10.0,
    type=click.FloatRange(0.1, 24 * 3600),
    help="How long the writers offer the rate; hours are fine (about 40 bytes of memory an event).",
)
@shown("--writers", 8, help="Connections per writer process.")
@click.option(
    "--processes",
    type=int,
    help="Writer processes (like app instances); default: 1, or 2 above 2,000 events/s.",
)
@click.option(
    "--per-tx",
    type=int,
    help="Events per app transaction (enqueue_many); default: 1 up to 1,000 events/s, then "
    "enough to keep transactions at 500/s.",
)
@shown("--batch-size", 500)
@shown("--idle-seconds", 3.0, help="Idle CPU sample after.")
@shown("--ordering", "none", type=click.Choice(["none", "key"]), help="Destination ordering.")
@shown(
    "--keys",
    1000,
    type=click.IntRange(1),
    help="Distinct message keys, one per transaction (its events share it).",
)
@click.option(
    "--retention",
    type=float,
    help="relay.retention in seconds (default: the relay's); 0 deletes rows as they are "
    "recorded. Retention runs once a minute: a long run shows the table level off.",
)
@hold_snapshot("from before the load starts to the run's end")
@shown(
    "--hold-insert",
    0.0,
    type=click.FloatRange(0),
    help="Seconds an application transaction that enqueued one event stays open, from "
    "--warmup seconds into the load (a bulk import, a session idle in transaction); 0: none.",
)
@CLAIMS
@window(15.0)
@shown(
    "--warmup",
    15.0,
    type=click.FloatRange(0),
    help="Seconds after the first commit before first_minute starts.",
)
def steady_cmd(**opts: Any) -> None:
    """Offer app transactions at a fixed rate; report commit-to-ack latency: overall, per
    --window of commit time, and in the first minute after --warmup against the last; then
    the outbox table's row versions (dead ones per event) and sizes."""
    from relay.tools.bench.steady import load_shape, steady

    per_tx, processes = load_shape(opts["rate"], opts["per_tx"], opts["processes"])
    opts.update(per_tx=per_tx, processes=processes)
    with tempfile.TemporaryDirectory() as tmp:
        execute(
            opts,
            {
                f"steady {opts['rate']:g}/s": lambda db, t: steady(
                    db, t, tmp=Path(tmp), **{k: opts[k] for k in STEADY_OPTIONS}
                )
            },
        )


@bench.command("enqueue", short_help="What enqueueing costs the application.")
@common
@shown("--transactions", 3000)
@shown("--bulk-rows", 200_000)
@shown("--chunk", 1000, help="Rows per enqueue_many.")
@shown("--payload", 200)
def enqueue_cmd(**opts: Any) -> None:
    """What enqueueing costs the application."""
    from relay.tools.bench.enqueue import enqueue

    opts["sink"] = "null"
    execute(
        opts,
        {
            "enqueue": lambda db, t: enqueue(
                db,
                transactions=opts["transactions"],
                bulk_rows=opts["bulk_rows"],
                chunk=opts["chunk"],
                payload=opts["payload"],
            )
        },
    )


@bench.command("history", short_help="Claim latency beside many delivered rows.")
@common
@shown("--rows", 2_000_000, help="Delivered rows to add.")
@shown("--rounds", 200)
@shown("--batch", 100, help="Rows per claim.")
def history_cmd(**opts: Any) -> None:
    """Claim latency on an empty table and beside many delivered rows."""
    from relay.tools.bench.history import history

    opts["sink"] = "null"
    execute(
        opts,
        {
            "history": lambda db, t: history(
                db, rows=opts["rows"], rounds=opts["rounds"], batch=opts["batch"]
            )
        },
    )


@bench.command("fanout", short_help="Fan-out to many endpoints: isolation, scale.")
@database_url("Server for the scratch databases (created and dropped by the run).")
@shown(
    "--scenario",
    "steady",
    type=click.Choice(["steady", "drain", "scale"]),
    help="steady: events at --rate, commit-to-delivery latency; drain: --events committed "
    "first, deliveries/s; scale: --registered endpoints, --fan-out of them matching, against "
    "only those registered.",
)
@shown(
    "--endpoints",
    8,
    type=click.IntRange(1, 64),
    help="Healthy endpoints (steady, drain), each a loopback port of the receiver process.",
)
@shown(
    "--slow-dead/--no-slow-dead",
    True,
    help="Add an endpoint answering after --slow-delay and one that refuses connections.",
)
@click.option("--compare", is_flag=True, help="Run without and with the slow+dead pair; ratios.")
@shown(
    "--dead-backlog",
    0,
    type=click.IntRange(0, 1_000_000),
    help="Deliveries already queued for the dead endpoint (waiting out their backoff).",
)
@shown("--slow-delay", 2.0, type=click.FloatRange(0, 30))
@shown(
    "--slow-endpoints",
    1,
    type=click.IntRange(1, 500),
    help="Slow endpoints in the slow+dead set (each answers 2xx after --slow-delay).",
)
@shown(
    "--timeout",
    15.0,
    type=click.FloatRange(0.1, 300),
    help="The destination's request timeout (set it above --slow-delay: slow, not failing).",
)
@click.option(
    "--max-in-flight",
    type=click.IntRange(1, 100_000),
    help="The relay's max_in_flight (default: 4 x --batch-size).",
)
@shown("--rate", 500.0, type=click.FloatRange(1, 5000), help="Events/s.")
@shown(
    "--seconds",
    10.0,
    type=click.FloatRange(0.1, 1800),
    help="steady: seconds of load (--rate x --seconds is bounded too).",
)
@shown("--writers", 8, type=click.IntRange(1, 32), help="Connections.")
@click.option(
    "--events",
    type=click.IntRange(1, 200_000),
    help="Events committed first: default 20,000 (drain), 5,000 (scale).",
)
@hold_snapshot("(steady, drain) from before the relay starts to the run's end")
@window(30.0)
@shown(
    "--registered",
    10_000,
    type=click.IntRange(2, 100_000),
    help="scale: endpoints registered for the destination in all.",
)
@shown(
    "--fan-out",
    10,
    type=click.IntRange(1, 64),
    help="scale: endpoints each event's tenant matches.",
)
@shown(
    "--probe/--no-probe",
    True,
    help="scale: also replay FAN_OUT and DELIVERY_CLAIM alone on one connection, timed.",
)
@shown(
    "--max-concurrency",
    4,
    type=click.IntRange(1, 64),
    help="The destination's max_concurrency (requests in flight per endpoint).",
)
@shown("--batch-size", 500, type=click.IntRange(1, 10_000))
@shown(
    "--rounds",
    1,
    type=click.IntRange(1, 5),
    help="Repeat the runs alternately; ratios are medians over rounds.",
)
@max_seconds(120.0, "Stop waiting for deliveries after this, per run.")
@event_loop()
@as_json
def fanout_cmd(**opts: Any) -> None:
    """An endpoints destination fanning events out to many endpoints: isolation of the
    healthy ones from a slow and a dead one, and the cost of many registered endpoints."""
    from relay.obs.logs import configure
    from relay.tools.bench.fanout import MAX_DELIVERIES, MAX_EVENTS, run

    scenario = opts["scenario"]
    if opts["events"] is None:
        opts["events"] = 20_000 if scenario == "drain" else 5_000
    if scenario == "scale" and opts["registered"] <= opts["fan_out"]:
        raise click.UsageError("--registered must be more than --fan-out")
    if scenario == "steady" and opts["rate"] * opts["seconds"] > MAX_EVENTS:
        raise click.UsageError(f"--rate x --seconds is at most {MAX_EVENTS:,} events")
    per_event = (
        opts["fan_out"] if scenario == "scale" else opts["endpoints"] + opts["slow_endpoints"] + 1
    )
    events = opts["rate"] * opts["seconds"] if scenario == "steady" else opts["events"]
    if events * per_event > MAX_DELIVERIES:
        raise click.UsageError(f"at most {MAX_DELIVERIES:,} deliveries per run")
    configure("warning", "console")
    emit(run(opts), opts["as_json"])


@bench.command("console", short_help="The console's pages over a large outbox.")
@database_url()
@shown(
    "--rows",
    10_000_000,
    type=click.IntRange(1000, 20_000_000),
    help="Rows in the outbox (at most 20 million: about 8 GB and 3 minutes to fill).",
)
@shown(
    "--pending-fraction",
    0.01,
    type=click.FloatRange(0, 0.5),
    help="The newest rows, pending (a few hundred of them running).",
)
@shown(
    "--hours",
    24.0,
    type=click.FloatRange(0.1, 24 * 30),
    help="The delivered rows' history spans this many hours (relay.retention).",
)
@shown("--payload", 200, type=click.IntRange(20, 10_000))
@shown(
    "--requests",
    20,
    type=click.IntRange(3, 1000),
    help="Measured requests per page (after two unmeasured ones).",
)
@max_seconds(30.0, "Per page: stop after this (and at least 3 requests).")
@event_loop()
@as_json
def console_cmd(**opts: Any) -> None:
    """The operator console over a large outbox: fill a scratch database with generate_series
    (the newest rows pending, the rest delivered, some failed), then time GET / and the other
    pages over a real server, and admin.status alone (median, p95)."""
    from relay.tools.bench.console import console

    def progress(rows: int) -> None:
        if not opts["as_json"]:
            click.echo(f"filled {rows:,} of {opts['rows']:,} rows", err=True)

    opts["sink"] = "null"
    execute(
        opts,
        {
            "console": lambda db, t: console(
                db,
                rows=opts["rows"],
                pending_fraction=opts["pending_fraction"],
                hours=opts["hours"],
                payload=opts["payload"],
                requests=opts["requests"],
                max_seconds=opts["max_seconds"],
                progress=progress,
            )
        },
    )
