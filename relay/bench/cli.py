"""The ``outbox-relay bench`` commands."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import click

from outbox.migrate import migrate
from relay.bench.common import Target, emit, machine
from relay.localbroker import LocalBroker
from relay.scratch import scratch_database

Scenario = Callable[[str, Target], Awaitable[dict[str, Any]]]


def common(func: Any) -> Any:
    options = [
        click.option(
            "--database-url",
            envvar="OUTBOX_DATABASE_URL",
            default="postgresql://root@127.0.0.1:5432/postgres",
            show_default=True,
            help="Server for the scratch database (created and dropped by the run).",
        ),
        click.option(
            "--sink",
            type=click.Choice(["kafka", "null"]),
            default="kafka",
            show_default=True,
            help="kafka, or null to measure the database side alone.",
        ),
        click.option("--bootstrap", help="Kafka broker; default: start a local one (Tansu)."),
        click.option(
            "--idempotence/--no-idempotence",
            default=None,
            help="Idempotent producer; default on with --bootstrap, off for the local broker "
            "(whose memory engine rejects it).",
        ),
        click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@contextlib.asynccontextmanager
async def target(
    sink: str, bootstrap: str | None, idempotence: bool | None
) -> AsyncIterator[Target]:
    broker = None
    if sink == "kafka" and not bootstrap:
        broker = LocalBroker()
        broker.start()
        bootstrap = broker.bootstrap
    try:
        idem = idempotence if idempotence is not None else broker is None
        yield Target(kind=sink, bootstrap=bootstrap, idempotent=idem)
    finally:
        if broker is not None:
            broker.stop()


async def run_scenarios(
    database_url: str,
    sink: str,
    bootstrap: str | None,
    idempotence: bool | None,
    scenarios: dict[str, Scenario],
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    async with target(sink, bootstrap, idempotence) as t:
        results["sink"] = t.describe()
        for name, scenario in scenarios.items():
            # Each scenario gets a database of its own, so none measures another's leftovers.
            async with scratch_database(database_url, "outbox_bench") as db_url:
                await migrate(db_url)
                results.setdefault("machine", await machine(db_url))
                results[name] = await scenario(db_url, t)
    return results


def execute(opts: dict[str, Any], scenarios: dict[str, Scenario]) -> dict[str, Any]:
    from relay.logging import configure

    configure("warning", "console")
    results = asyncio.run(
        run_scenarios(
            opts["database_url"], opts["sink"], opts["bootstrap"], opts["idempotence"], scenarios
        )
    )
    emit(results, opts["as_json"])
    return results


@click.group()
def bench() -> None:
    """Measure throughput, latency and database cost on this machine.

    Every run uses a scratch database that it drops afterwards, and bounds its own time.
    """


def _drain_scenarios(
    events: int,
    payload: int,
    keys: int,
    batch_size: int,
    relays: int,
    max_in_flight: int | None,
    compare_naive: bool,
    naive_events: int,
    max_seconds: float,
) -> dict[str, Scenario]:
    from relay.bench.drain import drain, naive

    scenarios: dict[str, Scenario] = {
        "drain": lambda db, t: drain(
            db,
            t,
            events=events,
            payload=payload,
            keys=keys,
            batch_size=batch_size,
            relays=relays,
            max_in_flight=max_in_flight,
            max_seconds=max_seconds,
        )
    }
    if compare_naive:
        scenarios["naive loop"] = lambda db, t: naive(
            db, t, events=naive_events, payload=payload, keys=keys, max_seconds=max_seconds
        )
    return scenarios


def _ratio(results: dict[str, Any], as_json: bool) -> None:
    if "naive loop" in results:
        ratio = results["drain"]["events_per_s"] / results["naive loop"]["events_per_s"]
        results["drain_vs_naive"] = round(ratio, 1)
        if not as_json:
            click.echo(f"\nrelay vs naive loop: {ratio:.1f}x")


@bench.command("drain")
@common
@click.option("--events", default=200_000, show_default=True, type=click.IntRange(1))
@click.option("--payload", default=200, show_default=True, help="Payload bytes.")
@click.option("--keys", default=1000, show_default=True, help="Distinct message keys.")
@click.option("--batch-size", default=500, show_default=True)
@click.option("--relays", default=1, show_default=True, help="Relays (in this process).")
@click.option("--max-in-flight", type=int, help="Default: 4 batches.")
@click.option("--compare-naive", is_flag=True, help="Also run the one-row-per-round loop.")
@click.option("--naive-events", default=3000, show_default=True)
@click.option("--max-seconds", default=120.0, show_default=True, help="Stop a phase after this.")
def drain_cmd(**opts: Any) -> None:
    """Prefill events, then time the relay emptying the table."""
    scenarios = _drain_scenarios(
        opts["events"],
        opts["payload"],
        opts["keys"],
        opts["batch_size"],
        opts["relays"],
        opts["max_in_flight"],
        opts["compare_naive"],
        opts["naive_events"],
        opts["max_seconds"],
    )
    results = execute(opts, scenarios)
    _ratio(results, opts["as_json"])


@bench.command("steady")
@common
@click.option("--rate", default=1000.0, show_default=True, help="Events offered per second.")
@click.option("--seconds", default=10.0, show_default=True)
@click.option("--writers", default=8, show_default=True, help="Concurrent app connections.")
@click.option("--batch-size", default=500, show_default=True)
@click.option("--idle-seconds", default=3.0, show_default=True, help="Idle CPU sample after.")
def steady_cmd(**opts: Any) -> None:
    """Offer app transactions at a fixed rate; report commit-to-ack latency."""
    from relay.bench.steady import steady

    with tempfile.TemporaryDirectory() as tmp:
        execute(
            opts,
            {
                f"steady {opts['rate']:g}/s": lambda db, t: steady(
                    db,
                    t,
                    rate=opts["rate"],
                    seconds=opts["seconds"],
                    batch_size=opts["batch_size"],
                    writers=opts["writers"],
                    idle_seconds=opts["idle_seconds"],
                    tmp=Path(tmp),
                )
            },
        )


@bench.command("enqueue")
@common
@click.option("--transactions", default=3000, show_default=True)
@click.option("--bulk-rows", default=200_000, show_default=True)
@click.option("--chunk", default=1000, show_default=True, help="Rows per enqueue_many.")
@click.option("--payload", default=200, show_default=True)
def enqueue_cmd(**opts: Any) -> None:
    """What enqueueing costs the application."""
    from relay.bench.enqueue import enqueue

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


@bench.command("history")
@common
@click.option("--rows", default=2_000_000, show_default=True, help="Delivered rows to add.")
@click.option("--rounds", default=200, show_default=True)
@click.option("--batch", default=100, show_default=True, help="Rows per claim.")
def history_cmd(**opts: Any) -> None:
    """Claim latency on an empty table and beside many delivered rows."""
    from relay.bench.history import history

    opts["sink"] = "null"
    execute(
        opts,
        {
            "history": lambda db, t: history(
                db, rows=opts["rows"], rounds=opts["rounds"], batch=opts["batch"]
            )
        },
    )
