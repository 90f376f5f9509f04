"""The relay process: claim, deliver outside any transaction, record, and keep leases alive.

Stages overlap: while one batch is being delivered the next is claimed, up to
``max_in_flight`` rows held at once, and outcomes are written by the completer in the
background. Side tasks (listener, heartbeat, reaper, reporter, completer) are supervised: if
one dies the relay stops with a non-zero status rather than running half-alive.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg
import structlog

from relay import backoff, tracing
from relay.breaker import Breaker
from relay.completer import Completer
from relay.config import Settings
from relay.httpserver import HttpServer, HttpStartupError, build_app
from relay.listener import Listener
from relay.metrics import Metrics
from relay.model import Envelope, Outcome, Result, header_problem, truncate_error
from relay.sinks import Sink
from relay.sinks.factory import build_sinks
from relay.store import DB_ERRORS, Record, Store, create_pool

log = structlog.get_logger("relay")


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
        self._wake = asyncio.Event()
        self._capacity = asyncio.Event()
        self._stopping = asyncio.Event()
        self._deliveries: set[asyncio.Task[None]] = set()
        self._store: Store | None = None
        self._pool: asyncpg.Pool | None = None
        self._completer: Completer | None = None
        self._listener: Listener | None = None
        self._db_down = False
        self._scan_progressed = False
        # Per ordered destination: the key after which the next claim continues its walk.
        self._cursors: dict[str, str | None] = {}
        self._turn = 0  # rotates which destination claims first
        self.paused: frozenset[str] = frozenset()
        self.paused_refreshes = 0  # for tests: how often the paused set was read
        self.metrics = Metrics()
        self.metrics.in_flight.set_function(lambda: len(self._in_flight))
        self.metrics.watch_circuits(self._circuits)
        self.http: HttpServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- public -------------------------------------------------------------------------

    def stop(self) -> None:
        """Begin a graceful shutdown (safe to call from a signal handler)."""
        if not self._stopping.is_set():
            log.info("relay.stopping", relay_id=self.id, in_flight=len(self._in_flight))
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
                error=f"{type(exc).__name__}: {exc}" if exc else "exited",
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
                self._pool = await create_pool(self.settings.dsn, self.id, rs.pool_size)
                break
            except DB_ERRORS as exc:
                if time.monotonic() + delay > deadline:
                    raise RelayStartupError(
                        f"cannot reach the database after {rs.startup_timeout:.0f}s: "
                        f"{type(exc).__name__}: {exc}. Check database_url / "
                        "OUTBOX_DATABASE_URL and that PostgreSQL is up."
                    ) from exc
                log.warning(
                    "relay.database.unavailable",
                    error=f"{type(exc).__name__}: {exc}",
                    retry_in=round(delay, 1),
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
        self._store = Store(
            self._pool, rs.db_schema, self.id, rs.lease, delete_delivered=rs.retention == 0
        )
        if not await self._store.table_exists() or not await self._store.paused_table_exists():
            await self._pool.close()
            raise RelayStartupError(
                f"the outbox tables in schema {rs.db_schema!r} are missing or not up to date: "
                "run `outbox-relay migrate` first"
            )
        # Before the first claim: a relay that starts while a destination is paused never
        # claims it.
        try:
            await self._refresh_paused()
        except asyncpg.PostgresError as exc:
            await self._pool.close()
            raise RelayStartupError(
                f"cannot read the paused destinations: {type(exc).__name__}: {exc}. The relay's "
                "role needs SELECT on outbox_paused (see deploy/sql/relay_role.sql)"
            ) from exc
        if self.settings.http.enabled:
            self.http = HttpServer(
                self.settings.http, build_app(self.metrics.registry, self.health, self.readiness)
            )
            try:
                await self.http.start()
            except HttpStartupError as exc:
                await self._pool.close()
                raise RelayStartupError(str(exc)) from exc
        self._completer = Completer(self._store, self._on_recorded)
        self._listener = Listener(
            self.settings.dsn, self._store.channel, self.wake, f"outbox-relay-listen:{self.id}"
        )
        for sink in {id(s): s for s in self.sinks.values()}.values():
            await sink.start()

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
            try:
                batch = await self._claim(destinations, limit)
            except DB_ERRORS as exc:
                self._database_down(exc, retry)
                await self._wait(None, retry)
                retry = min(retry * 2, 5.0)
                continue
            retry = 0.1
            self._database_up()
            if batch:
                self._dispatch(batch)
                # Let the deliveries start, so a sink that is now full says so (available())
                # before the next claim: claims follow the sinks' free capacity.
                await asyncio.sleep(0)
            if len(batch) < limit and not self._scan_progressed:
                await self._wait(self._wake, rs.poll_interval * random.uniform(0.8, 1.2))

    async def _claim(self, destinations: list[str], limit: int) -> list[Envelope]:
        """One claim per destination, in an order that rotates from claim to claim, until the
        batch is full: a destination with a full batch always waiting cannot starve the
        others, and each claim reads only its own destination's part of the index."""
        self._turn += 1
        start = self._turn % len(destinations)
        batch: list[Envelope] = []
        self._scan_progressed = False
        for dest in destinations[start:] + destinations[:start]:
            if len(batch) >= limit:
                self._scan_progressed = True  # the others' turn comes at once
                break
            if not self.settings.ordered(dest):
                batch += await self.store.claim(dest, limit - len(batch))
                continue
            rows, nxt = await self.store.claim_ordered(
                dest,
                limit - len(batch),
                self.settings.parks_poison(dest),
                limit * 4,
                self._cursors.get(dest),
            )
            self._cursors[dest] = nxt
            # A cursor means the walk stopped before the last key: claim again at once.
            self._scan_progressed |= nxt is not None
            batch += rows
        return batch

    def _database_down(self, exc: BaseException, retry_in: float) -> None:
        if not self._db_down:
            self._db_down = True
            log.error(
                "relay.database.unavailable",
                error=f"{type(exc).__name__}: {exc}",
                retry_in=round(retry_in, 1),
                action="reconnecting with backoff; claimed rows stay leased",
            )

    def _database_up(self) -> None:
        if self._db_down:
            self._db_down = False
            log.info("relay.database.recovered")

    def _dispatch(self, batch: list[Envelope]) -> None:
        for env in batch:
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

    async def _deliver(self, sink: Sink, envs: list[Envelope]) -> None:
        started = time.monotonic()
        spans = tracing.start_delivery_spans(envs, _sink_kind(sink))
        # Rows written around enqueue() (plain SQL) can carry headers no sink can send; they
        # fail alone, with the reason, instead of failing the batch they came in.
        unsendable = [
            Outcome.failed(e.id, problem)
            for e in envs
            if (problem := header_problem(e.headers)) is not None
        ]
        sendable = [e for e in envs if header_problem(e.headers) is None] if unsendable else envs
        try:
            outcomes = unsendable + (await sink.deliver(sendable) if sendable else [])
        except Exception as exc:
            log.exception("relay.sink.error", count=len(envs))
            outcomes = unsendable + [
                Outcome.retry(e.id, f"sink error: {type(exc).__name__}: {exc}") for e in sendable
            ]
        acked = time.time()
        by_id = {o.id: o for o in outcomes}
        tracing.end_delivery_spans(spans, by_id)
        records = []
        counts: Counter[str] = Counter()
        # (destination, record status or "deferred", outcome, http status class) -> rows
        observed: Counter[tuple[str, str, str, str]] = Counter()
        latencies: dict[str, list[float]] = {}
        for env in envs:
            outcome = by_id.get(env.id) or Outcome.retry(env.id, "sink returned no outcome")
            rec = self._to_record(env, outcome)
            kind = rec.status if outcome.result is not Result.DEFER else "deferred"
            counts[kind] += 1
            code = outcome.http_status
            observed[
                env.destination, kind, outcome.result.value, f"{code // 100}xx" if code else "none"
            ] += 1
            if outcome.result is Result.DELIVERED:
                latencies.setdefault(env.destination, []).append(acked - env.created_at.timestamp())
            if rec.status == "failed":
                log.error(
                    "relay.delivery.failed",
                    id=env.id,
                    destination=env.destination,
                    attempts=env.attempts + rec.counted,
                    error=rec.error,
                )
            records.append(rec)
        if counts["pending"]:
            sample = next(o for o in outcomes if o.result is Result.RETRY)
            log.warning(
                "relay.delivery.retrying",
                count=counts["pending"],
                destinations=sorted({e.destination for e in envs}),
                error=sample.error,
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
        self._observe(observed, latencies)
        assert self._completer is not None
        self._completer.add(records)

    def _observe(
        self, observed: Counter[tuple[str, str, str, str]], latencies: dict[str, list[float]]
    ) -> None:
        """Add one batch's outcomes to the metrics: a few calls per batch, not per row."""
        m = self.metrics
        for (dest, kind, result, code), n in observed.items():
            m.attempts.labels(dest, result, code).inc(n)
            if kind == "delivered":
                m.delivered.labels(dest).inc(n)
            elif kind == "failed":
                m.failed.labels(dest).inc(n)
            elif kind == "pending":
                m.retried.labels(dest).inc(n)
        for dest, values in latencies.items():
            m.latency.observe_many(values, dest)

    def _to_record(self, env: Envelope, outcome: Outcome) -> Record:
        error = truncate_error(outcome.error) if outcome.error else None
        if outcome.result is Result.DELIVERED:
            return Record(env.id, "delivered", 1, 0.0, None, env.destination, env.key)
        if outcome.result is Result.FAILED:
            return Record(env.id, "failed", 1, 0.0, error, env.destination, env.key)
        if outcome.result is Result.DEFER:
            return Record(
                env.id,
                "pending",
                0,
                max(0.0, outcome.retry_in or 0.0),
                error,
                env.destination,
                env.key,
            )
        attempt = env.attempts + 1
        if attempt >= self.settings.max_attempts(env.destination):
            return Record(
                env.id,
                "failed",
                1,
                0.0,
                f"gave up after {attempt} attempts: {error}",
                env.destination,
                env.key,
            )
        wait = outcome.retry_in
        if wait is None:
            wait = backoff.delay(self.settings.backoff(env.destination), attempt)
        return Record(env.id, "pending", 1, wait, error, env.destination, env.key)

    def _on_recorded(self, records: Sequence[Record]) -> None:
        next_heads = False
        for r in records:
            self._in_flight.pop(r.id, None)
            self.stats[r.status if r.counted else "deferred"] += 1
            # A finished head makes its key's next row the head: claim it now, not at the
            # next poll (nothing NOTIFYs for an update).
            next_heads |= r.status != "pending" and r.key is not None
        self._capacity.set()
        if next_heads and self._cursors:
            self.wake()

    # --- side tasks ---------------------------------------------------------------------

    async def _every(
        self, interval: float, job: Callable[[], Awaitable[Any]], first: float = 0.0
    ) -> None:
        await asyncio.sleep(first)
        while True:
            try:
                await job()
            except DB_ERRORS as exc:
                log.warning(
                    "relay.maintenance.failed",
                    job=job.__name__,
                    error=f"{type(exc).__name__}: {exc}",
                )
            await asyncio.sleep(interval * random.uniform(0.9, 1.1))

    async def _heartbeat(self) -> None:
        ids = list(self._in_flight)
        if ids:
            await self.store.heartbeat(ids)

    async def _reap(self) -> None:
        limits = {name: self.settings.max_attempts(name) for name in self.settings.destinations}
        rows = await self.store.reap(self.settings.relay.max_attempts, limits)
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

    async def _report(self) -> None:
        await self._report_blocked()
        known = list(self.settings.destinations)
        if self.settings.relay.unknown_destinations == "fail":
            failed = await self.store.fail_unknown_destinations(known)
            for dest, n in Counter(r["destination"] for r in failed).items():
                log.error(
                    "relay.destination.unknown",
                    destination=dest,
                    rows=n,
                    action="marked failed; add it to the config, then outbox-relay retry",
                )
            return
        for r in await self.store.unknown_destinations(known):
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
        """Delete delivered rows past retention, a batch per transaction, while any are left."""
        rs = self.settings.relay
        total = 0
        while not self._stopping.is_set():
            n = await self.store.delete_delivered(rs.retention, rs.retention_batch_size)
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
            checks["database"] = f"{type(exc).__name__}: {exc}"
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
            await asyncio.wait_for(asyncio.shield(claimer), timeout=max(rs.shutdown_timeout, 5))
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
        completer_task = next((t for t in background if t.get_name() == "completer"), None)
        if completer_task is not None:
            completer_task.cancel()
        if self._completer is not None:
            await self._completer.drain(timeout=max(5.0, deadline - loop.time()))
        leftover = list(self._in_flight)
        if leftover:
            try:
                await self.store.release(leftover)
                log.info("relay.released", count=len(leftover))
            except DB_ERRORS as exc:
                log.error(
                    "relay.release.failed",
                    count=len(leftover),
                    error=f"{type(exc).__name__}: {exc}",
                    action="the reaper returns them to pending when their lease expires",
                )
        for t in background:
            t.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        for sink in {id(s): s for s in self.sinks.values()}.values():
            try:
                await sink.close()
            except Exception:
                log.exception("relay.sink.close_failed")
        self.metrics.up.set(0)
        if self.http is not None:
            await self.http.stop()
        if self._pool is not None:
            await self._pool.close()


def _sink_kind(sink: Sink) -> str:
    """ "kafka", "webhook", …: the sink class name without "Sink", lower-case."""
    return type(sink).__name__.removesuffix("Sink").lower() or "sink"
