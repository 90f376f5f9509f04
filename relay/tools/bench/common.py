"""What the benchmark scenarios share: scratch data, sinks, timing, reporting."""

from __future__ import annotations

import base64
import json
import os
import platform
import resource
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import click

from outbox.dburl import to_asyncpg_dsn
from relay.breaker import Breaker
from relay.model import Envelope, Outcome, Result
from relay.sinks import Sink
from relay.sinks.kafka.config import KafkaDestination, KafkaSettings
from relay.sinks.kafka.sink import KafkaSink
from relay.sinks.null import NullSink
from relay.sinks.webhook.config import WebhookClientSettings, WebhookDestination
from relay.sinks.webhook.sink import WebhookSink

DESTINATION = "bench"

PREFILL = """
INSERT INTO outbox (destination, key, payload, content_type)
SELECT $1, 'key-' || (i % $3), convert_to(rpad('{"i":' || i || ',"pad":"', $4, 'x') || '"}',
       'UTF8'), 'application/json'
FROM generate_series(1, $2) AS i
"""

FILL_HISTORY = """
INSERT INTO outbox (destination, key, payload, content_type, status, attempts, delivered_at)
SELECT $1, 'key-' || (i % 1000), convert_to(repeat('x', $3), 'UTF8'), 'application/json',
       'delivered', 1, now()
FROM generate_series(1, $2) AS i
"""


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
    """Wraps a sink and notes when each row was acknowledged (wall clock, for latency)."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.acked: dict[int, float] = {}

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

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
        outcomes = await self.inner.deliver(batch)
        now = time.time()
        for o in outcomes:
            if o.result is Result.DELIVERED:
                self.acked.setdefault(o.id, now)
        return outcomes


async def prefill(db_url: str, events: int, payload: int, keys: int) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        step = 100_000
        for start in range(0, events, step):
            await conn.execute(PREFILL, DESTINATION, min(step, events - start), keys, payload - 2)
        await conn.execute("VACUUM ANALYZE outbox")
    finally:
        await conn.close()


async def machine(db_url: str) -> dict[str, Any]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        pg = await conn.fetchval("SHOW server_version")
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
        for k, v in table.items():
            shown = _fmt(v)
            click.echo(f"  {k.ljust(width)}  {shown}")
