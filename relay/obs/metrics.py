"""Prometheus metrics of one relay, in a registry of its own.

The hot path observes per batch: counts are gathered while the relay walks a batch's outcomes
anyway, then added with one call per destination and outcome. The commit-to-ack latency is
kept per row, but in a histogram of our own whose ``observe_many`` is a bisect and a list
increment per value (prometheus-client's Histogram takes a lock and scans its buckets per
observation). Everything runs on the relay's event loop, scrapes included, so nothing here
needs a lock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from relay.breaker import Breaker, State

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
    21600.0,
    86400.0,
)
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

# outbox_circuit_state values: closed 0, half-open 1, open 2 (alert on > 0).
CIRCUIT_VALUES = {State.CLOSED: 0.0, State.HALF_OPEN: 1.0, State.OPEN: 2.0}


class BatchHistogram(Collector):
    """A histogram fed many values at once, optionally split by one label."""

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], label: str | None = None
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = list(buckets)
        self.label = label
        # label value -> [bucket counts (last one is +Inf)], sum
        self._series: dict[str, tuple[list[int], list[float]]] = {}

    def _get(self, key: str) -> tuple[list[int], list[float]]:
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = ([0] * (len(self.bounds) + 1), [0.0])
        return s

    def observe_many(self, values: Iterable[float], key: str = "") -> None:
        counts, total = self._get(key)
        bounds = self.bounds
        acc = 0.0
        for v in values:
            counts[bisect.bisect_left(bounds, v)] += 1
            acc += v
        total[0] += acc

    def observe(self, value: float, key: str = "") -> None:
        counts, total = self._get(key)
        counts[bisect.bisect_left(self.bounds, value)] += 1
        total[0] += value

    def count(self, key: str = "") -> int:
        s = self._series.get(key)
        return sum(s[0]) if s else 0

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(
            self.name, self.documentation, labels=[self.label] if self.label else None
        )

    def collect(self) -> Iterator[Metric]:
        fam = self._family()
        for key, (counts, total) in sorted(self._series.items()):
            cumulative, buckets = 0, []
            for bound, n in zip([*self.bounds, math.inf], counts, strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == math.inf else _fmt(bound), cumulative))
            fam.add_metric([key] if self.label else [], buckets, total[0])
        yield fam


def _fmt(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else repr(float(bound))


class CircuitCollector(Collector):
    """``outbox_circuit_state{sink, endpoint}``, read from the sinks' breakers at scrape time."""

    def __init__(self, source: Callable[[], Iterable[tuple[str, str, Breaker]]]) -> None:
        self.source = source

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "outbox_circuit_state",
            "Circuit breaker per sink endpoint: 0 closed, 1 half-open (probing), 2 open",
            labels=["sink", "endpoint"],
        )

    def collect(self) -> Iterator[Metric]:
        fam = self._family()
        for sink, endpoint, breaker in self.source():
            fam.add_metric([sink, endpoint], CIRCUIT_VALUES[breaker.state])
        yield fam


class Metrics:
    """Every series the relay exports (see docs/operations.md)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        # Registered in the order /metrics lists them.
        self.up = Gauge("outbox_relay_up", "1 while this relay runs", registry=r)
        self._delivery_counters(r)
        self._fault_counters(r)
        self._endpoint_counters(r)
        self.retention_deleted = Counter(
            "outbox_retention_deleted_rows",
            "Delivered rows deleted by retention (by this relay)",
            registry=r,
        )
        self._gauges(r)
        self._histograms(r)

    def _delivery_counters(self, r: CollectorRegistry) -> None:
        self.delivered = Counter(
            "outbox_events_delivered", "Events delivered", ["destination"], registry=r
        )
        self.failed = Counter(
            "outbox_events_failed", "Events marked failed (dead)", ["destination"], registry=r
        )
        self.retried = Counter(
            "outbox_events_retried",
            "Failed attempts scheduled for another try",
            ["destination"],
            registry=r,
        )
        self.attempts = Counter(
            "outbox_delivery_attempts",
            "Delivery attempts by outcome (delivered, retry, failed, deferred) and, for "
            "webhooks, HTTP status class (2xx, 4xx, 5xx; 'none' without a response)",
            ["destination", "outcome", "status_class"],
            registry=r,
        )

    def _fault_counters(self, r: CollectorRegistry) -> None:
        self.reaped = Counter(
            "outbox_leases_expired", "Rows taken back from relays that stopped", registry=r
        )
        self.leases_lost = Counter(
            "outbox_leases_lost",
            "Rows this relay found it no longer held (it stalled past the lease): not sent or "
            "not recorded by it; source: events, or a sink's own rows (deliveries)",
            ["source"],
            registry=r,
        )
        self.delivery_errors = Counter(
            "outbox_delivery_errors",
            "Deliveries that raised unexpectedly (a bug); their rows were retried",
            registry=r,
        )

    def _endpoint_counters(self, r: CollectorRegistry) -> None:
        self._endpoint_attempt_series: dict[tuple[str, str, str], Counter] = {}
        self.endpoint_attempts = Counter(
            "outbox_endpoint_delivery_attempts",
            "Attempts to deliver events to endpoints registered at runtime (kind = endpoints) "
            "by outcome and HTTP status class",
            ["destination", "outcome", "status_class"],
            registry=r,
        )
        self.endpoints_disabled = Counter(
            "outbox_endpoints_disabled",
            "Endpoints this relay disabled (410 Gone, or failing for disable_after)",
            ["destination"],
            registry=r,
        )

    def _histograms(self, r: CollectorRegistry) -> None:
        self.batch_size = BatchHistogram("outbox_claim_batch_size", "Rows per claim", BATCH_BUCKETS)
        self.latency = BatchHistogram(
            "outbox_commit_to_ack_seconds",
            "Seconds from the row's created_at to the sink's acknowledgement",
            LATENCY_BUCKETS,
            label="destination",
        )
        r.register(self.batch_size)
        r.register(self.latency)

    def _gauges(self, r: CollectorRegistry) -> None:
        self.pending = Gauge(
            "outbox_pending_rows",
            "Pending rows per destination, cluster-wide (refreshed every stats_interval)",
            ["destination"],
            registry=r,
        )
        self.oldest_pending = Gauge(
            "outbox_oldest_pending_age_seconds",
            "Age of the oldest pending row per destination, cluster-wide",
            ["destination"],
            registry=r,
        )
        self.in_flight = Gauge(
            "outbox_in_flight_rows",
            "Rows claimed by this relay and not yet recorded; source: events, or a sink's own "
            "rows (deliveries)",
            ["source"],
            registry=r,
        )
        self.paused = Gauge(
            "outbox_destination_paused",
            "1 while a destination is paused (outbox-relay pause)",
            ["destination"],
            registry=r,
        )
        self.oldest_snapshot = Gauge(
            "outbox_oldest_snapshot_age_seconds",
            "How long the oldest snapshot or transaction holding back VACUUM of this database "
            "has been held; 0 when none (see outbox_oldest_snapshot_xid_age)",
            registry=r,
        )
        self.oldest_snapshot_xids = Gauge(
            "outbox_oldest_snapshot_xid_age",
            "Transactions since the xid the oldest holder of VACUUM's horizon keeps; 0 when none",
            registry=r,
        )
        self.blocked_keys = Gauge(
            "outbox_blocked_keys",
            "Keys of ordered destinations held by a failed row (poison_policy = block)",
            ["destination"],
            registry=r,
        )

    def endpoint_attempt(self, destination: str, outcome: str, status_class: str) -> None:
        """Count one attempt in endpoint_attempts. Each series is looked up once: labels()
        costs a few microseconds, and this is every delivery's."""
        key = (destination, outcome, status_class)
        series = self._endpoint_attempt_series.get(key)
        if series is None:
            series = self._endpoint_attempt_series[key] = self.endpoint_attempts.labels(*key)
        series.inc()

    def watch_circuits(self, source: Callable[[], Iterable[tuple[str, str, Breaker]]]) -> None:
        self.registry.register(CircuitCollector(source))

    def set_pending(
        self, destinations: Iterable[str], rows: Mapping[str, tuple[int, float]]
    ) -> None:
        """Replace the pending gauges: every known destination gets a value (0 if none)."""
        self.pending.clear()
        self.oldest_pending.clear()
        for d in {*destinations, *rows}:
            n, age = rows.get(d, (0, 0.0))
            self.pending.labels(d).set(n)
            self.oldest_pending.labels(d).set(max(0.0, age))

    def set_paused(self, destinations: Iterable[str], paused: Iterable[str]) -> None:
        self.paused.clear()
        stopped = set(paused)
        for d in {*destinations, *stopped}:
            self.paused.labels(d).set(1 if d in stopped else 0)
