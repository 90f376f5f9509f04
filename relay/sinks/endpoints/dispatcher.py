"""Delivering fanned-out events to their endpoints: claim, send, record, per endpoint.

Every (event, endpoint) pair is a row of outbox_deliveries with its own status, attempts,
backoff and lease, so a slow or dead endpoint holds only its own deliveries. The loop here
mirrors the relay's own for events, at a smaller scale: a claim statement that walks the
endpoints with due work (at most ``max_concurrency`` rows each, fewer under a rate limit),
one task per delivery under its endpoint's request slots and circuit, outcomes written in
batches together with the message log, a heartbeat for the leases, a reaper for the
deliveries of relays that died. Endpoints' settings come with each claimed row, so a change
made at runtime applies to the next claim (a NOTIFY wakes the loop at once).

The dispatcher is made of parts: what they share (base.py), one delivery's attempt
(attempts.py), the endpoints' health (health.py); here, the loops and the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from outbox.errors import describe
from relay.db.store import DB_ERRORS, UNAVAILABLE
from relay.sinks.endpoints.attempts import CRASH_RETRY, Attempts
from relay.sinks.endpoints.fairness import Plan
from relay.sinks.endpoints.fairness import plan as fairness_plan
from relay.sinks.endpoints.health import Health
from relay.sinks.endpoints.state import EndpointState
from relay.sinks.endpoints.store import Claimed, DeliveryRecord, DeliveryStore
from relay.sinks.webhook.answers import class_of

log = structlog.get_logger("relay.sink.endpoints")


class Dispatcher(Attempts, Health):
    """Claims the endpoints' deliveries, starts their attempts, records their outcomes, keeps
    their leases and reaps those of relays that died; drains on a stop."""

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
                if (r.id, r.token) not in written:
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
        kept = await self.store.heartbeat([(c.id, c.token) for c in held])
        for c in held:
            if c.id in kept:
                c.lease.until = before + self.store.store.lease
            else:
                c.lease.lost.add(c.event_id)

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
                await self.store.release([(c.id, c.token) for c in leftover])
                log.info("relay.endpoints.released", count=len(leftover))
            except DB_ERRORS as exc:
                log.error(
                    "relay.endpoints.release_failed",
                    count=len(leftover),
                    error=describe(exc),
                    action="the reaper returns them to pending when their lease expires",
                )
            self.held.clear()


async def _wait(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()


__all__ = ["Dispatcher", "EndpointState", "class_of"]
