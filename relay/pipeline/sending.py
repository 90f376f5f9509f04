"""Sending: claimed rows handed to their sinks, outside any transaction, and their records
handed over.

One task per destination of a claimed batch: a slow endpoint holds only its own rows, never
the outcomes of another destination. Whatever raises on the way, every claimed row ends
recorded, back in pending, or (if even that cannot be written) no longer renewed, so that
the reaper takes it back: no row is ever stranded.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping

import structlog

from outbox.errors import describe
from outbox.status import Status
from relay import backoff, outcomes
from relay.db.store import Record, Store
from relay.model import MAX_EPOCH, MIN_EPOCH, Envelope, Outcome, Result, header_problem
from relay.obs import tracing
from relay.obs.metrics import Metrics
from relay.pipeline.completer import Completer
from relay.pipeline.leases import Leases, ids
from relay.pipeline.routes import Route

log = structlog.get_logger("relay")

# Retry delay for rows whose delivery raised (when the backoff itself is what raised).
CRASH_RETRY_DELAY = 5.0

# Outcomes of one group, by (record status or "deferred", outcome, HTTP status class).
Tally = Counter[tuple[str, str, str]]


class Sending:
    def __init__(
        self,
        routes: Mapping[str, Route],
        leases: Leases[Envelope],
        store: Store,
        completer: Completer,
        metrics: Metrics,
    ) -> None:
        self.routes = routes
        self.leases = leases
        self.store = store
        self.completer = completer
        self.metrics = metrics
        self.tasks: set[asyncio.Task[None]] = set()

    def halt(self) -> None:
        """A stop: nothing to do here. A destination's batch is its sink's to send whole
        (the stop waits for it, up to shutdown_timeout); the claimer claims nothing more."""

    def dispatch(self, batch: list[Envelope]) -> None:
        """Start delivering a claimed batch: one task per destination."""
        groups: dict[str, list[Envelope]] = {}
        for env in batch:
            groups.setdefault(env.destination, []).append(env)
        for dest, envs in groups.items():
            task = asyncio.create_task(self.deliver(self.routes[dest], envs))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def deliver(self, route: Route, envs: list[Envelope]) -> None:
        """Deliver one destination's rows and hand their outcomes to the completer."""
        try:
            records = await self._attempt(route, envs)
        except Exception as exc:
            records = self._crashed(route, envs, exc)
        await self._hand_off(records, envs)

    async def _attempt(self, route: Route, envs: list[Envelope]) -> list[Record]:
        """Send one destination's rows; their records. The records are complete before any
        logging or metrics, whose failure cannot turn a delivered row into a retry."""
        started = time.monotonic()
        outcome_of: dict[int, Outcome] = {}
        sendable = _sendable(envs, outcome_of)
        spans = tracing.start_delivery_spans(sendable, route.sink.kind)
        if sendable:
            try:
                for o in await route.sink.deliver(sendable):
                    outcome_of.setdefault(o.id, o)
            except Exception as exc:
                log.exception("relay.sink.error", count=len(sendable), ids=ids(sendable))
                error = f"sink error: {describe(exc)}"
                for e in sendable:
                    outcome_of.setdefault(e.id, Outcome.retry(e.id, error))
        records, tally, latencies = self._records(route, envs, outcome_of)
        try:
            tracing.end_delivery_spans(spans, outcome_of)
            _log_group(route.name, envs, records, tally, started)
            self._observe(route.name, tally, latencies)
        except Exception as exc:
            log.error("relay.delivery.report_failed", ids=ids(envs), error=describe(exc))
        return records

    def _records(
        self, route: Route, envs: list[Envelope], outcome_of: dict[int, Outcome]
    ) -> tuple[list[Record], Tally, list[float]]:
        """The record of every row, the outcomes tallied, and the delivered rows' latency."""
        dest = route.name
        acked = time.time()
        records = []
        tally: Tally = Counter()
        latencies = []
        plain = 0  # delivered, no answer class: most rows of most batches, kept short
        for env in envs:
            outcome = outcome_of.get(env.id) or Outcome.retry(env.id, "sink returned no outcome")
            if (
                outcome.result is Result.DELIVERED
                and outcome.status_class is None
                and outcome.error is None
            ):
                records.append(
                    Record(
                        env.id,
                        env.token,
                        Status.DELIVERED,
                        1,
                        0.0,
                        None,
                        dest,
                        env.key,
                        outcome.recorded,
                    )
                )
                plain += 1
                if MIN_EPOCH < env.created < MAX_EPOCH:  # not a time out of datetime's range
                    latencies.append(acked - env.created)
                continue
            rec = outcomes.to_record(env, outcome, route.max_attempts, route.backoff)
            records.append(rec)
            kind = rec.status if outcome.result is not Result.DEFER else "deferred"
            tally[kind, outcome.result.value, outcome.status_class or "none"] += 1
            if outcome.result is Result.DELIVERED and MIN_EPOCH < env.created < MAX_EPOCH:
                latencies.append(acked - env.created)
        if plain:
            tally["delivered", "delivered", "none"] += plain
        return records, tally, latencies

    def _crashed(self, route: Route, envs: list[Envelope], exc: BaseException) -> list[Record]:
        """Records for rows whose delivery raised: retried with the error, logged once."""
        error = describe(exc)
        log.error(
            "relay.delivery.crashed",
            count=len(envs),
            ids=ids(envs),
            error=error,
            action="the rows are retried with this error as last_error; please report it",
            exc_info=exc,
        )
        self.metrics.delivery_errors.inc()
        records = []
        for env in envs:
            try:
                delay = backoff.delay(route.backoff, env.attempts + 1)
                delay = outcomes.clamp_delay(delay, CRASH_RETRY_DELAY)
            except Exception:
                delay = CRASH_RETRY_DELAY
            records.append(outcomes.crashed(env, error, route.max_attempts, delay))
        return records

    async def _hand_off(self, records: list[Record], envs: list[Envelope]) -> None:
        """Give the records to the completer; if that fails, write them here; if that fails
        too, put the rows back to pending; failing that, stop renewing their leases."""
        self.leases.handed(envs)
        try:
            self.completer.add(records)
            return
        except Exception as exc:
            log.error("relay.record.handoff_failed", count=len(records), error=describe(exc))
        try:
            written = await self.store.record(records)
            self.completer.on_recorded(records, written, set())
            return
        except Exception as exc:
            log.error("relay.record.direct_failed", count=len(records), error=describe(exc))
        try:
            await self.store.release([(e.id, e.token) for e in envs])
        except Exception as exc:
            log.error(
                "relay.release.failed",
                count=len(envs),
                ids=ids(envs),
                error=describe(exc),
                action="the reaper returns them to pending when their lease expires",
            )
        self.leases.forget(envs)

    def _observe(self, dest: str, tally: Tally, latencies: list[float]) -> None:
        """Add one group's outcomes to the metrics."""
        m = self.metrics
        for (kind, result, code), n in tally.items():
            m.attempts.labels(dest, result, code).inc(n)
            if kind == "delivered":
                m.delivered.labels(dest).inc(n)
            elif kind == "failed":
                m.failed.labels(dest).inc(n)
            elif kind == "pending":
                m.retried.labels(dest).inc(n)
        if latencies:
            m.latency.observe_many(latencies, dest)


def _sendable(envs: list[Envelope], outcome_of: dict[int, Outcome]) -> list[Envelope]:
    """The rows to send; the others get their outcome in ``outcome_of`` at once."""
    sendable = []
    for env in envs:
        if not env.held():
            # The lease ran out (a stall) before the row was sent: another relay may hold
            # it by now.
            outcome_of[env.id] = Outcome.not_held(env.id)
        elif env.headers and (problem := header_problem(env.headers)) is not None:
            # Rows written around enqueue() (plain SQL) can carry headers no sink can send;
            # they fail alone, with the reason, instead of failing their batch.
            outcome_of[env.id] = Outcome.failed(env.id, problem)
        else:
            sendable.append(env)
    return sendable


def _log_group(
    dest: str, envs: list[Envelope], records: list[Record], tally: Tally, started: float
) -> None:
    """The log lines of one delivered group: a few per batch, not one per row."""
    counts: Counter[str] = Counter()
    for (kind, _, _), n in tally.items():
        counts[kind] += n
    if counts["failed"]:
        for env, rec in zip(envs, records, strict=True):
            if rec.status is Status.FAILED:
                log.error(
                    "relay.delivery.failed",
                    id=env.id,
                    destination=dest,
                    attempts=env.attempts + rec.counted,
                    error=rec.error,
                )
    if counts["pending"]:
        sample = next((r.error for r in records if r.status is Status.PENDING and r.counted), None)
        log.warning(
            "relay.delivery.retrying", count=counts["pending"], destinations=[dest], error=sample
        )
    log.debug(
        "relay.batch.delivered",
        count=len(envs),
        delivered=counts["delivered"],
        retrying=counts["pending"],
        failed=counts["failed"],
        deferred=counts["deferred"],
        duration_ms=round((time.monotonic() - started) * 1000, 1),
    )
