"""What the benchmark scenarios share: scratch data, sinks, timing, reporting."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import os
import platform
import resource
import time
import uuid
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import click

from outbox.dburl import to_asyncpg_dsn
from outbox.queries import qualified_table, render
from outbox.sql import load
from relay.breaker import Breaker
from relay.model import Envelope, Outcome, Result
from relay.sinks import Host, Sink
from relay.sinks.kafka.config import KafkaDestination, KafkaSettings
from relay.sinks.kafka.sink import KafkaSink
from relay.sinks.null import NullSink
from relay.sinks.source import SendingSource
from relay.sinks.webhook.config import WebhookClientSettings, WebhookDestination
from relay.sinks.webhook.sink import WebhookSink

DESTINATION = "bench"
# The scratch database is migrated into the default schema.
TABLE = qualified_table("public")
SNAPSHOT_APP = "bench-held-snapshot"

# The statements' text, and why each is written so, is in common.sql beside this module.
_q = load("relay.tools.bench", "common.sql", binds="numbered")

# What a pg_dump reads first: the table ({table}, filled in with TABLE where it is run).
READ_OUTBOX = _q["read_outbox"]
PREFILL = _q["prefill"]
FILL_HISTORY = _q["fill_history"]
BEGIN_REPEATABLE_READ = _q["begin_repeatable_read"]
OWN_XMIN = _q["own_xmin"]
BACKEND_XMIN = _q["backend_xmin"]
TABLE_STATS = _q["table_stats"]
OTHER_BACKENDS = _q["other_backends"]
CLEAR_STATS_SNAPSHOT = _q["clear_stats_snapshot"]
VACUUM_ANALYZE = _q["vacuum_analyze"]
SERVER_VERSION = _q["server_version"]


@dataclass
class Target:
    """Where the scenarios deliver: a sink factory plus what to print about it."""

    kind: str
    bootstrap: str | None = None
    idempotent: bool = True
    webhook_url: str | None = None
    webhook_concurrency: int = 64
    topics: list[str] = field(default_factory=list)
    # CPU seconds the local receiver has used so far, when the benchmark started one.
    receiver_cpu: Callable[[], float] | None = None
    # Request latencies (ms) of the webhook sinks made, for p50/p99.
    latencies: list[float] = field(default_factory=list)

    def make_sink(self, max_request_size: int = 1_048_576) -> Sink:
        if self.kind == "null":
            return NullSink()
        if self.kind == "kafka":
            assert self.bootstrap
            topic = f"bench-{uuid.uuid4().hex[:8]}"
            self.topics.append(topic)
            settings = KafkaSettings(
                bootstrap_servers=self.bootstrap,
                enable_idempotence=self.idempotent,
                max_request_size=max_request_size,
            )
            return KafkaSink(settings, {DESTINATION: KafkaDestination(kind="kafka", topic=topic)})
        if self.kind == "webhook":
            assert self.webhook_url
            dest = WebhookDestination(
                kind="webhook",
                url=self.webhook_url,
                # The benchmark's own receiver is on loopback; a --webhook-url elsewhere is
                # the user's to choose.
                allow_private_networks=True,
                max_concurrency=self.webhook_concurrency,
                # Signing is part of every real delivery, so it is part of the measurement.
                secrets=["whsec_" + base64.b64encode(os.urandom(32)).decode()],
            )
            client = WebhookClientSettings(max_connections=max(100, self.webhook_concurrency))
            sink = WebhookSink(client, {DESTINATION: dest})
            sink.latencies = self.latencies
            return sink
        raise click.UsageError(f"unknown sink {self.kind!r}")

    def describe(self) -> str:
        if self.kind == "kafka":
            idem = "idempotent" if self.idempotent else "idempotence off"
            return f"kafka at {self.bootstrap} ({idem})"
        if self.kind == "webhook":
            return f"webhook to {self.webhook_url} (max_concurrency {self.webhook_concurrency})"
        return self.kind


class TimingSink:
    """Wraps a sink and notes when each row was acknowledged (wall clock, for latency).

    The acknowledgements are kept in two arrays (16 bytes each), not a dict of objects, so
    an hour at thousands of events a second stays in a few hundred MB."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.acked_ids: array[int] = array("q")
        self.acked_at: array[float] = array("d")

    @property
    def acked(self) -> int:
        """Delivered outcomes so far (a row delivered twice, after a lost lease, counts twice)."""
        return len(self.acked_ids)

    def ack_times(self, base: int, span: int) -> array[float]:
        """When rows ``base .. base + span - 1`` were first acknowledged (NaN: never), by
        ``id - base``: the ids of one run come from one sequence, so the lookup is dense."""
        times = array("d", [math.nan]) * span
        for i, at in zip(self.acked_ids, self.acked_at, strict=True):
            j = i - base
            if 0 <= j < span and math.isnan(times[j]):
                times[j] = at
        return times

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    def available(self, destination: str) -> bool:
        return self.inner.available(destination)

    def ready(self, destination: str) -> bool:
        return self.inner.ready(destination)

    def circuits(self) -> Mapping[str, Breaker]:
        return self.inner.circuits()

    def breakers_of(self, destination: str) -> Sequence[Breaker]:
        return self.inner.breakers_of(destination)

    def attach(self, host: Host) -> None:
        self.inner.attach(host)

    def tasks(self) -> set[asyncio.Task[None]]:
        return self.inner.tasks()

    def wake(self) -> None:
        self.inner.wake()

    async def drain(self, timeout: float) -> None:
        await self.inner.drain(timeout)

    def claim_limit(self, destination: str, limit: int) -> int:
        return self.inner.claim_limit(destination, limit)

    def sources(self) -> Sequence[SendingSource[Any]]:
        return self.inner.sources()

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
        outcomes = await self.inner.deliver(batch)
        now = time.time()
        for o in outcomes:
            if o.result is Result.DELIVERED:
                self.acked_ids.append(o.id)
                self.acked_at.append(now)
        return outcomes


class Latencies:
    """Latencies (ms) counted in 0.01 ms bins: percentiles of millions of events in little
    memory, exact to the 0.01 ms the reports round to."""

    def __init__(self) -> None:
        self.bins: Counter[int] = Counter()
        self.count = 0
        self.max = -math.inf

    def add(self, ms: float) -> None:
        self.bins[round(ms * 100)] += 1
        self.count += 1
        if ms > self.max:
            self.max = ms

    def percentile(self, p: float) -> float:
        """As percentile() on the values themselves: the value at rank round(p% of n - 1)."""
        if not self.count:
            return math.nan
        k = min(self.count - 1, max(0, round(p / 100 * (self.count - 1))))
        seen = 0
        for b in sorted(self.bins):
            seen += self.bins[b]
            if seen > k:
                return b / 100
        raise AssertionError("unreachable: the bins hold count values")

    def figures(self, *ps: float) -> dict[str, float]:
        out = {f"p{p:g}_ms": round(self.percentile(p), 2) for p in ps}
        out["max_ms"] = round(self.max, 2) if self.count else math.nan
        return out


@dataclass
class HeldSnapshot:
    """What ``held_snapshot`` held: its backend, the xmin it showed, for how long."""

    pid: int = 0
    xmin: str | None = None  # pg_stat_activity.backend_xmin once the snapshot was taken
    xmin_at_end: str | None = None  # the same, seen from another connection before release
    started: float = 0.0
    seconds: float = 0.0

    def figures(self) -> dict[str, Any]:
        return {
            "snapshot_held_seconds": round(self.seconds, 1),
            "snapshot_xmin": self.xmin,
            "snapshot_xmin_at_end": self.xmin_at_end,
        }


@contextlib.asynccontextmanager
async def held_snapshot(db_url: str) -> AsyncIterator[HeldSnapshot]:
    """A snapshot held open, as a ``pg_dump`` or a long report holds one: a connection to
    the same database in a REPEATABLE READ transaction that has read the outbox, left open
    until the block ends. VACUUM (and page pruning) cannot remove row versions that died
    after it was taken, so the table keeps every dead version of the run."""
    held = HeldSnapshot()
    conn = await asyncpg.connect(
        to_asyncpg_dsn(db_url), server_settings={"application_name": SNAPSHOT_APP}
    )
    try:
        await conn.execute(BEGIN_REPEATABLE_READ)
        await conn.fetchval(render(READ_OUTBOX, TABLE))
        held.pid = conn.get_server_pid()
        held.xmin = await conn.fetchval(OWN_XMIN)
        held.started = time.monotonic()
        yield held
        # Its own connection would show the activity it read at the transaction's start.
        other = await asyncpg.connect(to_asyncpg_dsn(db_url))
        try:
            held.xmin_at_end = await other.fetchval(BACKEND_XMIN, held.pid)
        finally:
            await other.close()
    finally:
        held.seconds = time.monotonic() - held.started if held.started else 0.0
        await conn.close()


async def table_stats(db_url: str, events: int, settle: float = 5.0) -> dict[str, Any]:
    """The outbox table's row versions and sizes at the end of a run, per delivered event.

    Call it once the relay and the writers have closed their connections: a backend sends
    its counts to the statistics on exit (and otherwise at most once a second, or ten
    seconds after going idle), so this waits up to ``settle`` seconds for the others to be
    gone. ``n_dead_tup`` is what the last (auto)vacuum left plus what died since: a vacuum
    during the run lowers it; ``autovacuum_runs`` says whether one ran. Page pruning frees
    a dead version's space but leaves its line pointer, which PostgreSQL 15 still counts, so
    the table's size shows a held snapshot before this count does."""
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        deadline = time.monotonic() + settle
        while await conn.fetchval(OTHER_BACKENDS, SNAPSHOT_APP) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await conn.execute(CLEAR_STATS_SNAPSHOT)
        row = await conn.fetchrow(TABLE_STATS, TABLE)
        batches = await conn.fetchrow(TABLE_STATS, "outbox_batches")
    finally:
        await conn.close()
    assert row is not None, f"{TABLE} is not in pg_stat_user_tables"
    per = max(events, 1)
    return {
        "outbox_live_rows": row["n_live_tup"],
        "outbox_dead_rows": row["n_dead_tup"],
        "outbox_inserts": row["n_tup_ins"],
        "outbox_updates": row["n_tup_upd"],
        "outbox_hot_updates": row["n_tup_hot_upd"],
        "outbox_deletes": row["n_tup_del"],
        "autovacuum_runs": row["autovacuum_count"],
        "outbox_table_mb": round(row["table_bytes"] / 2**20, 1),
        "outbox_indexes_mb": round(row["indexes_bytes"] / 2**20, 1),
        # Every UPDATE and DELETE leaves a dead version behind: 2 per event on the happy
        # path (the claim's and the outcome's UPDATE), until vacuum removes them; 1 with
        # relay.claims = "batch" (the outcome's).
        "row_versions_written_per_event": round((row["n_tup_upd"] + row["n_tup_del"]) / per, 3),
        "dead_rows_per_event": round(row["n_dead_tup"] / per, 3),
        # relay.claims = "batch": a lease row per claim (inserted, ended by the reaper,
        # deleted later), the outbox rows written once each.
        "batch_rows_written_per_event": round(
            (batches["n_tup_ins"] + batches["n_tup_upd"] + batches["n_tup_del"]) / per, 4
        )
        if batches is not None
        else None,
    }


async def prefill(db_url: str, events: int, payload: int, keys: int) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        step = 100_000
        for start in range(0, events, step):
            await conn.execute(PREFILL, DESTINATION, min(step, events - start), keys, payload - 2)
        await conn.execute(VACUUM_ANALYZE)
    finally:
        await conn.close()


async def machine(db_url: str) -> dict[str, Any]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        pg = await conn.fetchval(SERVER_VERSION)
    finally:
        await conn.close()
    return {
        "cores": os.cpu_count(),
        "postgresql": pg,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }


def machine_cpu() -> float | None:
    """CPU seconds every process on this host has used since boot (Linux's /proc/stat), to
    show what the database and broker cost beside the relay; None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait are busy.
    busy = sum(int(v) for i, v in enumerate(fields[:8]) if i not in (3, 4))
    return busy / os.sysconf("SC_CLK_TCK")


def per_event_us(seconds: float | None, events: int) -> float | None:
    return None if seconds is None else round(seconds / max(events, 1) * 1e6, 1)


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def percentile(values: Sequence[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.4f}" if abs(v) < 1 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _rows(rows: list[dict[str, Any]], indent: str) -> list[str]:
    """A list of dicts as a table: a header of their keys, a line each, right-aligned."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cells = [keys] + [[_fmt(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
    return [
        indent + "  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells
    ]


def emit(results: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(results, indent=2, default=str))
        return
    m = results.get("machine", {})
    click.echo(
        f"machine: {m.get('cores')} cores, PostgreSQL {m.get('postgresql')}, "
        f"Python {m.get('python')}; sink: {results.get('sink')}"
    )
    for name, table in results.items():
        if name in ("machine", "sink") or not isinstance(table, dict):
            continue
        click.echo(f"\n{name}")
        width = max(len(k) for k in table)
        tables = []
        for k, v in table.items():
            if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
                tables.append((k, v))  # after the single figures, as a table of its own
                continue
            if isinstance(v, dict):
                shown = ", ".join(f"{a} {_fmt(b)}" for a, b in v.items())
            else:
                shown = _fmt(v)
            click.echo(f"  {k.ljust(width)}  {shown}")
        for k, rows in tables:
            click.echo(f"  {k}:")
            for line in _rows(rows, "    "):
                click.echo(line)
