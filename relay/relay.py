"""The relay process: claim, deliver outside any transaction, record, and keep leases alive.

Stages overlap: while one batch is being delivered the next is claimed, up to
``max_in_flight`` rows held at once, and outcomes are written by the completer in the
background. Side tasks (listener, heartbeat, reaper, reporter, completer) are supervised: if
one dies the relay stops with a non-zero status rather than running half-alive.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import asyncpg
import structlog

from outbox.migrate import not_utf8
from relay import backoff, outcomes, tracing
from relay.breaker import Breaker
from relay.completer import Completer
from relay.config import Settings, package_version
from relay.errors import describe
from relay.httpserver import HttpServer, HttpStartupError, build_app
from relay.listener import Listener
from relay.metrics import Metrics
from relay.model import Envelope, Outcome, Result, header_problem
from relay.sinks import Sink
from relay.sinks.factory import build_sinks
from relay.store import (
    DB_ERRORS,
    UNAVAILABLE,
    Record,
    Store,
    create_pool,
    is_plain_sql_error,
)

log = structlog.get_logger("relay")

# A destination counts as served by another relay if one that serves it was seen this
# recently (rolling restarts included): unknown_destinations = "fail" spares its rows.
SERVED_WITHIN = 600.0
# Registrations of relays not seen for this long are deleted.
FORGET_RELAYS_AFTER = 7 * 86400.0
# Retry delay for rows whose delivery raised (when the backoff itself is what raised).
CRASH_RETRY_DELAY = 5.0
# Bound on each statement of the shutdown after the drain: a database that hangs must not
# hang the process (the reaper takes back whatever could not be released).
LAST_WRITE_TIMEOUT = 5.0
# All of the shutdown after the drain (outcomes, release, unregister, closing) fits in this.
FINAL_BUDGET = 10.0
# Rows the database refused to reap, even alone, are left out of reaping this long.
UNREAPABLE_FOR = 600.0
LOST_IDS_LOGGED = 20


class RelayStartupError(Exception):
    """The relay cannot start; the message says what to do."""


class Relay:
    def __init__(
        self,
        settings: Settings,
        sinks: dict[str, Sink] | None = None,
        *,
        relay_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.id = relay_id or settings.relay_id()
        self.sinks = sinks if sinks is not None else build_sinks(settings)
        self.stats: Counter[str] = Counter()
        self.started = asyncio.Event()  # for tests and probes: set once claiming has begun
        self._in_flight: dict[int, Envelope] = {}
        # Rows whose outcome is with the completer: id -> (token, when handed over).
        self._handed: dict[int, tuple[int, float]] = {}
        self._wake = asyncio.Event()
        self._capacity = asyncio.Event()
        self._stopping = asyncio.Event()
        self._deliveries: set[asyncio.Task[None]] = set()
        self._store: Store | None = None
        self._pool: asyncpg.Pool | None = None
        self._completer: Completer | None = None
        self._listener: Listener | None = None
        self._db_down = False
        self._claim_error: str | None = None
        self._scan_progressed = False
        # Per ordered destination: the key after which the next claim continues its walk.
        self._cursors: dict[str, str | None] = {}
        self._turn = 0  # rotates which destination claims first
        self._unreapable: dict[int, float] = {}  # row id -> until when it is left alone
        self._started_at = time.monotonic()
        self.paused: frozenset[str] = frozenset()
        self.paused_refreshes = 0  # for tests: how often the paused set was read
        self.metrics = Metrics()
        self.metrics.in_flight.set_function(lambda: len(self._in_flight))
        self.metrics.watch_circuits(self._circuits)
        self.http: HttpServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- public -------------------------------------------------------------------------

    def stop(self, reason: str = "stop") -> None:
        """Begin a graceful shutdown (safe to call from a signal handler)."""
        if not self._stopping.is_set():
            log.info(
                "relay.stopping", relay_id=self.id, in_flight=len(self._in_flight), reason=reason
            )
        self._stopping.set()

    def wake(self) -> None:
        self._wake.set()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def store(self) -> Store:
        assert self._store is not None, "relay not started"
        return self._store

    async def run(self) -> int:
        """Run until :meth:`stop`; returns the process exit status."""
        await self._start()
        assert self._completer is not None and self._listener is not None
        rs = self.settings.relay
        background = {
            asyncio.create_task(self._completer.run(), name="completer"),
            asyncio.create_task(self._listener.run(), name="listener"),
            asyncio.create_task(self._every(rs.lease / 3, self._heartbeat), name="heartbeat"),
            asyncio.create_task(
                self._every(min(rs.lease / 3, 10.0), self._register, first=min(rs.lease / 3, 10.0)),
                name="registry",
            ),
            # Every poll interval (at most lease / 2): a dead relay's rows are claimable again
            # within one lease and one poll interval. The query reads only the small partial
            # index of running rows, so running it this often is cheap.
            asyncio.create_task(
                self._every(min(rs.poll_interval, max(rs.lease / 2, 0.5)), self._reap),
                name="reaper",
            ),
            asyncio.create_task(self._every(rs.report_interval, self._report), name="reporter"),
            asyncio.create_task(self._every(10.0, self._progress, first=10.0), name="progress"),
            asyncio.create_task(
                self._every(rs.poll_interval, self._refresh_paused, first=rs.poll_interval),
                name="pauses",
            ),
            asyncio.create_task(self._every(rs.stats_interval, self._stats), name="stats"),
            asyncio.create_task(
                self._every(rs.retention_interval, self._retain, first=min(5.0, rs.poll_interval)),
                name="retention",
            ),
        }
        # The listener is supervised like the rest, but stopped last (probes answer "not
        # ready" while the relay drains), by _shutdown.
        http_task = {self.http.task} if self.http is not None and self.http.task else set()
        claimer = asyncio.create_task(self._claim_loop(), name="claimer")
        stop_wait = asyncio.create_task(self._stopping.wait())
        self._tasks = {*background, *http_task, claimer}
        self.metrics.up.set(1)
        self._started_at = time.monotonic()
        self.started.set()
        log.info(
            "relay.started",
            relay_id=self.id,
            destinations=sorted(self.sinks),
            batch_size=rs.batch_size,
            max_in_flight=rs.max_in_flight,
            lease_s=rs.lease,
            retention_s=rs.retention,
            paused=sorted(self.paused),
            http_port=self.http.port if self.http else None,
        )
        done, _ = await asyncio.wait({*self._tasks, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        status = 0
        for task in done - {stop_wait}:
            if (
                task is claimer
                and self._stopping.is_set()
                and not task.cancelled()
                and task.exception() is None
            ):
                continue  # it saw the stop request first: a normal exit
            status = 1
            exc = task.exception() if not task.cancelled() else None
            log.error(
                "relay.task.crashed",
                task=task.get_name(),
                error=describe(exc) if exc else "exited",
                exc_info=exc,
            )
        self._stopping.set()
        await self._shutdown(claimer, background)
        stop_wait.cancel()
        log.info("relay.stopped", relay_id=self.id, status=status, **dict(self.stats))
        return status

    # --- start-up -----------------------------------------------------------------------

    async def _start(self) -> None:
        rs = self.settings.relay
        if not self.sinks:
            raise RelayStartupError(
                "no destinations configured: add a [destinations.NAME] table to the config "
                '(kind = "kafka" with a topic, or kind = "webhook" with a url)'
            )
        deadline = time.monotonic() + rs.startup_timeout
        delay = 0.5
        while True:
            try:
                await self._connect()
                break
            except DB_ERRORS as exc:
                if self._pool is not None:
                    await self._pool.close()
                    self._pool = None
                if isinstance(exc, REFUSED_AT_STARTUP):
                    # The server answered, and said no: waiting will not change it.
                    raise RelayStartupError(_refused_at_startup(exc)) from exc
                if time.monotonic() + delay > deadline:
                    if isinstance(exc, asyncpg.PostgresError) and is_plain_sql_error(exc):
                        raise RelayStartupError(
                            f"{_refused_at_startup(exc)} (still so after {rs.startup_timeout:.0f}s)"
                        ) from exc
                    raise RelayStartupError(
                        f"cannot reach the database after {rs.startup_timeout:.0f}s: "
                        f"{describe(exc)}. Check database_url / "
                        "OUTBOX_DATABASE_URL and that PostgreSQL is up."
                    ) from exc
                log.warning(
                    "relay.database.unavailable",
                    error=describe(exc),
                    retry_in=round(delay, 1),
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
        if self.settings.http.enabled:
            self.http = HttpServer(
                self.settings.http, build_app(self.metrics.registry, self.health, self.readiness)
            )
            try:
                await self.http.start()
            except HttpStartupError as exc:
                await self.store.pool.close()
                raise RelayStartupError(str(exc)) from exc
        self._completer = Completer(self.store, self._on_recorded)
        self._listener = Listener(
            self.settings.dsn, self.store.channel, self.wake, f"outbox-relay-listen:{self.id}"
        )
        for sink in {id(s): s for s in self.sinks.values()}.values():
            await sink.start()

    async def _connect(self) -> None:
        """Open the pool, check the tables, read the paused destinations and register: all
        before the first claim, so a relay that starts while a destination is paused never
        claims it, and other relays know what this one serves."""
        rs = self.settings.relay
        self._pool = await create_pool(
            self.settings.dsn, self.id, rs.pool_size, command_timeout=max(2 * rs.lease, 60.0)
        )
        self._store = Store(
            self._pool, rs.db_schema, self.id, rs.lease, delete_delivered=rs.retention == 0
        )
        encoding = await self._store.server_encoding()
        if encoding != "UTF8":
            await self._pool.close()
            raise RelayStartupError(not_utf8(encoding))
        missing = await self._store.missing_tables()
        if missing:
            await self._pool.close()
            raise RelayStartupError(
                f"the outbox tables in schema {rs.db_schema!r} are missing or not up to date "
                f"(no {', '.join(missing)}): run `outbox-relay migrate` first"
            )
        await self._refresh_paused()
        await self._register()

    # --- the claim loop -----------------------------------------------------------------

    async def _wait(self, event: asyncio.Event | None, timeout: float | None) -> None:
        """Sleep until ``event``, a stop request, or ``timeout``; whichever comes first."""
        waits = [asyncio.ensure_future(self._stopping.wait())]
        if event is not None:
            waits.append(asyncio.ensure_future(event.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _claimable(self) -> list[str]:
        paused = self.paused
        return [
            name for name, sink in self.sinks.items() if name not in paused and sink.available(name)
        ]

    async def _claim_loop(self) -> None:
        rs = self.settings.relay
        retry = 0.1
        while not self._stopping.is_set():
            free = rs.max_in_flight - len(self._in_flight)
            if free <= 0:
                self._capacity.clear()
                await self._wait(self._capacity, None)
                continue
            destinations = self._claimable()
            if not destinations:
                await self._wait(self._wake, rs.poll_interval)
                continue
            limit = min(rs.batch_size, free)
            # Cleared before the claim: a NOTIFY that lands while it runs triggers another.
            self._wake.clear()
            batch, error = await self._claim(destinations, limit)
            if batch:
                # Claimed and committed: these rows are delivered even when a later
                # destination's claim failed, never left to wait for their lease.
                self._dispatch(batch)
                # Let the deliveries start, so a sink that is now full says so (available())
                # before the next claim: claims follow the sinks' free capacity.
                await asyncio.sleep(0)
            if error is not None:
                if isinstance(error, DB_ERRORS):
                    self._database_down(error, retry)
                else:
                    # A bug, or a row nothing expected: the rows it claimed (if any) go back
                    # after their lease; the relay keeps serving the rest, loudly.
                    log.error("relay.claim.crashed", error=describe(error), exc_info=error)
                    self.metrics.delivery_errors.inc()
                await self._wait(None, retry)
                retry = min(retry * 2, 5.0)
                continue
            retry = 0.1
            self._database_up()
            if len(batch) < limit and not self._scan_progressed:
                await self._wait(self._wake, rs.poll_interval * random.uniform(0.8, 1.2))

    async def _claim(
        self, destinations: list[str], limit: int
    ) -> tuple[list[Envelope], BaseException | None]:
        """One claim per destination, in an order that rotates from claim to claim, until the
        batch is full: a destination with a full batch always waiting cannot starve the
        others, and each claim reads only its own destination's part of the index.

        Returns what was claimed and the error that stopped it, if one did: rows already
        claimed for earlier destinations are committed and must still be delivered."""
        self._turn += 1
        start = self._turn % len(destinations)
        batch: list[Envelope] = []
        self._scan_progressed = False
        for dest in destinations[start:] + destinations[:start]:
            if len(batch) >= limit:
                self._scan_progressed = True  # the others' turn comes at once
                break
            try:
                batch += await self._claim_one(dest, limit - len(batch))
            except Exception as exc:
                return batch, exc
        return batch, None

    async def _claim_one(self, dest: str, limit: int) -> list[Envelope]:
        if not self.settings.ordered(dest):
            return await self.store.claim(dest, limit)
        rows, nxt = await self.store.claim_ordered(
            dest,
            limit,
            self.settings.parks_poison(dest),
            limit * 4,
            self._cursors.get(dest),
        )
        self._cursors[dest] = nxt
        # A cursor means the walk stopped before the last key: claim again at once.
        self._scan_progressed |= nxt is not None
        return rows

    def _database_down(self, exc: BaseException, retry_in: float) -> None:
        self._claim_error = describe(exc)
        if not self._db_down:
            self._db_down = True
            log.error(
                "relay.database.unavailable",
                error=describe(exc),
                retry_in=round(retry_in, 1),
                action="reconnecting with backoff; claimed rows stay leased",
            )

    def _database_up(self) -> None:
        self._claim_error = None
        if self._db_down:
            self._db_down = False
            log.info("relay.database.recovered")

    def _dispatch(self, batch: list[Envelope]) -> None:
        for env in batch:
            earlier = self._in_flight.get(env.id)
            if earlier is not None:
                # This relay claimed the row again: its earlier claim expired (a stall longer
                # than the lease) and was reaped. That claim can no longer record anything.
                self._lose([earlier], "claimed again after the lease expired")
            self._in_flight[env.id] = env
        self.stats["claimed"] += len(batch)
        self.metrics.batch_size.observe(len(batch))
        log.debug(
            "relay.batch.claimed", count=len(batch), first_id=batch[0].id, last_id=batch[-1].id
        )
        # One delivery per destination, recorded as soon as it is done: a slow endpoint holds
        # only its own rows, never the outcomes of another destination.
        groups: dict[str, tuple[Sink, list[Envelope]]] = {}
        for env in batch:
            groups.setdefault(env.destination, (self.sinks[env.destination], []))[1].append(env)
        for sink, envs in groups.values():
            task = asyncio.create_task(self._deliver(sink, envs))
            self._deliveries.add(task)
            task.add_done_callback(self._deliveries.discard)

    # --- delivering ---------------------------------------------------------------------

    async def _deliver(self, sink: Sink, envs: list[Envelope]) -> None:
        """Deliver one destination's rows and hand their outcomes to the completer, whatever
        raises on the way: every claimed row ends recorded, back in pending, or (if even that
        cannot be written) dropped from this relay's leases so the reaper takes it back."""
        try:
            records = await self._attempt(sink, envs)
        except Exception as exc:
            records = self._crashed(envs, exc)
        await self._hand_off(records, envs)

    async def _attempt(self, sink: Sink, envs: list[Envelope]) -> list[Record]:
        """Send one destination's rows; their records. The records are complete before any
        logging or metrics, whose failure cannot turn a delivered row into a retry."""
        started = time.monotonic()
        outcome_of: dict[int, Outcome] = {}
        sendable = self._sendable(envs, outcome_of)
        spans = tracing.start_delivery_spans(sendable, _sink_kind(sink))
        if sendable:
            try:
                for o in await sink.deliver(sendable):
                    outcome_of.setdefault(o.id, o)
            except Exception as exc:
                log.exception("relay.sink.error", count=len(sendable), ids=_ids(sendable))
                error = f"sink error: {describe(exc)}"
                for e in sendable:
                    outcome_of.setdefault(e.id, Outcome.retry(e.id, error))
        records, tally, latencies = self._records(envs, outcome_of)
        try:
            tracing.end_delivery_spans(spans, outcome_of)
            self._report_group(envs, records, tally, latencies, started)
        except Exception as exc:
            log.error("relay.delivery.report_failed", ids=_ids(envs), error=describe(exc))
        return records

    def _sendable(self, envs: list[Envelope], outcome_of: dict[int, Outcome]) -> list[Envelope]:
        """The rows to send; the others get their outcome in ``outcome_of`` at once."""
        now = time.monotonic()
        sendable = []
        for env in envs:
            if now >= env.lease.until or env.id in env.lease.lost:
                # The lease ran out (a stall) before the row was sent: another relay may
                # hold it by now.
                outcome_of[env.id] = Outcome.not_held(env.id)
            elif env.headers and (problem := header_problem(env.headers)) is not None:
                # Rows written around enqueue() (plain SQL) can carry headers no sink can
                # send; they fail alone, with the reason, instead of failing their batch.
                outcome_of[env.id] = Outcome.failed(env.id, problem)
            else:
                sendable.append(env)
        return sendable

    def _records(
        self, envs: list[Envelope], outcome_of: dict[int, Outcome]
    ) -> tuple[list[Record], Counter[tuple[str, str, str]], list[float]]:
        """The record of every row (one destination's), the outcomes tallied by (record
        status or "deferred", outcome, HTTP status class), and the delivered rows' latency."""
        dest = envs[0].destination
        max_attempts = self.settings.max_attempts(dest)
        policy = self.settings.backoff(dest)
        acked = time.time()
        records = []
        tally: Counter[tuple[str, str, str]] = Counter()
        latencies = []
        for env in envs:
            outcome = outcome_of.get(env.id) or Outcome.retry(env.id, "sink returned no outcome")
            if outcome.result is Result.DELIVERED and outcome.http_status is None:
                # The common case, kept short: most rows of most batches.
                records.append(Record(env.id, env.token, "delivered", 1, 0.0, None, dest, env.key))
                tally["delivered", "delivered", "none"] += 1
                latencies.append(acked - env.created_at.timestamp())
                continue
            rec = outcomes.to_record(env, outcome, max_attempts, policy)
            records.append(rec)
            kind = rec.status if outcome.result is not Result.DEFER else "deferred"
            code = outcome.http_status
            tally[kind, outcome.result.value, f"{code // 100}xx" if code else "none"] += 1
            if outcome.result is Result.DELIVERED:
                latencies.append(acked - env.created_at.timestamp())
        return records, tally, latencies

    def _report_group(
        self,
        envs: list[Envelope],
        records: list[Record],
        tally: Counter[tuple[str, str, str]],
        latencies: list[float],
        started: float,
    ) -> None:
        """Logs and metrics of one delivered group: a few calls per batch, not per row."""
        dest = envs[0].destination
        counts: Counter[str] = Counter()
        for (kind, _, _), n in tally.items():
            counts[kind] += n
        if counts["failed"]:
            for env, rec in zip(envs, records, strict=True):
                if rec.status == "failed":
                    log.error(
                        "relay.delivery.failed",
                        id=env.id,
                        destination=dest,
                        attempts=env.attempts + rec.counted,
                        error=rec.error,
                    )
        if counts["pending"]:
            sample = next((r.error for r in records if r.status == "pending" and r.counted), None)
            log.warning(
                "relay.delivery.retrying",
                count=counts["pending"],
                destinations=[dest],
                error=sample,
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
        self._observe(dest, tally, latencies)

    def _crashed(self, envs: list[Envelope], exc: BaseException) -> list[Record]:
        """Records for rows whose delivery raised: retried with the error, logged once."""
        error = describe(exc)
        log.error(
            "relay.delivery.crashed",
            count=len(envs),
            ids=_ids(envs),
            error=error,
            action="the rows are retried with this error as last_error; please report it",
            exc_info=exc,
        )
        self.metrics.delivery_errors.inc()
        records = []
        for env in envs:
            try:
                delay = backoff.delay(self.settings.backoff(env.destination), env.attempts + 1)
                delay = outcomes.clamp_delay(delay, CRASH_RETRY_DELAY)
            except Exception:
                delay = CRASH_RETRY_DELAY
            records.append(
                outcomes.crashed(env, error, self.settings.max_attempts(env.destination), delay)
            )
        return records

    async def _hand_off(self, records: list[Record], envs: list[Envelope]) -> None:
        """Give the records to the completer; if that fails, write them here; if that fails
        too, put the rows back to pending; failing that, stop renewing their leases."""
        now = time.monotonic()
        for env in envs:
            self._handed[env.id] = (env.token, now)
        try:
            assert self._completer is not None
            self._completer.add(records)
            return
        except Exception as exc:
            log.error("relay.record.handoff_failed", count=len(records), error=describe(exc))
        try:
            written = await self.store.record(records)
            self._on_recorded(records, written, set())
            return
        except Exception as exc:
            log.error("relay.record.direct_failed", count=len(records), error=describe(exc))
        leases = [(e.id, e.token) for e in envs]
        try:
            await self.store.release(leases)
        except Exception as exc:
            log.error(
                "relay.release.failed",
                count=len(envs),
                ids=_ids(envs),
                error=describe(exc),
                action="the reaper returns them to pending when their lease expires",
            )
        self._forget(envs)

    def _observe(
        self, dest: str, tally: Counter[tuple[str, str, str]], latencies: list[float]
    ) -> None:
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

    # --- recording and leases -----------------------------------------------------------

    def _on_recorded(
        self,
        records: Sequence[Record],
        written: set[tuple[int, int]],
        abandoned: set[tuple[int, int]],
    ) -> None:
        next_heads = False
        stale: list[int] = []
        for r in records:
            env = self._in_flight.get(r.id)
            if env is not None and env.token == r.token:
                del self._in_flight[r.id]
                self._handed.pop(r.id, None)
            if (r.id, r.token) in written:
                self.stats[r.status if r.counted else "deferred"] += 1
                # A finished head makes its key's next row the head: claim it now, not at
                # the next poll (nothing NOTIFYs for an update).
                next_heads |= r.status != "pending" and r.key is not None
            elif (r.id, r.token) not in abandoned:
                stale.append(r.id)
        if stale:
            self._lease_lost_log(stale, "outcome not recorded: the row is no longer this claim's")
        self._capacity.set()
        if next_heads and self._cursors:
            self.wake()

    def _lose(self, envs: Iterable[Envelope], why: str) -> None:
        """Rows this relay found it no longer holds: never sent from now on, never renewed."""
        lost = []
        for env in envs:
            env.lease.lost.add(env.id)
            if self._in_flight.get(env.id) is env:
                del self._in_flight[env.id]
                self._handed.pop(env.id, None)
            lost.append(env.id)
        if lost:
            self._lease_lost_log(lost, why)
            self._capacity.set()

    def _forget(self, envs: Iterable[Envelope]) -> None:
        """Stop renewing leases this relay cannot settle: the reaper takes the rows back."""
        for env in envs:
            if self._in_flight.get(env.id) is env:
                del self._in_flight[env.id]
        self._capacity.set()

    def _lease_lost_log(self, ids: list[int], why: str) -> None:
        self.metrics.leases_lost.inc(len(ids))
        self.stats["lease_lost"] += len(ids)
        log.warning(
            "relay.lease.lost",
            count=len(ids),
            ids=sorted(ids)[:LOST_IDS_LOGGED],
            reason=why,
            action="another claim of these rows delivers and records them; if this repeats, "
            "the relay stalls for longer than relay.lease (raise it, or look for pauses)",
        )

    # --- side tasks ---------------------------------------------------------------------

    async def _every(
        self, interval: float, job: Callable[[], Awaitable[Any]], first: float = 0.0
    ) -> None:
        await asyncio.sleep(first)
        while True:
            try:
                await job()
            except DB_ERRORS as exc:
                log.warning("relay.maintenance.failed", job=job.__name__, error=describe(exc))
            await asyncio.sleep(interval * random.uniform(0.9, 1.1))

    async def _heartbeat(self) -> None:
        started = time.monotonic()
        # A row whose outcome has waited to be written for this long is let go: the reaper
        # takes it back after its lease, instead of this relay renewing it for ever.
        stuck_since = started - max(10 * self.settings.relay.lease, 300.0)
        held = [
            (i, e.token)
            for i, e in self._in_flight.items()
            if (h := self._handed.get(i)) is None or h[0] != e.token or h[1] > stuck_since
        ]
        if not held:
            return
        alive = await self.store.heartbeat(held)
        until = started + self.settings.relay.lease
        lost = []
        for i, token in held:
            env = self._in_flight.get(i)
            if env is None or env.token != token:
                continue  # recorded (or claimed again) while the heartbeat ran
            if i in alive:
                env.lease.until = max(env.lease.until, until)
            elif self._handed.get(i, (None,))[0] != token:
                # Its outcome is not being written: the row was reaped, maybe claimed again.
                lost.append(env)
        if lost:
            self._lose(lost, "lease not renewed: the row was taken back after the lease expired")

    async def _register(self) -> None:
        """Tell the table this relay runs and what it serves (status, unknown destinations)."""
        await self.store.register(
            socket.gethostname(), os.getpid(), package_version(), sorted(self.sinks)
        )

    async def _reap(self) -> None:
        limits = {name: self.settings.max_attempts(name) for name in self.settings.destinations}
        now = time.monotonic()
        self._unreapable = {i: t for i, t in self._unreapable.items() if t > now}
        never = list(self._unreapable)
        try:
            rows = await self.store.reap(self.settings.relay.max_attempts, limits, never=never)
        except UNAVAILABLE:
            raise
        except DB_ERRORS as exc:
            rows = await self._reap_one_by_one(limits, never, exc)
        if rows:
            self.metrics.reaped.inc(len(rows))
            failed = [r["id"] for r in rows if r["status"] == "failed"]
            log.warning(
                "relay.lease.expired",
                count=len(rows),
                first_id=min(r["id"] for r in rows),
                last_id=max(r["id"] for r in rows),
                failed=len(failed),
                destinations=sorted({r["destination"] for r in rows}),
            )
            self.wake()

    async def _reap_one_by_one(
        self, limits: dict[str, int], never: list[int], error: BaseException
    ) -> list[asyncpg.Record]:
        """The database refused to reap the expired rows together: reap them one by one, and
        leave alone for a while those it refuses even alone (a trigger, a policy)."""
        reaped: list[asyncpg.Record] = []
        refused: list[int] = []
        for row_id in await self.store.expired(500, never):
            try:
                reaped += await self.store.reap(
                    self.settings.relay.max_attempts, limits, 1, only=[row_id], never=never
                )
            except UNAVAILABLE:
                raise
            except DB_ERRORS as exc:
                refused.append(row_id)
                error = exc
        if refused:
            until = time.monotonic() + UNREAPABLE_FOR
            self._unreapable.update(dict.fromkeys(refused, until))
            log.error(
                "relay.reap.refused",
                count=len(refused),
                ids=refused[:LOST_IDS_LOGGED],
                error=describe(error),
                action="the database refuses to put these rows back to pending (a trigger or a "
                "policy?); they stay running until it accepts",
            )
        return reaped

    async def _report(self) -> None:
        await self._report_blocked()
        # Destinations no relay serves: not this one's, and not one that any relay seen in
        # the last SERVED_WITHIN seconds serves (relays may split destinations between them).
        known = list(self.settings.destinations)
        rs = self.settings.relay
        # Not before this relay has watched the registry for unknown_grace itself: relays
        # that started with it (a new deployment) have registered by then.
        watched = time.monotonic() - self._started_at >= rs.unknown_grace
        if rs.unknown_destinations == "fail" and watched:
            failed = await self.store.fail_unknown_destinations(
                known, SERVED_WITHIN, self.settings.relay.unknown_grace
            )
            for dest, n in Counter(r["destination"] for r in failed).items():
                log.error(
                    "relay.destination.unknown",
                    destination=dest,
                    rows=n,
                    action="marked failed (no running relay serves it); add it to a relay "
                    "config, then outbox-relay retry",
                )
            return
        for r in await self.store.unknown_destinations(known, SERVED_WITHIN):
            log.warning(
                "relay.destination.unknown",
                destination=r["destination"],
                rows=r["rows"],
                oldest=r["oldest"].isoformat(),
                action=f"rows wait as pending; add [destinations.{r['destination']}] to the "
                "relay config of some relay",
            )

    async def _report_blocked(self) -> None:
        blocking = [
            d
            for d in self.settings.destinations
            if self.settings.ordered(d) and not self.settings.parks_poison(d)
        ]
        if not blocking:
            return
        rows = await self.store.blocked_keys(blocking)
        per: Counter[str] = Counter(r["destination"] for r in rows)
        for d in blocking:
            self.metrics.blocked_keys.labels(d).set(per.get(d, 0))
        for r in rows[:20]:
            log.warning(
                "relay.key.blocked",
                destination=r["destination"],
                key=r["key"],
                failed_id=r["failed_id"],
                waiting=r["waiting"],
                error=r["last_error"],
                action=f"outbox-relay retry --id {r['failed_id']} to deliver it again, or "
                f"outbox-relay skip {r['failed_id']} to let the key move on",
            )
        if len(rows) > 20:
            log.warning("relay.key.blocked.more", keys=len(rows) - 20)

    async def _refresh_paused(self) -> None:
        paused = frozenset(await self.store.paused())
        self.paused_refreshes += 1
        if paused != self.paused:
            resumed = self.paused - paused
            for d in sorted(paused - self.paused):
                log.warning("relay.destination.paused", destination=d)
            for d in sorted(resumed):
                log.info("relay.destination.resumed", destination=d)
            self.paused = paused
            if resumed:
                self.wake()
        self.metrics.set_paused(self.sinks, paused)

    async def _stats(self) -> None:
        rows = await self.store.pending_stats()
        if rows is not None:
            self.metrics.set_pending(self.sinks, rows)

    async def _retain(self) -> None:
        """Delete delivered and skipped rows past retention, a batch per transaction, while
        any are left; and registrations of relays long gone."""
        rs = self.settings.relay
        total = 0
        await self.store.forget_relays(FORGET_RELAYS_AFTER)
        while not self._stopping.is_set():
            n = await self.store.delete_finished(rs.retention, rs.retention_batch_size)
            if n is None:  # another relay is on it
                break
            total += n
            self.metrics.retention_deleted.inc(n)
            if n < rs.retention_batch_size:
                break
            await asyncio.sleep(0)  # let deliveries and probes run between batches
        if total:
            log.info("relay.retention.deleted", rows=total, retention_s=rs.retention)

    def _circuits(self) -> list[tuple[str, str, Breaker]]:
        found: list[tuple[str, str, Breaker]] = []
        for sink in {id(s): s for s in self.sinks.values()}.values():
            circuits = getattr(sink, "circuits", None)
            if callable(circuits):
                found.extend((_sink_kind(sink), ep, b) for ep, b in circuits().items())
        return found

    # --- probes -------------------------------------------------------------------------

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """Liveness: the process answers, and none of its supervised loops has ended."""
        dead = sorted(t.get_name() for t in self._tasks if t.done())
        if not self.started.is_set():
            return True, {"starting": True}
        return not dead, {"dead_tasks": dead} if dead else {}

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Readiness: started, not shutting down, database answering, sinks ready."""
        checks: dict[str, Any] = {}
        if self._store is None:
            return False, {"starting": True}
        ok = self.started.is_set() and not self._stopping.is_set()
        if self._stopping.is_set():
            checks["shutting_down"] = True
        try:
            await asyncio.wait_for(self.store.ping(), 2.0)
            checks["database"] = "ok"
        except DB_ERRORS as exc:
            ok = False
            checks["database"] = describe(exc)
        # Claims that fail (a read-only database answers SELECT 1 all the same): not ready.
        if self._claim_error is not None:
            ok = False
            checks["claiming"] = self._claim_error
        # Outcomes that cannot be written leave delivered rows to be sent again: not ready.
        completer = self._completer
        if completer is not None and completer.failing_since is not None:
            ok = False
            failing = time.monotonic() - completer.failing_since
            checks["recording"] = (
                f"failing for {failing:.0f} s ({completer.pending} outcomes kept): "
                f"{completer.last_error}"
            )
        else:
            checks["recording"] = "ok"
        sinks = {}
        for name, sink in self.sinks.items():
            ready = getattr(sink, "ready", None)
            sinks[name] = bool(ready()) if callable(ready) else sink.available(name)
        checks["sinks"] = sinks
        if sinks and not any(sinks.values()):
            ok = False
        checks["paused"] = sorted(self.paused)
        return ok, checks

    async def _progress(self) -> None:
        log.info("relay.progress", in_flight=len(self._in_flight), **dict(self.stats))

    # --- shutdown -----------------------------------------------------------------------

    async def _shutdown(
        self, claimer: asyncio.Task[None], background: set[asyncio.Task[Any]]
    ) -> None:
        rs = self.settings.relay
        loop = asyncio.get_running_loop()
        deadline = loop.time() + rs.shutdown_timeout
        # The claim loop is never cancelled mid-claim: rows it claims must reach _in_flight.
        try:
            await asyncio.wait_for(asyncio.shield(claimer), timeout=max(rs.shutdown_timeout, 1))
        except (TimeoutError, Exception):
            claimer.cancel()
        if self._deliveries:
            _, late = await asyncio.wait(
                set(self._deliveries), timeout=max(0.0, deadline - loop.time())
            )
            for t in late:
                t.cancel()
            if late:
                await asyncio.gather(*late, return_exceptions=True)
                log.warning("relay.shutdown.timeout", unfinished_batches=len(late))
        # After the drain, everything else shares FINAL_BUDGET: a database that hangs cannot
        # keep the process from exiting (the reaper takes back what was not released).
        last = max(deadline, loop.time()) + FINAL_BUDGET

        def left(at_most: float = FINAL_BUDGET) -> float:
            return max(0.5, min(at_most, last - loop.time()))

        # The write in progress finishes (cut short, its rows would be released and sent
        # again), then whatever is left is written, within the remaining time.
        if self._completer is not None and not await self._completer.close(
            timeout=max(deadline - loop.time(), left(FINAL_BUDGET / 2))
        ):
            log.error(
                "relay.shutdown.unrecorded",
                outcomes=self._completer.pending,
                action="their rows are released below, or reaped after their lease, and "
                "delivered again",
            )
        # Stopped before anything is released: a write that ran out of time must not race
        # the release of its rows.
        for t in background:
            if t.get_name() == "completer":
                t.cancel()
                await asyncio.wait({t}, timeout=left(1.0))
        await self._release_leftover(left(LAST_WRITE_TIMEOUT))
        try:
            async with asyncio.timeout(left(LAST_WRITE_TIMEOUT)):
                await self.store.unregister()
        except DB_ERRORS as exc:
            log.warning("relay.unregister.failed", error=describe(exc))
        for t in background:
            t.cancel()
        # A task in a statement on a hung connection cannot finish cancelling (its rollback
        # waits too) until the pool is terminated below.
        _, stuck = await asyncio.wait(background, timeout=left(LAST_WRITE_TIMEOUT))
        for sink in {id(s): s for s in self.sinks.values()}.values():
            try:
                await sink.close()
            except Exception:
                log.exception("relay.sink.close_failed")
        self.metrics.up.set(0)
        if self.http is not None:
            await self.http.stop()
        if self._pool is not None:
            try:
                await asyncio.wait_for(self._pool.close(), 0 if stuck else left(2.0))
            except TimeoutError:
                self._pool.terminate()  # a connection that hangs: do not wait for it
        if stuck:
            await asyncio.wait(stuck, timeout=left(2.0))

    async def _release_leftover(self, timeout: float) -> None:
        """Put the rows still held back to pending, unattempted: in one statement, or row by
        row if the database refuses the statement for one of them."""
        leftover = [(i, e.token) for i, e in self._in_flight.items()]
        if not leftover:
            return
        try:
            async with asyncio.timeout(timeout):
                await self.store.release(leftover)
            log.info("relay.released", count=len(leftover))
            return
        except UNAVAILABLE as exc:
            failed: list[tuple[int, int]] = leftover
            error = describe(exc)
        except DB_ERRORS:
            failed, error = [], ""
            for one in leftover:
                try:
                    async with asyncio.timeout(min(timeout, 1.0)):
                        await self.store.release([one])
                except DB_ERRORS as exc:
                    failed.append(one)
                    error = describe(exc)
            if len(failed) < len(leftover):
                log.info("relay.released", count=len(leftover) - len(failed))
        if failed:
            log.error(
                "relay.release.failed",
                count=len(failed),
                ids=[i for i, _ in failed[:LOST_IDS_LOGGED]],
                error=error,
                action="the reaper returns them to pending when their lease expires",
            )


# Answers to the start-up statements that waiting will not change. Anything else (the database
# starting up or shutting down, out of connections, unreachable) is waited out for
# relay.startup_timeout.
# (A read-only database is waited out: a failover makes one for a moment.)
REFUSED_AT_STARTUP: tuple[type[BaseException], ...] = (
    asyncpg.InsufficientPrivilegeError,
    asyncpg.QueryCanceledError,
    asyncpg.InvalidCatalogNameError,
    asyncpg.InvalidAuthorizationSpecificationError,
)


def _refused_at_startup(exc: BaseException) -> str:
    """What to tell an operator whose database refused the relay's start-up statements."""
    what = f"the database refused the relay's start-up statements: {describe(exc)}."
    if isinstance(exc, asyncpg.InsufficientPrivilegeError):
        return (
            f"{what} The relay's role needs SELECT on outbox_paused and SELECT, INSERT, UPDATE, "
            "DELETE on outbox and outbox_relays (run deploy/sql/relay_role.sql again after "
            "migrating)"
        )
    if isinstance(exc, asyncpg.QueryCanceledError):
        return (
            f"{what} A statement_timeout set for the relay's role or database is too short "
            "for them; raise it or unset it for the relay's role"
        )
    if isinstance(exc, asyncpg.LockNotAvailableError):
        return (
            f"{what} A lock_timeout set for the relay's role or database ran out: another "
            "session holds a lock on the outbox tables (see pg_locks), or the timeout is short"
        )
    if isinstance(exc, asyncpg.ReadOnlySQLTransactionError):
        return f"{what} The database (or the relay's role) is read-only; the relay must write"
    if isinstance(exc, asyncpg.InvalidCatalogNameError):
        return f"{what} The database in database_url does not exist"
    if isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError):
        return f"{what} Check the user and password in database_url"
    return f"{what} Check the database's logs and the relay's role"


def _ids(envs: Sequence[Envelope]) -> list[int]:
    """Row ids for a log line: all of a small batch, the first few of a large one."""
    return [e.id for e in envs[:LOST_IDS_LOGGED]]


def _sink_kind(sink: Sink) -> str:
    """ "kafka", "webhook", …: the sink class name without "Sink", lower-case."""
    return type(sink).__name__.removesuffix("Sink").lower() or "sink"
