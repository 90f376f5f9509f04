"""Delivering fanned-out events to their endpoints: claim, send, record, per endpoint.

Every (event, endpoint) pair is a row of outbox_deliveries with its own status, attempts,
backoff and lease, so a slow or dead endpoint holds only its own deliveries. The loop here
mirrors the relay's own for events, at a smaller scale: a claim statement that walks the
endpoints with due work (at most ``max_concurrency`` rows each, fewer under a rate limit),
one task per delivery under its endpoint's request slots and circuit, outcomes written in
batches together with the message log, a heartbeat for the leases, a reaper for the
deliveries of relays that died. Endpoints' settings come with each claimed row, so a change
made at runtime applies to the next claim (a NOTIFY wakes the loop at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

import structlog

from outbox.endpoint_secrets import SecretBox
from outbox.errors import OutboxError, describe
from outbox.status import Status
from outbox.webhooks.signing import decode_secret
from relay.breaker import Breaker, State
from relay.db.store import DB_ERRORS, UNAVAILABLE, Record
from relay.model import Envelope, Outcome, Result, epoch, header_problem, truncate_error
from relay.obs.metrics import Metrics
from relay.pipeline import outcomes
from relay.sinks.endpoints.config import EndpointsDestination
from relay.sinks.endpoints.fairness import Plan
from relay.sinks.endpoints.fairness import average as latency_average
from relay.sinks.endpoints.fairness import plan as fairness_plan
from relay.sinks.endpoints.state import NOT_TAKEN_LOG_EVERY, EndpointState
from relay.sinks.endpoints.store import Claimed, DeliveryRecord, DeliveryStore, takes
from relay.sinks.webhook.answers import class_of
from relay.sinks.webhook.config import WebhookClientSettings
from relay.sinks.webhook.sink import Target, WebhookSink

log = structlog.get_logger("relay.sink.endpoints")

RESPONSE_LOGGED = 1024  # bytes of each answer kept in the message log
# At least this long between attempts of a delivery whose endpoint cannot be used (its secret
# cannot be opened): each is logged, and the cause is an operator's to fix.
UNUSABLE_RETRY = 60.0
NOT_SENT = 2  # DeliveryRecord.counted of a try that sent nothing: logged, not an attempt
CRASH_RETRY = 5.0
HEALTH_REFRESH = 60.0  # last_success_at is rewritten at most this often while all is well
SCAN = 1000  # endpoints with pending deliveries examined per claim, at most
STATE_IDLE = 600.0  # an endpoint not claimed from for this long is forgotten
WAKE_COALESCE = 0.01  # seconds finished requests wait to be claimed for together


class Sender(WebhookSink):
    """The webhook sink's request path; each answer kept for the message log (on_answer)."""

    def __init__(self, http: WebhookClientSettings) -> None:  # no destination configured
        self.answers: dict[Envelope, tuple[int, bytes]] = {}
        super().__init__(http, {}, on_answer=self._keep)

    def _keep(self, env: Envelope, status: int, body: bytes, latency_ms: float) -> None:
        self.answers[env] = (status, body)


class Dispatcher:
    def __init__(
        self,
        sender: Sender,
        destinations: Mapping[str, EndpointsDestination],
        *,
        max_in_flight: int = 1000,
        poll_interval: float = 1.0,
        secret_box: SecretBox | None = None,
    ) -> None:
        self.sender = sender
        self.destinations = dict(destinations)
        self.max_in_flight = max_in_flight
        self.poll_interval = poll_interval
        self.secret_box = secret_box or SecretBox.from_environment()
        self.states: dict[int, EndpointState] = {}
        self.held: dict[int, Claimed] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.stats: Counter[str] = Counter()
        self.store: DeliveryStore | None = None
        self._wake = asyncio.Event()
        self._capacity = asyncio.Event()
        self._written = asyncio.Event()
        self._outcomes: list[DeliveryRecord] = []
        self._record_lock = asyncio.Lock()
        self._wake_pending: asyncio.TimerHandle | None = None
        self._claim_lock = asyncio.Lock()
        self.metrics: Metrics | None = None
        # Destinations an operator paused (outbox-relay pause): their deliveries wait too.
        self.paused: Callable[[], Collection[str]] = frozenset
        self.health_refresh = HEALTH_REFRESH
        self._health: dict[int, bool] = {}
        self._gone: set[int] = set()  # endpoints that answered 410 since the last write
        # Circuits that opened (seconds until their probe) or closed (None) since the last
        # write: the table shows them to `status`.
        self._circuits: dict[int, float | None] = {}
        self._cursor: int | None = None
        self.scan = SCAN
        self._draining = False
        self._limits = {name: d.max_attempts for name, d in self.destinations.items()}
        self._default_max = max(self._limits.values())

    def wake(self) -> None:
        self._wake.set()

    def _wake_soon(self) -> None:
        """Wake the claim loop shortly: requests finishing one by one are claimed for in one
        statement, not one claim each (a claim costs 1-3 ms of the server's time)."""
        if self._wake_pending is None:
            self._wake_pending = asyncio.get_running_loop().call_later(
                WAKE_COALESCE, self._woken_soon
            )

    def _woken_soon(self) -> None:
        self._wake_pending = None
        self._wake.set()

    # --- the loops ----------------------------------------------------------------------

    async def run(self, store: DeliveryStore, lease: float) -> None:
        """Claim, record, heartbeat and reap until cancelled; a crash of one ends all (the
        relay supervises this task and stops)."""
        self.store = store
        async with asyncio.TaskGroup() as group:
            group.create_task(self._claim_loop())
            group.create_task(self._record_loop())
            group.create_task(self._every(lease / 3, self._heartbeat, "heartbeat"))
            group.create_task(
                self._every(min(self.poll_interval, max(lease / 2, 0.5)), self._reap, "reaper")
            )

    async def _every(self, interval: float, job: object, name: str) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await job()  # type: ignore[operator]
            except DB_ERRORS as exc:
                log.warning("relay.endpoints.maintenance_failed", job=name, error=describe(exc))

    async def _claim_loop(self) -> None:
        assert self.store is not None
        while not self._draining:
            room = self.max_in_flight - len(self.held)
            if room <= 0:
                self._capacity.clear()
                await _wait(self._capacity, self.poll_interval)
                continue
            paused = self.paused()
            serving = [d for d in self.destinations if d not in paused]
            if not serving:  # every destination paused: nothing is sent
                self._wake.clear()
                await _wait(self._wake, self.poll_interval)
                continue
            share = self._plan()  # room is left: it allows at least one delivery
            skip = [s.id for s in self.states.values() if s.circuit_open or s.gone]
            skip.extend(share.skip_endpoints)
            self._wake.clear()
            # Held until the claimed rows have their tasks: a drain waits for it, so that no
            # row claimed while stopping is left unreleased.
            async with self._claim_lock:
                if self._draining:
                    return
                try:
                    claimed, self._cursor, orphans = await self.store.claim(
                        serving,
                        [self.destinations[d].max_concurrency for d in serving],
                        [self.destinations[d].slow_concurrency for d in serving],
                        share.limit,
                        skip,
                        self.scan,
                        self._cursor,
                        share.caps,
                        sorted(share.skip_tenants),
                    )
                except DB_ERRORS as exc:
                    log.warning("relay.endpoints.claim_failed", error=describe(exc))
                    claimed, orphans = [], 0
                    self._cursor = None
                if orphans:
                    log.warning(
                        "relay.endpoints.orphans_cancelled",
                        deliveries=orphans,
                        reason="their endpoint was deleted or moved to another destination",
                    )
                for c in claimed:
                    self._start(c)
            if claimed:
                self.stats["claimed"] += len(claimed)
                await asyncio.sleep(0)
            elif self._cursor is None:
                await _wait(self._wake, self.poll_interval)

    def _plan(self) -> Plan:
        """The next claim's fair share plan (fairness.py): from the endpoints this relay
        holds deliveries of, and those it knows to be slow."""
        now = time.monotonic()
        holdings = []
        for state in self.states.values():
            h = state.holding(now)
            if h.in_hand or h.known:
                holdings.append(h)
        return fairness_plan(self.max_in_flight, len(self.held), holdings)

    async def _record_loop(self) -> None:
        assert self.store is not None
        delay = 0.2
        while True:
            if not self._outcomes:
                self._written.clear()
                await _wait(self._written, self.poll_interval)
                continue
            async with self._record_lock:
                batch, self._outcomes = self._outcomes, []
                try:
                    written = await self.store.record(batch)
                except UNAVAILABLE as exc:
                    self._outcomes[:0] = batch  # kept, and written when the database is back
                    log.warning(
                        "relay.endpoints.record_failed", count=len(batch), error=describe(exc)
                    )
                    written = None
                except DB_ERRORS as exc:
                    # A value the database refuses: each delivery is left to its lease, and
                    # the reaper retries it (an attempt counted), rather than the batch looping.
                    log.error(
                        "relay.endpoints.record_refused",
                        count=len(batch),
                        ids=[r.id for r in batch[:20]],
                        error=describe(exc),
                    )
                    written = set()
            if written is None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            delay = 0.2
            for r in batch:
                self._release_hold(r)
                if r.id not in written:
                    self.stats["lost"] += 1
            self.stats["recorded"] += len(written)
            self._capacity.set()
            # The claim counts an endpoint's deliveries in flight from the table, across
            # relays: these no longer are.
            self._wake_soon()
            await self._write_health()

    def _release_hold(self, r: DeliveryRecord) -> None:
        """This outcome's claim is no longer held; a newer claim of the row (the relay claimed
        it again after its lease ran out) stays."""
        c = self.held.get(r.id)
        if c is not None and c.token == r.token:
            del self.held[r.id]

    async def _heartbeat(self) -> None:
        assert self.store is not None
        self._prune()
        held = [c for c in self.held.values() if c.lease.held(c.event_id)]
        if not held:
            return
        before = time.monotonic()
        kept = await self.store.heartbeat(held)
        for c in held:
            if c.id in kept:
                c.lease.until = before + self.store.store.lease
            else:
                c.lease.lost.add(c.event_id)

    def _prune(self) -> None:
        """Forget endpoints not claimed from for a while (deleted, disabled, idle): their
        circuits and keys are not kept for ever."""
        now = time.monotonic()
        for eid, state in list(self.states.items()):
            if not state.in_hand and now - state.last_claimed > STATE_IDLE:
                del self.states[eid]

    async def _reap(self) -> None:
        assert self.store is not None
        n = await self.store.reap(self._default_max, self._limits)
        if n:
            log.warning("relay.endpoints.reaped", deliveries=n)
            self.wake()

    def _start(self, c: Claimed) -> None:
        """Hold a claimed delivery and start its task; a row this code cannot even start
        (a bug) is recorded for a retry, never left running."""
        self.held[c.id] = c  # a newer claim of the same row replaces an older, stale one
        try:
            state = self._state(c)
        except Exception as exc:
            log.exception("relay.endpoints.delivery_crashed", delivery=c.id)
            self._outcomes.append(self._crashed(c, exc))
            self._written.set()
            return
        state.in_hand += 1
        state.last_claimed = time.monotonic()
        task = asyncio.create_task(self._deliver(c, state))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # --- one delivery -------------------------------------------------------------------

    def _state(self, c: Claimed) -> EndpointState:
        config = self.destinations[c.destination]
        state = self.states.get(c.endpoint_id)
        if state is None or state.config is not config:
            state = self.states[c.endpoint_id] = EndpointState(
                c.endpoint_id,
                c.destination,
                config,
                semaphore=asyncio.Semaphore(config.max_concurrency),
            )
        state.tenant, state.event_types = c.tenant, c.event_types
        version = (c.url, c.secret, c.previous_secret)
        if version != state.version:
            # New, or changed at runtime: the URL and keys of this claim apply from now on;
            # the circuit and request slots carry over.
            state.version = version
            try:
                keys = [decode_secret(self.secret_box.open(c.secret))]
                if c.previous_secret:
                    keys.append(decode_secret(self.secret_box.open(c.previous_secret)))
                state.endpoint = self.sender.endpoint(
                    f"{c.destination}#{c.endpoint_id}",
                    config,
                    c.url,
                    keys,
                    breaker=state.endpoint.breaker if state.endpoint else None,
                    semaphore=state.semaphore,
                )
                state.problem = None
            except (OutboxError, ValueError) as exc:
                state.endpoint = None
                state.problem = f"endpoint {c.endpoint_id} cannot be used: {describe(exc)}"
                log.error("relay.endpoints.unusable", endpoint=c.endpoint_id, error=state.problem)
        return state

    async def _deliver(self, c: Claimed, state: EndpointState) -> None:
        try:
            record = await self._attempt(c, state)
        except Exception as exc:
            log.exception("relay.endpoints.delivery_crashed", delivery=c.id)
            record = self._crashed(c, exc)
        finally:
            state.in_hand -= 1
        self._outcomes.append(record)
        self._written.set()
        self._wake_soon()  # its endpoint has room again

    def _crashed(self, c: Claimed, exc: BaseException) -> DeliveryRecord:
        """A delivery whose handling raised: retried, an attempt counted, and failed once
        its attempts are spent (a bug that always raises must not retry it for ever)."""
        config = self.destinations.get(c.destination)
        limit = config.max_attempts if config is not None else self._default_max
        error = f"relay error during delivery: {describe(exc)}"
        if c.attempts + 1 >= limit:
            return self._record(
                c, "failed", 1, 0.0, f"gave up after {c.attempts + 1} attempts: {error}"
            )
        return self._record(c, "pending", 1, CRASH_RETRY, error)

    async def _attempt(self, c: Claimed, state: EndpointState) -> DeliveryRecord:
        config = self.destinations[c.destination]
        if not c.found:
            return self._record(
                c,
                "cancelled",
                0,
                0.0,
                f"event {c.event_id} no longer exists (deleted or purged) before it could be "
                "sent; nothing to deliver",
            )
        if state.endpoint is None:
            return self._unusable(c, state)

        if (problem := header_problem(c.headers)) is not None:
            return self._record(c, "failed", 1, 0.0, problem)
        env = _envelope(c)
        sent = await self._send(c, state, env)
        if isinstance(sent, DeliveryRecord):
            return sent
        outcome, took = sent
        return self._answered(c, state, config, env, outcome, took)

    async def _send(
        self, c: Claimed, state: EndpointState, env: Envelope
    ) -> tuple[Outcome, float] | DeliveryRecord:
        """Send ``env`` with one of its endpoint's request slots, at its pace: the outcome and
        the milliseconds the request took, or the record of a delivery not sent after all."""
        async with state.semaphore:
            # Checked before the pace (a delivery that will not be sent takes no turn of a
            # rate limit), and again once every wait is over, just before the request.
            if (stop := self._not_sendable(c, state, None)) is not None:
                return stop
            await self._pace(state, c.rate_limit)
            # The endpoint as the latest claim read it: a claim made while this one waited
            # for its slot, its pace or a circuit's probe may have changed its URL, secret or
            # tenant; the request uses this one, and the check below holds it to it.
            endpoint = state.endpoint
            if endpoint is None:
                return self._unusable(c, state)
            stopped: list[DeliveryRecord] = []

            def check() -> str | None:
                rec = self._not_sendable(c, state, endpoint)
                if rec is None:
                    return None
                stopped.append(rec)
                return rec.error or "not sent"

            c.sending = True
            breaker = endpoint.breaker
            was = breaker.state
            started = time.monotonic()
            state.started.append(started)  # slow while in flight past the budget
            try:
                outcome = await self.sender.attempt(endpoint, env, check)
            finally:
                state.started.remove(started)
            if stopped:  # nothing was sent
                c.sending = False
                return stopped[0]
            seconds = time.monotonic() - started
            state.latency = latency_average(state.latency, seconds)
            took = seconds * 1000
            self._note_circuit(c.endpoint_id, breaker, was)
        return outcome, took

    def _note_circuit(self, endpoint_id: int, breaker: Breaker, was: State) -> None:
        """Keep for `status` when the request opened or closed its endpoint's circuit."""
        now_state = breaker.state
        if now_state is State.OPEN and was is not State.OPEN:
            self._circuits[endpoint_id] = breaker.retry_in()
        elif now_state is State.CLOSED and was is not State.CLOSED:
            self._circuits[endpoint_id] = None

    def _answered(
        self,
        c: Claimed,
        state: EndpointState,
        config: EndpointsDestination,
        env: Envelope,
        outcome: Outcome,
        took: float,
    ) -> DeliveryRecord:
        """The record of a request sent: its outcome, with the answer for the message log."""
        answer = self.sender.answers.pop(env, None)
        if outcome.result is Result.DEFER:
            return self._record(
                c, "pending", 0, outcomes.clamp_delay(outcome.retry_in, 1.0), outcome.error
            )
        rec = outcomes.to_record(env, outcome, config.max_attempts, config.backoff)
        status, body = answer if answer is not None else (None, b"")
        ok = outcome.result is Result.DELIVERED
        self._health[c.endpoint_id] = self._health.get(c.endpoint_id, False) or ok
        if status == 410:
            rec = self._on_gone(c, state, rec, outcome)
        if self.metrics is not None:
            self.metrics.endpoint_attempts.labels(
                c.destination, outcome.result.value, outcome.status_class or "none"
            ).inc()
        return DeliveryRecord(
            id=c.id,
            token=c.token,
            status=str(rec.status),
            counted=1,
            delay=rec.delay,
            error=rec.error,
            http_status=status,
            event_id=c.event_id,
            endpoint_id=c.endpoint_id,
            duration_ms=round(took, 3),
            response=_text(body) if status is not None else None,
            replay=c.replay,
        )

    def _on_gone(self, c: Claimed, state: EndpointState, rec: Record, outcome: Outcome) -> Record:
        """A 410 Gone: the endpoint is disabled, not the message refused. This delivery waits
        with the endpoint's queue and goes out once it is enabled again (a receiver that
        answered 410 by mistake, a bad deploy, loses nothing); the attempt is counted and
        logged."""
        self._gone.add(c.endpoint_id)
        state.disabled_at = time.monotonic()  # its queued deliveries are not sent
        state.gone = True
        return replace(
            rec,
            status=Status.PENDING,
            delay=0.0,
            error=truncate_error(
                f"{outcome.error or 'HTTP 410 Gone'}; endpoint {c.endpoint_id} is disabled "
                f"and this delivery is sent again once it is enabled "
                f"(outbox-relay endpoints enable {c.endpoint_id})"
            ),
        )

    def _not_sendable(
        self, c: Claimed, state: EndpointState, endpoint: Target | None
    ) -> DeliveryRecord | None:
        """Why a claimed delivery must not be sent now (its record), or None. ``endpoint``:
        the one its request would use (None: before the pace, nothing picked yet)."""
        if state.disabled_at is not None and c.lease_started <= state.disabled_at:
            # Claimed before this relay disabled the endpoint (a 410 Gone while it waited).
            # Not sent; it waits, as the endpoint's other deliveries do, until the endpoint
            # is enabled again.
            return self._record(
                c, "pending", 0, 0.0, f"endpoint {c.endpoint_id} was disabled; not sent"
            )
        if state.endpoint is None:
            return self._unusable(c, state)
        if endpoint is not None and state.endpoint is not endpoint:
            # Changed (URL, secrets) while it waited: claimed again, it goes with the new ones.
            return self._record(
                c, "pending", 0, 0.0, f"endpoint {c.endpoint_id} changed while this waited"
            )
        if not takes(state.tenant, state.event_types, c.event_tenant, c.event_type):
            # Never sent to an endpoint that no longer takes the event: one handed over to
            # another tenant, or narrowed to other types, since the fan-out.
            self._not_taken(c, state)
            return self._record(
                c,
                "cancelled",
                0,
                0.0,
                f"endpoint {c.endpoint_id} no longer takes event {c.event_id} (its tenant or "
                "event types changed since the fan-out); not sent",
            )
        return None

    def _not_taken(self, c: Claimed, state: EndpointState) -> None:
        """Counted each time, logged at most once a minute per endpoint (a whole queue of
        another tenant's events may end this way)."""
        if self.metrics is not None:
            self.metrics.endpoint_attempts.labels(c.destination, "not_taken", "none").inc()
        state.not_taken += 1
        now = time.monotonic()
        if now - state.not_taken_logged >= NOT_TAKEN_LOG_EVERY:
            log.warning(
                "relay.endpoints.not_taken",
                endpoint=c.endpoint_id,
                deliveries=state.not_taken,
                action="cancelled, not sent; `outbox-relay replay` sends them again to an "
                "endpoint that takes them",
            )
            state.not_taken, state.not_taken_logged = 0, now

    def _unusable(self, c: Claimed, state: EndpointState) -> DeliveryRecord:
        """A delivery whose endpoint cannot be used by this relay (its secret cannot be
        opened: the key is missing or wrong). Logged as a try that sent nothing (NOT_SENT: in
        the message log, not among its attempts, so that it has all of them once the key is
        set), tried again after UNUSABLE_RETRY, and a failure of the endpoint's health: it
        shows as failing with the reason in `status`, `endpoints show` and the console, and
        disable_after applies (its queue is then kept), rather than the delivery waiting
        unseen for ever. It never fails for it: the message was not refused, this relay's
        configuration is wrong, and another relay (or this one, once the key is set) can
        send it."""
        problem = state.problem or f"endpoint {c.endpoint_id} cannot be used"
        self._health[c.endpoint_id] = self._health.get(c.endpoint_id, False)
        if self.metrics is not None:
            self.metrics.endpoint_attempts.labels(c.destination, "not_sent", "none").inc()
        return self._record(c, "pending", NOT_SENT, UNUSABLE_RETRY, f"not sent: {problem}")

    @staticmethod
    async def _pace(state: EndpointState, rate: int | None) -> None:
        """Spread a rate-limited endpoint's requests over the second (the claim bounds how
        many may start within one; this keeps them from starting all at once)."""
        if not rate:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        at = max(now, state.next_send)
        state.next_send = at + 1.0 / rate
        if at > now:
            await asyncio.sleep(at - now)

    @staticmethod
    def _record(
        c: Claimed, status: str, counted: int, delay: float, error: str | None
    ) -> DeliveryRecord:
        return DeliveryRecord(
            id=c.id,
            token=c.token,
            status=status,
            counted=counted,
            delay=delay,
            error=truncate_error(error) if error else None,
            http_status=None,
            event_id=c.event_id,
            endpoint_id=c.endpoint_id,
            duration_ms=None,
            response=None,
            replay=c.replay,
        )

    # --- endpoint health ----------------------------------------------------------------

    async def _write_health(self) -> None:
        """Write what the attempts said about their endpoints, when it changed (or now and
        then while all is well), and disable those failing too long or gone."""
        assert self.store is not None
        now = time.monotonic()
        changes = {}
        for eid, ok in self._health.items():
            state = self.states.get(eid)
            if state is None:
                continue
            # Written when it changes (state.failing == ok: it was failing and succeeded, or
            # the reverse), and now and then while it stays as it is: a success refreshes
            # last_success_at, a failure re-reads how long it has been failing (disable_after).
            if (
                state.failing is None
                or state.failing == ok
                or now - state.health_written > self.health_refresh
            ):
                changes[eid] = ok
        health, self._health = self._health, {}
        if changes:
            try:
                failing_for = await self.store.health(changes)
            except DB_ERRORS as exc:
                log.warning("relay.endpoints.health_failed", error=describe(exc))
                for eid, ok in health.items():  # kept for the next write
                    self._health[eid] = self._health.get(eid, False) or ok
                return
            for eid, ok in changes.items():
                state = self.states[eid]
                state.failing, state.health_written = not ok, now
                seconds = failing_for.get(eid)
                if seconds is not None and seconds >= state.config.disable_after:
                    await self._disable(
                        eid,
                        f"failing without a success for {seconds / 86400:.1f} days "
                        f"(disable_after {state.config.disable_after:g} s)",
                        state.config.disable_after,
                    )
        circuits, self._circuits = self._circuits, {}
        if circuits:
            try:
                await self.store.circuits(circuits)
            except DB_ERRORS as exc:
                log.warning("relay.endpoints.circuit_write_failed", error=describe(exc))
        gone, self._gone = self._gone, set()
        for eid in gone:
            await self._disable(eid, "the endpoint answered 410 Gone", None)

    async def _disable(self, endpoint_id: int, reason: str, failing_for: float | None) -> None:
        assert self.store is not None
        try:
            done = await self.store.disable(endpoint_id, reason, failing_for)
        except DB_ERRORS as exc:
            log.warning("relay.endpoints.disable_failed", endpoint=endpoint_id, error=describe(exc))
            if failing_for is None:
                self._gone.add(endpoint_id)  # tried again after the next outcomes
            return
        state = self.states.get(endpoint_id)
        if state is not None and failing_for is None:
            state.gone = False  # disabled in the table now: its claims stop there
        if done:
            self.stats["disabled"] += 1
            if state is not None:
                state.disabled_at = time.monotonic()
            if self.metrics is not None:
                dest = state.destination if state is not None else "unknown"
                self.metrics.endpoints_disabled.labels(dest).inc()
            log.warning(
                "relay.endpoints.disabled",
                endpoint=endpoint_id,
                reason=reason,
                hint=f"outbox-relay endpoints enable {endpoint_id} once it is fixed",
            )

    # --- stopping -----------------------------------------------------------------------

    async def drain(self, timeout: float) -> None:
        """Stop claiming; let deliveries in flight finish for ``timeout`` seconds; write
        their outcomes; put what was not attempted back to pending."""
        self._draining = True
        self._wake.set()
        self._capacity.set()
        async with self._claim_lock:  # a claim in progress hands its rows over first
            pass
        if self.tasks:
            _, late = await asyncio.wait(set(self.tasks), timeout=max(timeout, 0.0))
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        # Requests cut short by the stop may have reached their endpoint: counted as attempts
        # (retried later), not released as if never sent.
        done = {r.id for r in self._outcomes}
        for c in list(self.held.values()):
            if c.sending and c.id not in done:
                self._outcomes.append(
                    self._record(
                        c,
                        "pending",
                        1,
                        CRASH_RETRY,
                        "the relay stopped during the request; the endpoint may have received it",
                    )
                )
        if self.store is None:
            return
        async with self._record_lock:  # a write in progress ends first
            batch, self._outcomes = self._outcomes, []
            if batch:
                try:
                    await self.store.record(batch)
                except DB_ERRORS as exc:
                    # Attempted, so not released: the reaper takes them back after their
                    # lease, counting the attempt.
                    log.error(
                        "relay.endpoints.record_failed", count=len(batch), error=describe(exc)
                    )
            for r in batch:
                self._release_hold(r)
        leftover = list(self.held.values())
        if leftover:
            try:
                await self.store.release(leftover)
                log.info("relay.endpoints.released", count=len(leftover))
            except DB_ERRORS as exc:
                log.error(
                    "relay.endpoints.release_failed",
                    count=len(leftover),
                    error=describe(exc),
                    action="the reaper returns them to pending when their lease expires",
                )
            self.held.clear()


def _envelope(c: Claimed) -> Envelope:
    """The claimed delivery's event, as the webhook sink sends it."""
    return Envelope(
        id=c.event_id,
        destination=c.destination,
        key=None,
        payload=c.payload,
        content_type=c.content_type,
        headers=c.headers,  # type: ignore[arg-type]
        attempts=c.attempts,
        created=epoch(c.created_at),
        token=c.token,
        lease=c.lease,
        event_type=c.event_type,
    )


def _text(body: bytes) -> str:
    """The start of an answer, as text the log can hold (PostgreSQL text holds no NUL)."""
    return body[:RESPONSE_LOGGED].decode("utf-8", "replace").replace("\x00", "")


async def _wait(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()


__all__ = ["Dispatcher", "EndpointState", "Sender", "class_of"]
