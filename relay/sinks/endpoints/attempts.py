"""One claimed delivery: its endpoint's state (URL, keys, circuit, slots), its request at
the endpoint's pace, and the record of what came of it, for the source to write.

A delivery that must not be sent (its endpoint disabled, changed, unusable, or no longer
taking the event) is recorded without a request; one whose handling raised is retried.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import structlog

from outbox.errors import OutboxError, describe
from outbox.status import Status
from outbox.webhooks.signing import decode_secret
from relay import outcomes
from relay.breaker import Breaker, State
from relay.db.store import Record
from relay.model import Envelope, Outcome, Result, epoch, header_problem, truncate_error
from relay.sinks.endpoints.base import DeliveriesBase
from relay.sinks.endpoints.config import EndpointsDestination
from relay.sinks.endpoints.fairness import average as latency_average
from relay.sinks.endpoints.fairness import is_slow
from relay.sinks.endpoints.state import NOT_TAKEN_LOG_EVERY, EndpointState
from relay.sinks.endpoints.store import Claimed, DeliveryRecord, takes
from relay.sinks.webhook.requests import Answer, Target

log = structlog.get_logger("relay.sink.endpoints")

RESPONSE_LOGGED = 1024  # bytes of each answer kept in the message log
# At least this long between attempts of a delivery whose endpoint cannot be used (its secret
# cannot be opened): each is logged, and the cause is an operator's to fix.
UNUSABLE_RETRY = 60.0
NOT_SENT = 2  # DeliveryRecord.counted of a try that sent nothing: logged, not an attempt
# DeliveryRecord.delay of a delivery put back unattempted that keeps its run_after (its place
# in its endpoint's queue), see DELIVERY_RECORD.
KEEP_PLACE = -1.0
# An endpoint that had a delivery put back (it turned slow with rows queued) is not claimed
# ahead for this long: near its latency budget it would flip between fast and slow, and each
# flip put back a queue.
PUT_BACK_COOLDOWN = 60.0
CRASH_RETRY = 5.0


class Attempts(DeliveriesBase):
    """The source's attempts: one delivery each, from its claim to its record."""

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
        if c.lease_started >= state.tenant_read:
            state.tenant, state.event_types = c.tenant, c.event_types
            state.tenant_read, state.tenant_by_enabled = c.lease_started, False
        version = (c.url, c.secret, c.previous_secret)
        if version != state.version:
            # New, or changed at runtime: the URL and keys of this claim apply from now on;
            # the circuit and request slots carry over.
            state.version = version
            try:
                keys = [decode_secret(self.secret_box.open(c.secret))]
                if c.previous_secret:
                    keys.append(decode_secret(self.secret_box.open(c.previous_secret)))
                state.endpoint = self.requests.target(
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
        answer, took = sent
        return self._answered(c, state, config, env, answer, took)

    async def _send(
        self, c: Claimed, state: EndpointState, env: Envelope
    ) -> tuple[Answer, float] | DeliveryRecord:
        """Send ``env`` with one of its endpoint's request slots, at its pace: the answer and
        the milliseconds the request took, or the record of a delivery not sent after all."""
        async with state.semaphore:
            if (back := self._put_back(c, state)) is not None:
                return back
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
                answer = await self.requests.send(endpoint, env, check)
            finally:
                state.started.remove(started)
            if stopped:  # nothing was sent
                c.sending = False
                return stopped[0]
            seconds = time.monotonic() - started
            state.latency = latency_average(state.latency, seconds)
            took = seconds * 1000
            self._note_circuit(c.endpoint_id, breaker, was)
        return answer, took

    def _note_circuit(self, endpoint_id: int, breaker: Breaker, was: State) -> None:
        """Keep for `status` when the request opened or closed its endpoint's circuit."""
        now_state = breaker.state
        if now_state is State.OPEN and was is not State.OPEN:
            self._circuits[endpoint_id] = probe_in = breaker.retry_in()
            # The claims leave its deliveries out until then: one claims them at the probe.
            self._claim_at(time.monotonic() + probe_in)
        elif now_state is State.CLOSED and was is not State.CLOSED:
            self._circuits[endpoint_id] = None

    def _answered(
        self,
        c: Claimed,
        state: EndpointState,
        config: EndpointsDestination,
        env: Envelope,
        answer: Answer,
        took: float,
    ) -> DeliveryRecord:
        """The record of a request sent: its outcome, with the answer for the message log."""
        outcome = answer.outcome
        if outcome.result is Result.DEFER:
            return self._record(
                c, "pending", 0, outcomes.clamp_delay(outcome.retry_in, 1.0), outcome.error
            )
        rec = outcomes.to_record(env, outcome, config.max_attempts, config.backoff)
        status, body = answer.status, answer.body
        ok = outcome.result is Result.DELIVERED
        self._health[c.endpoint_id] = self._health.get(c.endpoint_id, False) or ok
        if status == 410:
            rec = self._on_gone(c, state, rec, outcome)
        if self.metrics is not None:
            self.metrics.endpoint_attempt(
                c.destination, outcome.result.value, outcome.status_class or "none"
            )
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

    def _put_back(self, c: Claimed, state: EndpointState) -> DeliveryRecord | None:
        """A delivery that got its request slot while its endpoint turned slow, with
        ``slow_concurrency`` requests already out, put back unattempted in its place in the
        queue, its last error kept (rows claimed ahead of free slots were claimed while it
        looked fast; the next claim holds it to its slow cap, and it is not claimed ahead
        again for PUT_BACK_COOLDOWN)."""
        config = self.destinations[c.destination]
        now = time.monotonic()
        if len(state.started) >= config.slow_concurrency and is_slow(
            state.latency, state.started, now, config.budget
        ):
            self.stats["put_back_slow"] += 1
            state.put_back_at = now
            return self._record(c, "pending", 0, KEEP_PLACE, None)
        return None

    def _not_sendable(
        self, c: Claimed, state: EndpointState, endpoint: Target | None
    ) -> DeliveryRecord | None:
        """Why a claimed delivery must not be sent now (its record), or None. ``endpoint``:
        the one its request would use (None: before the pace, nothing picked yet)."""
        if self._halted:
            # The relay is stopping: no request starts, whatever it waited for (its slot, a
            # rate limit's turn, a circuit's probe). Back in its place, unattempted.
            return self._record(c, "pending", 0, KEEP_PLACE, None)
        if state.disabled_at is not None and c.lease_started <= state.disabled_at:
            # Claimed before this relay disabled the endpoint (a 410 Gone while it waited).
            # Not sent; it waits, as the endpoint's other deliveries do, until the endpoint
            # is enabled again.
            return self._record(
                c, "pending", 0, 0.0, f"endpoint {c.endpoint_id} was disabled; not sent"
            )
        if self._not_enabled(c):
            # Disabled (or deleted) by an operator since it was claimed: a disabled
            # endpoint keeps its queue, in its place, unattempted; a deleted one's
            # deliveries were cancelled (this record is then not written).
            return self._record(
                c,
                "pending",
                0,
                KEEP_PLACE,
                f"endpoint {c.endpoint_id} was disabled or deleted since this was claimed; "
                "not sent",
            )
        if state.endpoint is None:
            return self._unusable(c, state)
        if endpoint is not None and state.endpoint is not endpoint:
            # Changed (URL, secrets) while it waited: claimed again, it goes with the new ones.
            return self._record(
                c, "pending", 0, 0.0, f"endpoint {c.endpoint_id} changed while this waited"
            )
        if not takes(state.tenant, state.event_types, c.event_tenant, c.event_type):
            if state.tenant_by_enabled and takes(
                c.tenant, c.event_types, c.event_tenant, c.event_type
            ):
                # Only the enabled read says so, and its snapshot may be older than this
                # claim's (they are ordered by when each began here): back in its place,
                # unattempted; the next claim reads the endpoint and decides.
                why = f"endpoint {c.endpoint_id} may no longer take event {c.event_id}; not sent"
                return self._record(c, "pending", 0, KEEP_PLACE, why)
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

    def _not_enabled(self, c: Claimed) -> bool:
        """Whether ``c``'s endpoint was found disabled or deleted since it was claimed
        (DeliverySource reads the enabled endpoints)."""
        return False

    def _not_taken(self, c: Claimed, state: EndpointState) -> None:
        """Counted each time, logged at most once a minute per endpoint (a whole queue of
        another tenant's events may end this way)."""
        if self.metrics is not None:
            self.metrics.endpoint_attempt(c.destination, "not_taken", "none")
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
            self.metrics.endpoint_attempt(c.destination, "not_sent", "none")
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
