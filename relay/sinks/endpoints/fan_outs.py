"""The deliveries source's fan-outs (relay/sinks/endpoints/sink.py hands it the events): each
writes its events' deliveries in one statement (FAN_OUT), claiming those that can be sent at
once (relay/sinks/endpoints/at_once.py) and handing them to the pipeline; and how many events
the relay may claim meanwhile, so that their deliveries can be (Sink.claim_limit). Also the
fair share plan and the count of deliveries in each endpoint's hand, which the claim shares."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import structlog

from outbox.errors import describe
from relay.db.store import DB_ERRORS
from relay.model import Envelope
from relay.sinks.endpoints import at_once
from relay.sinks.endpoints.attempts import PUT_BACK_COOLDOWN, Attempts
from relay.sinks.endpoints.fairness import UNCAPPED, Plan
from relay.sinks.endpoints.fairness import plan as fairness_plan
from relay.sinks.endpoints.rows import Claimed, sent_at_once
from relay.sinks.endpoints.state import EndpointState
from relay.sinks.endpoints.store import DeliveryStore
from relay.sinks.endpoints.together import Together

log = structlog.get_logger("relay.sink.endpoints")

# An endpoint whose deliveries wait for the claim holds the events' claim back (so that the
# claim takes its backlog first, at_once.fits) only while the claim is serving it: claimed
# from this recently. A disabled or deleted endpoint's kept queue must not hold it back.
BACKLOG_SERVED = 2.0
# How long, at most, the events wait for the first answers of endpoints not yet known (one
# event claimed, its deliveries out): fast ones are then sent at their fan-out, slow ones
# take events as any destination does.
PROBE_HOLD = 1.0
# How long the events wait, at most, for the claim to take a fast endpoint's backlog, and how
# often again while it lasts (an endpoint a little slower than the events come): no
# endpoint's new events wait longer than BACKLOG_HOLD for another's backlog.
BACKLOG_HOLD = 1.0
REHOLD_EVERY = 10.0
# The look ahead (_look): how many of a destination's waiting events it reads at most (in
# each lane; with more waiting it tells nothing, and the pace is as without it), how often
# while the pace depends on it, and how long what it saw is used. An endpoint not known here
# stops the pace only if a waiting event would reach it: an event of a new one waits at most
# about AHEAD_FOR behind another's paced backlog. A look that saw a waiting endpoint stops the
# pace for AHEAD_KEPT, however long it took.
AHEAD_EVENTS = 20_000
AHEAD_EVERY = 0.5
AHEAD_FOR = 1.0
AHEAD_KEPT = 10.0
# The most events one fan-out takes of calls gathered while another ran (together.py): more
# wait for the next, so that no statement grows without bound behind a slow one.
FAN_OUT_EVENTS = 2_000


class FanOuts(Attempts):
    """The fan-outs of the deliveries source (DeliverySource, in source.py, is the class to
    use)."""

    # Set by DeliverySource.__init__, which says what each is.
    store: DeliveryStore
    adopt: Callable[[Sequence[Claimed]], None] | None
    _per_event: float
    _fanning: float
    _probed: dict[str, float]
    _hold_since: dict[str, float | None]
    _hold_cleared: set[str]
    _outlasted: set[int]
    _judged: set[str]
    _enabled: dict[str, dict[int, bool]]
    _ahead: dict[str, tuple[float, set[int]]]
    _looking: dict[str, asyncio.Task[None]]
    _look_started: dict[str, float]
    _look_failed: dict[str, float]
    _fanned_top: dict[str, int]
    _waiting: dict[tuple[int, int], EndpointState]
    _broken: dict[tuple[int, int], BaseException]
    _together: Together[tuple[str, str], Envelope, dict[int, int]]

    async def fan_out(self, events: Sequence[Envelope], no_match: str) -> dict[int, int]:
        """Fan out events this relay holds (FAN_OUT): the endpoints matched per event
        recorded. Deliveries of endpoints with room are claimed as they are written and handed
        to the pipeline at once (:attr:`adopt`): they never wait for a claim. The events of
        calls that come while a fan-out of their destination runs go together in the next
        (together.py)."""
        expected = len(events) * self._per_event
        self._fanning += expected
        try:
            # A batch is one destination's.
            matched = await self._together((events[0].destination, no_match), events)
        finally:
            self._fanning -= expected
        return {e.id: matched[e.id] for e in events if e.id in matched}

    async def _fan_out_now(
        self, key: tuple[str, str], events: Sequence[Envelope]
    ) -> dict[int, int]:
        """One fan-out (FAN_OUT) of ``events`` of the destination ``key[0]``."""
        destination, no_match = key
        by_id = {e.id: e for e in events}
        if destination not in self._probed and not self._queues(destination)[0]:
            self._probed[destination] = now = time.monotonic()  # first answers awaited
            self._recheck_room_at(now + PROBE_HOLD)  # none may come: the hold ends then
        matched, sent, until, started = await self.store.fan_out_claiming(
            [(e.id, e.token) for e in events], no_match, lambda: self._room(destination)
        )
        made = sum(matched.values())
        if matched:
            self._per_event = max(1.0, made / len(matched))
        if made > len(sent):
            self.wake()  # some were written pending: the claim takes them
        if sent and self.adopt is not None:
            items = [sent_at_once(r, by_id[r[3]], until, started) for r in sent]
            for c in items:
                self._take(c)
            self.stats["claimed"] += len(items)
            self.stats["sent_at_fan_out"] += len(items)
            self.adopt(items)
        # The last fan-out's highest id, not the highest ever: ids handed out again (a
        # restore, the sequence set back) are read by the next look after the next fan-out.
        self._fanned_top[destination] = max(by_id)
        return matched

    def _look_soon(self, destination: str) -> bool:
        """Read, in a task of its own, which endpoints the destination's next waiting events
        would reach (ENDPOINTS_AHEAD), unless a look is under way or one failed lately.
        Returns whether one is under way (started less than AHEAD_FOR ago): the events are
        paced meanwhile (a claim or two, for the milliseconds it takes)."""
        now = time.monotonic()
        if self._halted:
            return False  # the relay stops: no new task
        task = self._looking.get(destination)
        if task is not None:
            return now - self._look_started[destination] < AHEAD_FOR
        if now - self._look_failed.get(destination, float("-inf")) < AHEAD_FOR:
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False  # no loop to look in (a test's plain call)
        self._look_started[destination] = now
        self._looking[destination] = loop.create_task(self._look(destination, now))
        return True

    async def _look(self, destination: str, started: float) -> None:
        try:
            after = self._fanned_top.get(destination, 0)
            reach = await self.store.ahead(destination, after, AHEAD_EVENTS)
        except asyncio.CancelledError:
            self._looking.pop(destination, None)
            raise
        except Exception as exc:  # the database's, or a bug: no pace on a guess either way
            self._ahead.pop(destination, None)
            self._looking.pop(destination, None)
            self._look_failed[destination] = time.monotonic()
            if isinstance(exc, DB_ERRORS):
                log.warning("relay.endpoints.ahead_read_failed", error=describe(exc))
            else:
                log.exception("relay.endpoints.ahead_read_failed", error=describe(exc))
            return
        self._looking.pop(destination, None)
        if reach is None:  # more waiting than it reads: it tells nothing
            self._ahead.pop(destination, None)
            self._look_failed[destination] = time.monotonic()
        else:
            self._ahead[destination] = (started, reach)
        self._recheck_room()  # held back until the look said whom the events reach

    def fan_out_fits(self, destination: str, limit: int, claiming: bool = True) -> int | None:
        """How many of ``destination``'s events (``limit`` asked for) the relay's claim may take
        so that a fan-out sends their deliveries at once (at_once.fits); None: as many as
        asked. ``claiming``: a claim takes them (else it is a look, which changes nothing).

        While a quick endpoint (at_once.holds_back) has a backlog the claim is serving (or
        deliveries were written that the claim has not read), the events are held,
        BACKLOG_HOLD at most: claimed meanwhile at the pace of the others, each would add a
        delivery to it, and it would never shrink (its deliveries all claimed one by one).
        Held again for a new backlog once a hold ended with every backlog gone, or every
        REHOLD_EVERY while something wants it (_hold_from), unless the hold left a quick endpoint's
        backlog behind (_judge_hold). Paced only while no other endpoint would wait for the
        fast ones (_paceable). While no endpoint is known to be fast and the first requests
        of some are out (or none was seen yet): one event, then none for PROBE_HOLD at
        most."""
        queues, left = self._queues(destination)
        now = time.monotonic()
        if not queues:
            return self._learning(destination, now)
        if not self._paceable(destination, {q.endpoint_id for q in queues}, now):
            return None
        if claiming:
            self._probed.pop(destination, None)
        store = self.store
        unread = store.lanes.floors is None or store.behind
        since = self._hold_since.get(destination)
        # The hold as it stood: whether it ended just now (judged).
        ended = claiming and self._judge_hold(destination, queues, since, now)
        backlog = at_once.holds_back(queues)
        wants = unread or backlog
        gone = not any(q.backlog for q in queues)
        since = self._hold_from(destination, since, now, wants, backlog, gone, claiming, ended)
        hold = wants and since is not None and now - since < BACKLOG_HOLD
        if hold and since is not None:
            self._recheck_room_at(since + BACKLOG_HOLD)
        fits = at_once.fits(queues, left, self._fanning, self._per_event, hold)
        if claiming:
            self._hold_since[destination] = since
        return fits

    def _hold_from(
        self,
        destination: str,
        since: float | None,
        now: float,
        wants: bool,
        backlog: bool,
        gone: bool,
        claiming: bool,
        ended: bool,
    ) -> float | None:
        """When the events' hold began, or None. One every BACKLOG_HOLD + REHOLD_EVERY at most
        (a latency around the quick line, or deliveries written that the claim has not read
        yet, come and go: each would start a hold afresh). But when the last hold ``ended``
        (judged just now) with every backlog ``gone``, a quick endpoint's new ``backlog``
        starts one at once: in a drain the endpoints' pace drifts apart every few seconds,
        and a backlog that waited for REHOLD_EVERY had a delivery added by each event claimed
        meanwhile, each then claimed on its own (PostgreSQL's time a delivery doubled). A
        hold that left a backlog behind, claimed seconds later (its endpoint over the quick
        line as it ended, or forgiven, _judge_hold), failed: the next waits REHOLD_EVERY."""
        cleared = self._hold_cleared
        if since is not None and now - since >= BACKLOG_HOLD:
            if gone:
                if ended:
                    cleared.add(destination)
            elif backlog and destination in cleared:
                since = None
        if since is not None and now - since >= BACKLOG_HOLD + REHOLD_EVERY:
            since = None
        if since is None:
            if claiming:
                cleared.discard(destination)
            if wants:
                since = now
                if claiming:
                    # A new hold, judged once it is over, even if no claim comes meanwhile
                    # (_judge_hold ran before, on the last one).
                    self._judged.discard(destination)
        return since

    def _judge_hold(
        self, destination: str, queues: list[at_once.Queue], since: float | None, now: float
    ) -> bool:
        """Once a hold is over: the endpoints whose backlog it held the events for and did not
        clear hold them no more (not quick, _queues) until their fresh deliveries are all
        claimed. They do not keep up with their events (an endpoint answering in 50 ms takes 80
        a second at max_concurrency 4): held again every REHOLD_EVERY, every other endpoint's
        new events would wait a second in eleven, for ever, and theirs no shorter. Not one
        over the quick line at this moment (a healthy endpoint slowed by the start, or a
        burst): judged, it would stay out of the holds, its backlog growing by a delivery an
        event, claimed one by one, for as long as its events come (a steady run fell behind
        by seconds). Returns whether it judged a hold just now."""
        floors = self.store.lanes.floors
        if floors is not None:
            self._outlasted.intersection_update(floors)
        if since is None or now - since < BACKLOG_HOLD:
            self._judged.discard(destination)  # none, or under way: judged once it is over
            return False
        if destination in self._judged:
            return False
        self._judged.add(destination)
        self._outlasted.update(q.endpoint_id for q in queues if q.backlog and q.quick)
        return True

    def _paceable(self, destination: str, fast: set[int], now: float) -> bool:
        """Whether the destination's events may be paced by its fast endpoints' room: every
        other enabled endpoint that its next waiting events would reach (the look ahead, when
        fresh: _look) or else every other enabled one is down, gone or sending already (its
        deliveries wait their turn anyway). One rate-limited, not yet known here, or idle
        would wait, its events behind a burst of the fast ones' in the table: then the events
        are claimed as for any destination."""
        enabled = self._enabled.get(destination)
        if enabled is None:
            return False
        look = self._ahead.get(destination)
        if look is not None and now - look[0] < AHEAD_KEPT:
            # Reached, and not read as enabled yet: a new one, not known here either.
            waits = any(
                e not in fast and self._would_wait(e, enabled.get(e, False)) for e in look[1]
            )
            if waits:  # whatever the look's age: it found one
                if now - look[0] >= AHEAD_EVERY:
                    self._look_soon(destination)
                return False
            if now - look[0] < AHEAD_FOR:
                if now - look[0] >= AHEAD_EVERY:
                    self._look_soon(destination)  # kept fresh while it is used
                return True
        for endpoint, limited in enabled.items():
            if endpoint not in fast and self._would_wait(endpoint, limited):
                # Whether the next events reach it is not known: paced only while a look
                # says (in milliseconds), not on a guess.
                return self._look_soon(destination)
        return True

    def _would_wait(self, endpoint: int, limited: bool) -> bool:
        """Whether an endpoint (not a fast one) would wait behind a burst of the fast ones'
        deliveries: rate-limited, not known here, or neither down nor sending already (slow
        ones too: an idle slow one has room for its next events)."""
        state = self.states.get(endpoint)
        if limited or state is None:
            return True
        return not (state.circuit_open or state.gone or state.in_hand > 0)

    def _learning(self, destination: str, now: float) -> int | None:
        """fan_out_fits while no endpoint of ``destination`` is known to be fast."""
        learning = not self.states or any(
            s.latency is None and s.in_hand for s in self.states.values()
        )
        probed = self._probed.get(destination)
        if not learning or (probed is not None and now - probed >= PROBE_HOLD):
            return None
        if probed is None:
            return 1
        self._recheck_room_at(probed + PROBE_HOLD)
        return 0

    def _room_again(self) -> bool:
        """Whether a destination held back may take events now."""
        for destination in list(self.held_back):
            fits = self.fan_out_fits(destination, self.max_in_flight, claiming=False)
            if fits is None or fits > 0:
                return True
        return False

    def _room(self, destination: str) -> dict[int, int]:
        """FAN_OUT's room: the endpoints a fan-out may claim deliveries of as it writes them,
        and how many (at_once.room). FAN_OUT also sends none of an endpoint that is
        rate-limited, held by another relay or has deliveries waiting, as the claim sees it."""
        if self._halted or self.adopt is None:
            return {}
        return at_once.room(*self._queues(destination))

    def _queues(self, destination: str) -> tuple[list[at_once.Queue], int]:
        """The endpoints of ``destination`` known to be fast (not slow, new, rate-limited, put
        back lately, gone or with its circuit open) and how many deliveries a fan-out may
        queue here in all: none while the fair share plan holds anyone back (the claim then
        shares the room)."""
        holding = self.store.holding()
        left = self.max_in_flight // 2 - holding
        share = self._plan(holding)
        if share.skip_endpoints or share.skip_tenants:
            return [], 0
        floors = self.store.lanes.floors or {}
        now = time.monotonic()
        queues = [
            at_once.Queue(
                s.id,
                self.destinations[s.destination].max_concurrency * at_once.FAN_OUT_AHEAD,
                s.in_hand,
                s.id in floors and now - s.last_claimed < BACKLOG_SERVED,
                # Its queue answered within the hold (latency is known: _eligible), and no hold
                # left its backlog behind (_judge_hold).
                (s.latency or 0.0) * at_once.FAN_OUT_AHEAD <= BACKLOG_HOLD
                and s.id not in self._outlasted,
            )
            for s in self.states.values()
            if s.destination == destination
            and share.caps.get(s.id) == UNCAPPED
            and self._eligible(s, now)
        ]
        return queues, left

    def _waits(self, endpoint: int) -> bool:
        """Whether a delivery of ``endpoint`` may wait for a claim: it has a floor (a fresh
        one pending), the claim has not read every delivery written, or the floors are not
        read yet. (Deliveries due again wake the claim when they are written pending, when
        reaped, when this relay's come due (DueRetries), or at its poll.)"""
        floors = self.store.lanes.floors
        return floors is None or self.store.behind or endpoint in floors

    def _eligible(self, s: EndpointState, now: float) -> bool:
        """Known to be fast, and nothing keeps its deliveries from being sent now."""
        return (
            s.destination in self.destinations
            and s.latency is not None
            and not s.holding(now).slow
            and not s.rate_limited
            and not s.circuit_open
            and not s.gone
            and now - s.put_back_at >= PUT_BACK_COOLDOWN
        )

    def _plan(self, held: int) -> Plan:
        """The fair share plan (fairness.py) with ``held`` deliveries held: from the
        endpoints this relay holds deliveries of, and those it knows to be slow."""
        now = time.monotonic()
        holdings = []
        for state in self.states.values():
            h = state.holding(now)
            if h.in_hand or h.known:
                holdings.append(h)
        return fairness_plan(self.max_in_flight, held, holdings)

    def _take(self, c: Claimed) -> None:
        """Count a claimed delivery in its endpoint's hand (the next plan sees it); a row
        whose endpoint this code cannot even read (a bug) is kept to be recorded as a crash."""
        key = (c.id, c.token)
        self.retries.claimed(c.id)
        try:
            state = self._state(c)
        except Exception as exc:
            log.exception("relay.endpoints.delivery_crashed", delivery=c.id)
            self._broken[key] = exc
            return
        state.in_hand += 1
        state.last_claimed = time.monotonic()
        state.rate_limited = c.rate_limit is not None
        self._waiting[key] = state
