"""The plan of deliveries sent at once (relay/sinks/endpoints/at_once.py): which endpoints a
fan-out claims deliveries of as it writes them, how many, and how many events the relay's claim
may take meanwhile. Pure: no database."""

from __future__ import annotations

from relay.sinks.endpoints.at_once import Queue, fits, holds_back, room


def q(
    endpoint: int, in_hand: int = 0, depth: int = 64, backlog: bool = False, quick: bool = True
) -> Queue:
    return Queue(endpoint, depth, in_hand, backlog, quick)


def test_each_endpoint_gets_what_its_queue_lacks_within_what_is_left() -> None:
    assert room([q(1), q(2, in_hand=60), q(3, in_hand=64)], 1000) == {1: 64, 2: 4}
    # A queue over its depth (claims took it past): nothing, and nothing taken from others.
    assert room([q(1, in_hand=70), q(2)], 1000) == {2: 64}
    # What is left is shared in the order given, the last one cut to fit, none after it.
    assert room([q(1), q(2), q(3)], 100) == {1: 64, 2: 36}
    assert room([q(1), q(2)], 64) == {1: 64}
    assert room([q(1)], 0) == {} and room([q(1)], -5) == {}
    # The last delivery of what is left, and the last of a queue, still go (found by mutmut).
    assert room([q(1), q(2)], 65) == {1: 64, 2: 1}
    assert room([q(1, in_hand=63)], 1000) == {1: 1}


def test_an_endpoint_with_a_backlog_gets_no_room_and_leaves_it_to_others() -> None:
    assert room([q(1, backlog=True), q(2)], 64) == {2: 64}


def free(queues: list[Queue], left: int = 1000, fanning: float = 0.0, per: float = 8.0) -> object:
    """fits() of events not held."""
    return fits(queues, left, fanning, per, False)


def test_the_events_claimed_are_those_whose_deliveries_fit() -> None:
    queues = [q(1), q(2)]  # 128 deliveries of room
    assert free(queues) == 16
    assert free(queues, per=3.0) == 42  # rounded down: never more than fit
    # Deliveries of fan-outs in progress take their room first.
    assert free(queues, fanning=64.0) == 8
    # An event makes at least one delivery (matches per event below 1 count as 1).
    assert free(queues, per=0.5) == 128
    # Within what is left of the relay's room, not only the queues'.
    assert free(queues, left=40) == 5
    # An endpoint with a backlog adds no room: the others' pace the events.
    assert free([q(1), q(2, backlog=True)]) == 8


def test_one_event_at_least_when_an_event_has_more_deliveries_than_the_queues() -> None:
    """Twenty endpoints take every event, one of them fast with a queue of 16: 16 // 20 is 0,
    which held the events back for ever."""
    assert free([q(1, depth=16)], per=20.0) == 1


def test_no_events_until_half_of_the_room_there_can_be_is_free() -> None:
    assert free([q(1, in_hand=33)], per=1.0) == 0  # 31 free of 64
    assert free([q(1, in_hand=32)], per=1.0) == 32  # half
    assert free([q(1)], fanning=33.0, per=1.0) == 0  # fan-outs in progress count
    # Half of what the relay has left when that is less than the queues' depth: a relay
    # with a small max_in_flight is not held back for ever.
    assert free([q(1)], left=10, per=1.0) == 10
    assert free([q(1, in_hand=60)], left=10, per=1.0) == 0  # 4 free: less than 5


def test_held_none_and_paced_by_the_endpoints_without_a_backlog_only() -> None:
    assert fits([q(1), q(2)], 1000, 0.0, 8.0, True) == 0
    # An endpoint with a backlog adds no room, and one alone paces nothing: as many as asked.
    assert free([q(1, in_hand=40), q(2, backlog=True)], per=1.0) == 0
    assert free([q(1, in_hand=32), q(2, backlog=True)], per=1.0) == 32
    assert free([q(1, backlog=True), q(2, backlog=True)]) is None


def test_no_fast_endpoint_or_a_busy_relay_claims_as_many_events_as_asked() -> None:
    assert fits([], 1000, 0.0, 8.0, False) is None
    assert fits([], 1000, 0.0, 8.0, True) is None
    # Less than one event's deliveries left: the claim shares the room out (fair share).
    assert free([q(1)], left=7) is None
    assert free([q(1)], left=8) == 1
    assert fits([q(1)], 0, 0.0, 1.0, True) is None  # busy: even when held


def test_only_a_quick_endpoints_backlog_holds_the_events_back() -> None:
    assert holds_back([q(1), q(2, backlog=True)])
    assert not holds_back([q(1), q(2)])
    # Seconds an answer (under its budget): it takes its backlog at its own pace anyway.
    assert not holds_back([q(1), q(2, backlog=True, quick=False)])
    assert not holds_back([q(1, quick=False), q(2)])  # no backlog: nothing to hold for
    assert holds_back([q(1, backlog=True), q(2, backlog=True, quick=False)])
    assert not holds_back([])


def test_full_queues_answering_in_seconds_do_not_pace_an_idle_quick_ones_events() -> None:
    """Found by review: endpoints 2 and 3 answer in 2 s (under their budget: in the plan, not
    quick), their queues full (64 in hand, no backlog the claim serves: it takes none of an
    endpoint with more than 4 x max_concurrency running, so BACKLOG_SERVED lapses). Their depth
    counted in the half-free rule: 96 of 192, while quick endpoint 1, idle, has 64 at most, so
    no event was claimed until the 2 s endpoints drained 32 (8 s at 2 a second each)."""
    slow = [q(2, in_hand=64, quick=False), q(3, in_hand=64, quick=False)]
    assert free([q(1), *slow], left=872, per=3.0) == 21
