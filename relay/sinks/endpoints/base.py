"""What the deliveries source's parts share: its settings, the endpoints' states, and the
wake-up that claims the deliveries.

The source (source.py) is this state with its claim and its lease statements; its attempts
(attempts.py: one delivery each) and its health (health.py: what the attempts said of their
endpoints) are classes over this one.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING

from outbox.endpoint_secrets import SecretBox
from relay.obs.metrics import Metrics
from relay.sinks.endpoints.config import EndpointsDestination
from relay.sinks.endpoints.retries import DueRetries
from relay.sinks.endpoints.state import EndpointState
from relay.sinks.webhook.requests import RequestPath

if TYPE_CHECKING:
    from relay.sinks.endpoints.store import DeliveryStore

HEALTH_REFRESH = 60.0  # last_success_at is rewritten at most this often while all is well
SCAN = 1000  # endpoints with pending deliveries examined per claim, at most
# How many times its room a fast endpoint held by no other relay is claimed for (see
# DELIVERY_CLAIM): at 4, its next requests wait in this relay's request slots instead of a
# claim each time one ends. What keeps that within the endpoint's limits is in
# tests/test_endpoint_claim_ahead.py: another relay's claim in progress, a small batch, an
# endpoint that turns slow with rows queued, a stop with rows queued.
CLAIM_AHEAD = 4
STATE_IDLE = 600.0  # an endpoint not claimed from for this long is forgotten
WAKE_COALESCE = 0.01  # seconds finished requests wait to be claimed for together
# Seconds between looks for deliveries another relay wrote pending, woken by finished
# deliveries none of whose endpoints is known to have deliveries waiting (sent at their
# fan-out): a look costs a few index probes; the claim it stands in for, 5 ms to plan alone,
# and finds nothing mostly.
LOOK_EVERY = 0.1


class DeliveriesBase:
    """The deliveries source's state (DeliverySource, in source.py, is the class to use)."""

    def __init__(
        self,
        requests: RequestPath,
        destinations: Mapping[str, EndpointsDestination],
        *,
        max_in_flight: int = 1000,
        poll_interval: float = 1.0,
        secret_box: SecretBox | None = None,
    ) -> None:
        self.requests = requests  # each request sent as the webhook sink sends its own
        self.destinations = dict(destinations)
        self.max_in_flight = max_in_flight
        self.poll_interval = poll_interval
        self.secret_box = secret_box or SecretBox.from_environment()
        self.states: dict[int, EndpointState] = {}
        self.stats: Counter[str] = Counter()
        self.store: DeliveryStore | None = None
        self._wake_pending: asyncio.TimerHandle | None = None
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
        # The relay is stopping: no request starts any more (see DeliverySource.halt).
        self._halted = False
        self.scan = SCAN
        # The relay's claim of events held back for want of room (EndpointsSink.claim_limit):
        # on_room (the relay's wake-up) is called once deliveries have left.
        self.held_back: set[str] = set()  # destinations
        self._recheck: asyncio.Handle | None = None  # _recheck_room_at
        self._recheck_at = float("inf")  # when it is due (monotonic)
        self._claim_wanted = False
        self._looked = float("-inf")  # when a finished delivery last woke the claim
        # The retries this relay wrote, and the claim woken as they come due (_claim_at): at
        # most every LOOK_EVERY, when it last was, and when it is due next (monotonic).
        self.retries = DueRetries(poll_interval)
        self._retry_timer: asyncio.Handle | None = None
        self._retry_fired = float("-inf")
        self._retry_at = float("inf")
        self._room_claimed = float("-inf")  # when _retry_has_room last claimed
        self.on_room: Callable[[], None] = lambda: None
        self.ahead = CLAIM_AHEAD
        self._limits = {name: d.max_attempts for name, d in self.destinations.items()}
        self._default_max = max(self._limits.values())

    def wake(self) -> None:
        """Claim the deliveries now (the source's: DeliverySource.wake)."""
        return None

    def _room_again(self) -> bool:
        """Whether the events' claim, held back, may take events now (DeliverySource)."""
        return True

    def _prune(self) -> None:
        """Forget endpoints not claimed from for a while (deleted, disabled, idle): their
        circuits and keys are not kept for ever."""
        now = time.monotonic()
        for eid, state in list(self.states.items()):
            if not state.in_hand and now - state.last_claimed > STATE_IDLE:
                del self.states[eid]

    def _wake_soon(self, claim: bool = True) -> None:
        """Wake the claim shortly: requests finishing one by one are claimed for in one
        statement, not one claim each (a claim costs 1-3 ms of the server's time). Without
        ``claim`` (no delivery of theirs waits to be claimed), only the relay's claim of
        events, if it was held back for want of room."""
        self._claim_wanted |= claim
        if self._wake_pending is None:
            self._wake_pending = asyncio.get_running_loop().call_later(
                WAKE_COALESCE, self._woken_soon
            )

    def _woken_soon(self) -> None:
        self._wake_pending = None
        now = time.monotonic()
        if self._claim_wanted:
            self._claim_wanted = False
            self._looked = now
            self.wake()
        elif now - self._looked >= LOOK_EVERY:
            # Not wanted (none of theirs is known to wait), the relay still looks now and
            # then: another relay may have written deliveries of theirs pending (it could not
            # send them at once while this relay held some), and they are sent now, not at
            # the poll. A look, not a claim: see _look_for_others.
            self._looked = now
            self._look_for_others()
        self._recheck_room()

    def _look_for_others(self) -> None:
        """Claim the deliveries another relay may have written pending (DeliverySource looks
        for them first, and claims only if it finds some)."""
        self.wake()

    def retries_written(self, retries: Iterable[tuple[int, int, float]]) -> None:
        """Retries just written: (delivery id, endpoint id, seconds until due; less than 0:
        due now, in its place). The claim is woken as they come due: nothing else may wake it
        before the poll (the looks read only fresh deliveries); and one its endpoint had no
        room for then is claimed again as the endpoint's deliveries finish (_retry_has_room)."""
        now = time.monotonic()
        self.retries.wrote((i, e, now + max(0.0, delay)) for i, e, delay in retries)
        self._arm_retries()

    def _retry_has_room(self, endpoints: Iterable[int]) -> bool:
        """Whether to claim as deliveries of ``endpoints`` are recorded: a retry this relay
        wrote of one came due and is not claimed yet (its request slots were taken, the claim
        counted them held until now). Ten times a second at most (another relay may have
        claimed it; this one cannot tell until it forgets it, a poll interval after it came
        due): a claim asked for sooner is made then."""
        now = time.monotonic()
        if not any(self.retries.waiting(e, now) for e in endpoints):
            return False
        if now - self._room_claimed < LOOK_EVERY:
            at = self._room_claimed + LOOK_EVERY
            if self._retry_timer is None or self._retry_at > at:
                self._claim_at(at)
            return False
        self._room_claimed = now
        return True

    def _claim_at(self, at: float) -> None:
        """Wake the claim at ``at`` (monotonic): when an open circuit's probe is due, or a
        claim _retry_has_room asked for too soon after the last."""
        self.retries.wake_at(at)
        self._arm_retries()

    def _arm_retries(self) -> None:
        """The claim's wake-up at the next retry due, LOOK_EVERY after the last at the
        earliest: a dead endpoint's retries, each due at its own time (jitter), wake a claim
        ten times a second at most, each taking every one due by then."""
        due = self.retries.next_due()
        if due is None or self._halted:
            return
        at = max(due, self._retry_fired + LOOK_EVERY)
        if self._retry_timer is not None:
            if self._retry_at <= at:
                return
            self._retry_timer.cancel()
        self._retry_at = at
        delay = max(0.0, at - time.monotonic())
        self._retry_timer = asyncio.get_running_loop().call_later(delay, self._retries_due)

    def _retries_due(self) -> None:
        self._retry_timer = None
        self._retry_fired = now = time.monotonic()
        self.retries.came_due(now)
        self.wake()
        self._arm_retries()

    def _recheck_room(self) -> None:
        """The events' claim took fewer than it could (for want of room, or held): wake it
        if it may take more now."""
        if self.held_back and self._room_again():
            self.held_back.clear()
            self.on_room()

    def _recheck_room_at(self, at: float) -> None:
        """Look again at ``at`` (monotonic) whether the events' claim may take more: a hold
        that ends then is not seen by finished deliveries if none is in flight."""
        # When it is due is kept here, in this clock: uvloop hands a handle without when()
        # for a call due at once, and its loop.time() is not time.monotonic().
        if self._recheck is not None and self._recheck_at <= at:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._recheck is not None:
            self._recheck.cancel()
        self._recheck_at = at
        self._recheck = loop.call_later(max(0.0, at - time.monotonic()), self._rechecked)

    def _rechecked(self) -> None:
        self._recheck = None
        self._recheck_room()
