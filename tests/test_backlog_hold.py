"""The events' hold for a quick endpoint's backlog (FanOuts.fan_out_fits): BACKLOG_HOLD at
most; again for a new backlog once the last is gone, or every REHOLD_EVERY, unless a hold
left a backlog behind. Pure but the last: no database, a fake clock."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from relay.sinks.endpoints import fan_outs
from relay.sinks.endpoints.at_once import Queue
from relay.sinks.endpoints.fan_outs import BACKLOG_HOLD, REHOLD_EVERY, FanOuts


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The fan-outs' monotonic clock, set by the test (clock[0])."""
    now = [100.0]
    monkeypatch.setattr(fan_outs, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


class Plan(FanOuts):
    """fan_out_fits with its inputs given: the queues, a paceable destination."""

    def __init__(self) -> None:
        self.queues: list[Queue] = []
        self.store = SimpleNamespace(lanes=SimpleNamespace(floors={}), behind=False)  # type: ignore[assignment]
        self._hold_since = {}
        self._hold_cleared = set()
        self._outlasted = set()
        self._judged = set()
        self._probed = {}
        self._fanning = 0.0
        self._per_event = 2.0

    def _queues(self, destination: str) -> tuple[list[Queue], int]:
        # As FanOuts._queues: an endpoint a hold left a backlog behind is not quick.
        out = self.queues
        return [
            replace(q, quick=q.quick and q.endpoint_id not in self._outlasted) for q in out
        ], 1000

    def _paceable(self, destination: str, fast: set[int], now: float) -> bool:
        return True

    def _recheck_room_at(self, when: float) -> None:
        pass


def test_a_latency_around_the_quick_line_does_not_hold_the_events_again_before_rehold_every(
    clock: list[float],
) -> None:
    """Found by review: endpoint 2, answering in about 62 ms (FAN_OUT_AHEAD x latency about
    BACKLOG_HOLD), has a backlog the claim serves all along. Its latency average crosses the
    quick line now and then (one answer in 70 ms, or a hiccup of a second, then back): each
    time it came back quick the events were held a second afresh, not once every
    REHOLD_EVERY, and every endpoint's new events with them."""
    plan = Plan()

    def at(t: float, quick: bool) -> int | None:
        clock[0] = 100.0 + t
        plan.queues = [Queue(1, 64, 0), Queue(2, 64, 64, backlog=True, quick=quick)]
        return plan.fan_out_fits("d", 100)

    assert at(0.0, True) == 0  # held: the claim takes the backlog
    assert at(BACKLOG_HOLD + 0.5, True) != 0  # the hold is over
    assert at(BACKLOG_HOLD + 1.0, False) != 0  # an answer of 70 ms
    # Quick again, the same backlog: not held again before REHOLD_EVERY.
    assert at(BACKLOG_HOLD + 1.1, True) != 0
    assert at(BACKLOG_HOLD + REHOLD_EVERY + 0.1, True) == 0  # then held again


def test_an_endpoint_over_the_quick_line_when_a_hold_ends_is_not_judged(clock: list[float]) -> None:
    """Found measuring isolation (bench fanout --compare at 500 events a second): judged
    whatever its latency, a healthy endpoint slowed by the start-up was left out of the holds
    for good, its backlog growing by a delivery an event and claimed one by one, and the run
    fell seconds behind. Over the line, it is not judged; its backlog, still there, does not
    hold the events again before REHOLD_EVERY either (it never went)."""
    plan = Plan()
    plan.store.lanes.floors[2] = 10  # its deliveries wait for the claim

    def at(t: float, quick: bool) -> int | None:
        clock[0] = 100.0 + t
        plan.queues = [Queue(1, 64, 0), Queue(2, 64, 64, backlog=True, quick=quick)]
        return plan.fan_out_fits("d", 100)

    assert at(0.0, True) == 0
    assert at(BACKLOG_HOLD + 0.5, False) != 0  # over, and over the line
    assert plan._outlasted == set()
    assert at(BACKLOG_HOLD + 0.6, True) != 0  # quick again, the same backlog
    assert at(BACKLOG_HOLD + REHOLD_EVERY + 0.1, True) == 0


def test_a_new_backlog_after_a_hold_that_cleared_the_last_is_held_for_at_once(
    clock: list[float],
) -> None:
    """Found measuring drains (bench fanout --scenario drain): the endpoints' pace drifts apart
    every few seconds, and a backlog that came within REHOLD_EVERY of the last hold was not
    held for: each event claimed meanwhile added a delivery to it, written pending for a claim
    of its own (about 10,000 of 160,000 deliveries; PostgreSQL's time a delivery doubled)."""
    plan = Plan()
    floors = plan.store.lanes.floors

    def at(t: float, backlog: bool) -> int | None:
        clock[0] = 100.0 + t
        plan.queues = [Queue(1, 64, 0), Queue(2, 64, 0, backlog=backlog)]
        return plan.fan_out_fits("d", 100)

    floors[2] = 10
    assert at(0.0, True) == 0
    del floors[2]  # claimed within the hold
    assert at(BACKLOG_HOLD + 0.1, False) != 0 and plan._outlasted == set()
    floors[2] = 20  # a second later, another
    assert at(BACKLOG_HOLD + 1.1, True) == 0  # held for at once
    assert at(2 * BACKLOG_HOLD + 1.0, True) == 0  # for BACKLOG_HOLD
    assert at(2 * BACKLOG_HOLD + 1.2, True) != 0  # no longer


def test_an_endpoint_whose_backlog_outlasts_a_hold_holds_the_events_no_more(
    clock: list[float],
) -> None:
    """Found by review: endpoint 2 answers in 50 ms (quick), 80 a second at max_concurrency 4,
    for events that come faster: its backlog never clears, and it held every endpoint's new
    events a second in every eleven, for ever. A hold that leaves its backlog behind is its
    last, until its fresh deliveries are all claimed."""
    plan = Plan()
    floors = plan.store.lanes.floors

    def at(t: float, backlog: bool = True) -> int | None:
        clock[0] = 100.0 + t
        plan.queues = [Queue(1, 64, 0), Queue(2, 64, 64, backlog=backlog)]
        return plan.fan_out_fits("d", 100)

    floors[2] = 10
    assert at(0.0) == 0 and plan._outlasted == set()  # held for it
    assert at(0.5) == 0 and plan._outlasted == set()  # under way: not judged yet
    assert at(BACKLOG_HOLD + 0.1) != 0
    assert plan._outlasted == {2}  # the hold is over, and the backlog is still there
    assert plan._judged == {"d"}  # once a hold: later claims do not judge it again
    # Its fresh deliveries all claimed: it is forgiven, and may hold the events again.
    del floors[2]
    at(BACKLOG_HOLD + 0.3, backlog=False)
    assert plan._outlasted == set()


def test_a_hold_that_clears_the_backlog_leaves_its_endpoint_quick(clock: list[float]) -> None:
    plan = Plan()

    def at(t: float, backlog: bool) -> int | None:
        clock[0] = 100.0 + t
        plan.queues = [Queue(1, 64, 0), Queue(2, 64, 0, backlog=backlog)]
        return plan.fan_out_fits("d", 100)

    plan.store.lanes.floors[2] = 10
    assert at(0.0, True) == 0
    del plan.store.lanes.floors[2]
    assert at(BACKLOG_HOLD + 0.1, False) != 0
    assert plan._outlasted == set()
    # Another backlog after REHOLD_EVERY is held for again.
    plan.store.lanes.floors[2] = 20
    assert at(BACKLOG_HOLD + REHOLD_EVERY + 0.2, True) == 0


def test_deliveries_the_claim_has_not_read_hold_the_events_once_every_rehold_every(
    clock: list[float],
) -> None:
    """Found measuring isolation (bench fanout --compare, 500 events a second): beside a dead
    endpoint every fan-out writes a delivery pending, which the claim has not read for a
    moment (store.behind). A first try let anything that wants a hold start one as soon as
    the last was over: these did too, a hold every second or so, and its isolation run
    measured the healthy p99 3.6 times the run without the pair. Only a quick endpoint's new
    backlog starts one early."""
    plan = Plan()

    def at(t: float, behind: bool) -> int | None:
        clock[0] = 100.0 + t
        plan.store.behind = behind
        plan.queues = [Queue(1, 64, 0), Queue(2, 64, 0)]
        return plan.fan_out_fits("d", 100)

    assert at(0.0, True) == 0  # held until the claim has read them
    assert at(0.1, False) != 0
    assert at(BACKLOG_HOLD + 0.5, False) != 0
    assert at(BACKLOG_HOLD + 0.6, True) != 0  # not again so soon
    assert at(BACKLOG_HOLD + REHOLD_EVERY + 0.1, True) == 0  # then again


def test_a_hold_no_claim_looked_at_while_it_ran_is_judged_once_it_is_over(
    clock: list[float],
) -> None:
    """Found by review: the hold is judged at the first claim after it ends, and a claim
    that starts a hold judged the one before first: nothing said the new one was still to
    be judged. Claims come at a hold's edges only (the recheck at its end; in a drain no
    NOTIFY wakes them, the poll is 0.8-1.2 s): a hold begun after the first (a new backlog,
    or REHOLD_EVERY) was never judged, and a backlog it left behind held every endpoint's
    events again, a second in every eleven, for ever."""
    plan = Plan()
    floors = plan.store.lanes.floors

    def at(t: float, backlog: bool) -> int | None:
        clock[0] = 100.0 + t
        if backlog:
            floors[2] = 10
        else:
            floors.pop(2, None)
        plan.queues = [Queue(1, 64, 0), Queue(2, 64, 64, backlog=backlog)]
        return plan.fan_out_fits("d", 100)

    assert at(0.0, True) == 0
    assert at(BACKLOG_HOLD + 0.1, False) != 0  # the first hold cleared it
    assert at(2.0, True) == 0  # a new backlog: held for at once
    # No claim while it runs; over, its backlog is still there.
    assert at(2.0 + BACKLOG_HOLD + 0.1, True) != 0
    assert plan._outlasted == {2}
    assert at(2.0 + BACKLOG_HOLD + REHOLD_EVERY + 0.1, True) != 0  # not held again


def test_a_rehold_no_claim_looked_at_while_it_ran_is_judged_once_it_is_over(
    clock: list[float],
) -> None:
    """As above, for a hold begun REHOLD_EVERY after the last."""
    plan = Plan()
    floors = plan.store.lanes.floors
    floors[2] = 10

    def at(t: float, quick: bool) -> int | None:
        clock[0] = 100.0 + t
        plan.queues = [Queue(1, 64, 0), Queue(2, 64, 64, backlog=True, quick=quick)]
        return plan.fan_out_fits("d", 100)

    assert at(0.0, True) == 0
    assert at(BACKLOG_HOLD + 0.1, False) != 0 and plan._outlasted == set()  # over the line
    assert at(BACKLOG_HOLD + REHOLD_EVERY + 0.05, True) == 0  # held again
    assert at(2 * BACKLOG_HOLD + REHOLD_EVERY + 0.1, True) != 0
    assert plan._outlasted == {2}  # this one left it behind, quick


def test_a_hold_that_left_a_backlog_behind_does_not_let_the_next_begin_early(
    clock: list[float],
) -> None:
    """Found by review: a hold whose backlog outlasted it (its endpoint over the quick line
    as it ended: not judged) let the next start at once when that backlog was claimed later,
    seconds after the hold: an endpoint around the quick line held every endpoint's events a
    second in every 2.5 (here), not one in eleven. Only a hold that cleared every backlog
    lets a new one hold the events at once."""
    plan = Plan()
    floors = plan.store.lanes.floors

    def at(t: float, backlog: bool, quick: bool = True) -> int | None:
        clock[0] = 100.0 + t
        if backlog:
            floors[2] = 10
        else:
            floors.pop(2, None)
        plan.queues = [Queue(1, 64, 0), Queue(2, 64, 64, backlog=backlog, quick=quick)]
        return plan.fan_out_fits("d", 100)

    held = []
    for start in (0.0, 2.5, 5.0, 7.5, 10.0):
        held.append(at(start, True) == 0)
        at(start + 0.5, True)
        at(start + BACKLOG_HOLD + 0.05, True, quick=False)  # over the line: not judged
        at(start + 2.0, False)  # claimed after the hold
    assert held == [True, False, False, False, False]
