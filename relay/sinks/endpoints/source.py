"""The endpoints' deliveries as a source of claimable rows (relay/sinks/source.py), for the
relay's own pipeline to claim, hold, renew, record, reap and release them, as it does the
events.

The pipeline runs it one step at a time: ``claim`` is one bite (the fair share plan, open
circuits and endpoints that answered 410 left out, the cursor, orphans logged); ``deliver``
sends one endpoint's group of deliveries with at most its ``max_concurrency`` workers and
hands each outcome on as it ends;
``record``, ``heartbeat``, ``settled`` and ``release`` are the lease statements the pipeline's
Leases and Completer use; ``reap`` puts back the deliveries of relays that died. The health
its attempts saw is written after each record.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import structlog

from outbox.endpoint_secrets import SecretBox
from outbox.errors import describe
from relay.db.store import DB_ERRORS, Record
from relay.sinks.endpoints.attempts import CRASH_RETRY, PUT_BACK_COOLDOWN
from relay.sinks.endpoints.config import EndpointsDestination
from relay.sinks.endpoints.fairness import UNCAPPED
from relay.sinks.endpoints.fan_outs import FAN_OUT_EVENTS, FanOuts
from relay.sinks.endpoints.health import Health
from relay.sinks.endpoints.rows import Claimed, DeliveryRecord
from relay.sinks.endpoints.state import EndpointState
from relay.sinks.endpoints.store import DeliveryStore
from relay.sinks.endpoints.together import Together
from relay.sinks.source import SendingSource
from relay.sinks.webhook.requests import RequestPath

log = structlog.get_logger("relay.sink.endpoints")

Emit = Callable[[DeliveryRecord, Claimed], None]  # an outcome, and the delivery it is of
Key = tuple[int, int]  # (delivery id, fencing token)
PRUNE_EVERY = 10.0  # seconds between looks for endpoints idle long enough to be forgotten
# Seconds between the claim's sweeps for deliveries of deleted or moved endpoints: never
# claimed, they only wait to be cancelled, and each sweep's probes read every dead entry a
# held snapshot keeps at the front of each endpoint's pending deliveries.
SWEEP_EVERY = 5.0
# Seconds between reads of the enabled endpoints (whether the events may be paced: fan_outs.py)
# when no NOTIFY says they changed.
ENABLED_EVERY = 5.0


class DeliverySource(FanOuts, Health):
    """The deliveries of ``store``'s table, served one step at a time by the pipeline."""

    name: ClassVar[str] = "deliveries"

    def __init__(
        self,
        store: DeliveryStore,
        requests: RequestPath,
        destinations: Mapping[str, EndpointsDestination],
        *,
        max_in_flight: int = 1000,
        poll_interval: float = 1.0,
        secret_box: SecretBox | None = None,
    ) -> None:
        super().__init__(
            requests,
            destinations,
            max_in_flight=max_in_flight,
            poll_interval=poll_interval,
            secret_box=secret_box,
        )
        self.store: DeliveryStore = store
        store.on_put_back = self.wake  # claimed again at once, not at the poll
        self._due = True
        # Called when the source comes due, so the claimer claims it now (Claimer.wake).
        self.on_due: Callable[[], None] = _nothing
        # Hands deliveries a fan-out claimed to the pipeline, held and sent as claimed ones
        # (set by the relay; without it, a fan-out claims none).
        self.adopt: Callable[[Sequence[Claimed]], None] | None = None
        self._per_event = 1.0  # deliveries per event the last fan-out made
        # Per destination (fan_out_fits): when one event was fanned out to learn of its
        # endpoints, when its events were last held for a backlog.
        self._probed: dict[str, float] = {}
        self._hold_since, self._hold_cleared = {}, set()  # and whether its backlog went
        # Endpoints whose backlog a hold did not clear; destinations whose hold was judged.
        self._outlasted: set[int] = set()
        self._judged: set[str] = set()
        self._init_enabled()
        # Per destination: what the last look ahead saw (when, and the endpoints the next
        # waiting events would reach), the look under way and when it started, when one
        # last failed, and the highest event id fanned out here (a look reads the fresh
        # events after it).
        self._ahead: dict[str, tuple[float, set[int]]] = {}
        self._looking: dict[str, asyncio.Task[None]] = {}
        self._look_started: dict[str, float] = {}
        self._look_failed: dict[str, float] = {}
        self._fanned_top: dict[str, int] = {}
        # The look for deliveries another relay wrote pending (_look_for_others), while under
        # way, and whether the last one failed.
        self._look_task: asyncio.Task[None] | None = None
        self._look_failing = False
        self._fanning = 0.0  # deliveries expected of the fan-outs in progress
        # An event claimed again goes apart from its stale claim (FAN_OUT answers by event id).
        self._together = Together(self._fan_out_now, FAN_OUT_EVENTS, ident=lambda e: e.id)
        # Claimed, not yet delivered: their endpoint's state (its in_hand counts them), or
        # what raised when it was read (a bug: recorded as a crash).
        self._waiting: dict[Key, EndpointState] = {}
        self._broken: dict[Key, BaseException] = {}
        self._pruned = time.monotonic()
        self._swept = -SWEEP_EVERY  # when the last sweep of the whole walk ended (monotonic)
        self._sweeping = False  # the claims since the walk's start have all swept

    def _init_enabled(self) -> None:
        # The enabled endpoints of each destination, read every ENABLED_EVERY and after a
        # change (endpoints_changed): whether its events may be paced (FanOuts._paceable).
        self._enabled: dict[str, dict[int, bool]] = {}
        self._enabled_at = float("-inf")
        # When the read that gave _enabled began (monotonic): a delivery claimed before it
        # whose endpoint it did not find enabled (disabled or deleted since) is not sent
        # (Attempts._not_sendable). The read a NOTIFY asks for, while under way, and whether
        # another NOTIFY came meanwhile (that read may have begun before its change).
        self._enabled_read = float("-inf")
        self._enabled_task: asyncio.Task[None] | None = None
        self._enabled_again = False

    # --- claiming -----------------------------------------------------------------------

    @property
    def due(self) -> bool:
        """Woken (a fan-out, a finished delivery, a reap), or a scan left off mid-way."""
        return self._due or self._cursor is not None

    def wake(self) -> None:
        self._due = True
        self.on_due()

    def _look_for_others(self) -> None:
        """Look for fresh deliveries another relay wrote pending (DeliveryStore.look), in a
        task of its own, and claim if it finds some, or cannot tell."""
        if self._halted or self._look_task is not None:
            return
        self._look_task = asyncio.get_running_loop().create_task(self._looking_for_others())

    async def _looking_for_others(self) -> None:
        try:
            found = await self.store.look()
        except DB_ERRORS as exc:
            # The claim it stands in for is run instead (and says what is wrong with the
            # database, if that is it); said once, not at every look while it lasts.
            if not self._look_failing:
                log.warning("relay.endpoints.look_failed", error=describe(exc))
            self._look_failing = found = True
        except Exception:
            log.exception("relay.endpoints.look_failed")
            self._look_failing = found = True
        else:
            self._look_failing = False
        finally:
            self._look_task = None
        if found:
            self.wake()

    def endpoints_changed(self) -> None:
        """An endpoint was added, changed or enabled (a NOTIFY): read them again, and claim."""
        self._enabled_at = float("-inf")
        self.wake()
        # Read at once, not at the next claim (none comes while the source is full): rows
        # held queued for an endpoint disabled or deleted must not go out meanwhile.
        if self._halted:
            return
        if self._enabled_task is not None:
            self._enabled_again = True  # the read under way may have begun before this change
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._enabled_task = loop.create_task(self._read_enabled_now())

    async def _read_enabled_now(self) -> None:
        try:
            self._enabled_again = True
            while self._enabled_again:
                self._enabled_again = False
                await self._read_enabled()
        except Exception:  # a bug: the next claim reads them again
            log.exception("relay.endpoints.enabled_read_failed")
        finally:
            self._enabled_task = None

    async def claim(self, limit: int, held: Iterable[Claimed]) -> list[Claimed]:
        """One bite: at most ``limit`` due deliveries, within the fair share of the room
        ``held`` (the deliveries this relay holds) leaves, none for paused destinations, open
        circuits or endpoints that answered 410."""
        self._due = False
        await self._upkeep()
        paused = self.paused()
        serving = [d for d in self.destinations if d not in paused]
        if not serving or limit <= 0:
            # A walk left off mid-way starts again once there is room or a destination to
            # serve: kept, it would keep the source due (claimed again at once) for nothing.
            self._cursor = None
            return []
        holding = sum(1 for _ in held)
        share = self._plan(holding)
        skip = [s.id for s in self.states.values() if s.circuit_open or s.gone]
        skip.extend(share.skip_endpoints)
        now = time.monotonic()
        caps = dict(share.caps)
        for s in self.states.values():
            if now - s.put_back_at < PUT_BACK_COOLDOWN and caps.get(s.id) == UNCAPPED:
                caps[s.id] = s.config.max_concurrency  # its room, not claimed ahead
        # Claiming ahead uses only the free half of the relay's room: rows queued behind an
        # endpoint's request slots count in max_in_flight, and must not crowd out the others'.
        ahead_room = max(0, self.max_in_flight // 2 - holding)
        ahead = self.ahead if ahead_room > 0 else 1
        sweep = self._sweep_due(now)
        try:
            claimed, self._cursor, orphans = await self.store.claim(
                serving,
                [self.destinations[d].max_concurrency for d in serving],
                [self.destinations[d].slow_concurrency for d in serving],
                min(limit, share.limit),
                skip,
                self.scan,
                self._cursor,
                caps,
                sorted(share.skip_tenants),
                ahead,
                ahead_room,
                sweep,
            )
        except BaseException:
            self._cursor = None
            self._due = True  # claimed again once the claimer's retry comes
            raise
        self._swept_after(now)
        self._due = self._due or self.store.behind  # fresh deliveries past its read: again
        if orphans:
            log.warning(
                "relay.endpoints.orphans_cancelled",
                deliveries=orphans,
                reason="their endpoint was deleted or moved to another destination",
            )
        for c in claimed:
            self._take(c)
        self.stats["claimed"] += len(claimed)
        return claimed

    async def _upkeep(self) -> None:
        """Before a claim, now and then: forget idle endpoints, read the enabled ones."""
        if time.monotonic() - self._pruned > PRUNE_EVERY:
            self._prune()
            self._pruned = time.monotonic()
        if time.monotonic() - self._enabled_at >= ENABLED_EVERY:
            await self._read_enabled()

    async def _read_enabled(self) -> None:
        """The enabled endpoints of this source's destinations, read again; none if the read
        fails (then events are not paced before the next)."""
        self._enabled_at = started = time.monotonic()
        try:
            enabled, takes = await self.store.enabled(list(self.destinations))
        except DB_ERRORS as exc:
            if started >= self._enabled_read:  # not over a newer read that succeeded
                self._enabled, self._enabled_read = {}, started
            log.warning("relay.endpoints.enabled_read_failed", error=describe(exc))
            return
        if started < self._enabled_read:
            return  # an older read that ended later
        self._enabled, self._enabled_read = enabled, started
        # What each takes now, for the deliveries queued here (Attempts._not_sendable holds
        # each to it): one handed over to another tenant, or narrowed to other types, since
        # its last claim sends none of its queue to the new owner or of the old types.
        for endpoint, (tenant, types) in takes.items():
            state = self.states.get(endpoint)
            if state is not None and started >= state.tenant_read:
                state.tenant, state.event_types, state.tenant_read = tenant, types, started
                state.tenant_by_enabled = True

    def _not_enabled(self, c: Claimed) -> bool:
        """Whether a read of the enabled endpoints that began after ``c`` was claimed did
        not find its endpoint: an operator disabled or deleted it since."""
        if self._enabled_read <= c.lease_started:
            return False
        enabled = self._enabled.get(c.destination)
        return enabled is not None and c.endpoint_id not in enabled

    def _sweep_due(self, now: float) -> bool:
        """Whether this claim sweeps for deliveries of deleted or moved endpoints. Once due,
        every claim sweeps until a walk from the first endpoint to the last has been swept
        whole: by one claim, or by claims cut at :scan going on from their cursors (a claim
        that picked a full batch stopped its walk early and swept nothing)."""
        sweep = now - self._swept >= SWEEP_EVERY
        if sweep and self._cursor is None:
            self._sweeping = True
        return sweep

    def _swept_after(self, now: float) -> None:
        """After a claim: the sweep goes on, is done (the walk's end, swept from its first
        endpoint), or must start again from the first."""
        if not self.store.swept:
            self._sweeping = False
        elif self._cursor is None and self._sweeping:
            self._swept = now

    def group(self, c: Claimed) -> int:
        """Deliveries are sent in groups of one endpoint's."""
        return c.endpoint_id

    # --- sending ------------------------------------------------------------------------

    async def deliver(self, items: Sequence[Claimed], emit: Emit) -> None:
        """Send one endpoint's deliveries (``items``, claimed by :meth:`claim`), at most its
        destination's ``max_concurrency`` at a time; each outcome goes to ``emit`` as soon as
        it is known, not when the whole group is done."""
        queue: deque[tuple[Claimed, EndpointState]] = deque()
        # Oldest first (the claim returns its rows in no particular order): the first round
        # of a queue claimed ahead is its endpoint's oldest deliveries.
        for c in sorted(items, key=lambda c: c.id):
            key = (c.id, c.token)
            exc = self._broken.pop(key, None)
            state = self._waiting.pop(key, None)
            if state is None:
                emit(self._crashed(c, exc or LookupError("not claimed by this source")), c)
            else:
                queue.append((c, state))
        if not queue:
            return
        workers = min(len(queue), self.destinations[queue[0][0].destination].max_concurrency)
        try:
            # A worker that raises (a bug outside an attempt) stops its siblings: the rows
            # left are then recorded as crashed by the pipeline, and none of them may still
            # be sent after that.
            async with asyncio.TaskGroup() as group:
                for _ in range(workers):
                    group.create_task(self._worker(queue, emit))
        except BaseExceptionGroup as errors:
            raise errors.exceptions[0] from None
        finally:
            # Cut short (a stop, a bug): those not started leave their endpoint's hand; the
            # pipeline releases them, or records them as crashed.
            for _, state in queue:
                state.in_hand -= 1

    def halt(self) -> None:
        """The relay is stopping: no request starts from now on. Rows not started are left
        without an outcome (the shutdown puts them back unattempted), or, if they were
        waiting for a request slot, put back at once."""
        self._halted = True
        for task in self._looking.values():
            task.cancel()  # a look ahead: nothing is paced any more
        self._looking.clear()  # a task cancelled before it ran never clears itself
        if self._look_task is not None:
            self._look_task.cancel()  # nothing is claimed any more
            self._look_task = None
        if self._enabled_task is not None:
            self._enabled_task.cancel()
            self._enabled_task = None
        if self._retry_timer is not None:
            self._retry_timer.cancel()
            self._retry_timer = None

    async def _worker(self, queue: deque[tuple[Claimed, EndpointState]], emit: Emit) -> None:
        # Halted, the rows still queued (claimed ahead of the endpoint's free slots) are not
        # started: the stop waits for requests in flight, not for a queue of them.
        while queue and not self._halted:
            c, state = queue.popleft()
            try:
                record = await self._attempt(c, state)
            except Exception as exc:
                log.exception("relay.endpoints.delivery_crashed", delivery=c.id)
                record = self._crashed(c, exc)
            finally:
                state.in_hand -= 1
            emit(record, c)
            # Its endpoint has room again: claimed for together, if any of its deliveries
            # waits (or may) for a claim, or this one is to be sent again.
            self._wake_soon(record.status == "pending" or self._waits(state.id))

    def crashed(self, c: Claimed, exc: BaseException) -> DeliveryRecord:
        """The record of a delivery whose handling raised: retried, failed at its limit."""
        return self._crashed(c, exc)

    def cut_short(self, c: Claimed) -> DeliveryRecord | None:
        """The record of a delivery a stop cut short: its request may have reached the
        endpoint, so it counts as an attempt; None if no request had started (released)."""
        if not c.sending:
            return None
        return self._record(
            c,
            "pending",
            1,
            CRASH_RETRY,
            "the relay stopped during the request; the endpoint may have received it",
        )

    def retry_hint(self, record: Record) -> str:
        """A delivery is sent again by replaying its event to its endpoint."""
        r = _delivery(record)
        return f"outbox-relay replay {r.event_id} --endpoint {r.endpoint_id}"

    # --- the lease statements -----------------------------------------------------------

    async def record(self, records: Sequence[Record]) -> set[Key]:
        """Write outcomes and log their attempts; then the health they showed."""
        written = await self.store.record([_delivery(r) for r in records])
        self.stats["recorded"] += len(written)
        # The claim counts an endpoint's deliveries in flight from the table, across relays:
        # these no longer are.
        self._wake_soon(
            any(
                _delivery(r).status == "pending" or self._waits(_delivery(r).endpoint_id)
                for r in records
            )
            or self._retry_has_room({_delivery(r).endpoint_id for r in records})
        )
        self.retries_written(
            (r.id, r.endpoint_id, r.delay)
            for r in map(_delivery, records)
            if r.status == "pending" and (r.id, r.token) in written
        )
        try:
            await self._write_health()
        except Exception as exc:  # the outcomes are written: a bug here must not undo them
            log.exception("relay.endpoints.health_failed", error=describe(exc))
        return written

    async def heartbeat(self, leases: Sequence[Key]) -> set[int]:
        return await self.store.heartbeat(leases)

    async def settled(self, leases: Sequence[Key]) -> set[int]:
        """None: a delivery's outcome is written only through :meth:`record`."""
        return set()

    async def release(self, leases: Sequence[Key]) -> None:
        for key in leases:  # never delivered: no longer in their endpoint's hand
            state = self._waiting.pop(key, None)
            if state is not None:
                state.in_hand -= 1
            self._broken.pop(key, None)
        if leases:
            await self.store.release(leases)

    async def reap(
        self, max_attempts: int, limits: Mapping[str, int], within: float | None = None
    ) -> int:
        """Put back the deliveries whose lease expired (a dead relay's), an attempt counted;
        failed at their destination's ``limits`` (``max_attempts`` for a destination this
        relay does not know); with ``within``, only leases that ended in the last ``within``
        seconds. The reaper logs them and wakes this source."""
        # First: what a lost fan-out claimed is not to be reaped (an attempt counted).
        await self.store.settle(wait=False)
        reaped = await self.store.reap(max_attempts, {**limits, **self._limits}, within=within)
        try:
            await self.store.check_floors()
        except Exception as exc:  # the check runs again at the next pass
            log.warning("relay.endpoints.floors_check_failed", error=describe(exc))
        return reaped


def _delivery(r: Record) -> DeliveryRecord:
    """The pipeline hands back the records this source made (or copies of them)."""
    if not isinstance(r, DeliveryRecord):
        raise TypeError(f"not a delivery's record: {r!r}")
    return r


def _nothing() -> None:
    pass


if TYPE_CHECKING:

    def _is_a_source(s: DeliverySource) -> SendingSource[Claimed]:
        return s  # checked by mypy: the pipeline takes it as one


__all__ = ["DeliverySource", "Emit"]
