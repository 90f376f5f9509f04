"""The plan of deliveries sent at once (relay/sinks/endpoints/at_once.py): which endpoints a
fan-out claims deliveries of as it writes them, how many, and how many events the relay's claim
may take meanwhile. Pure: no database."""

from __future__ import annotations

from relay.sinks.endpoints.at_once import Queue, fits, room


def q(endpoint: int, in_hand: int = 0, depth: int = 64, backlog: bool = False) -> Queue:
    return Queue(endpoint, depth, in_hand, backlog)


def test_each_endpoint_gets_what_its_queue_lacks_within_what_is_left() -> None:
    assert room([q(1), q(2, in_hand=60), q(3, in_hand=64)], 1000) == {1: 64, 2: 4}
    # A queue over its depth (claims took it past): nothing, and nothing taken from others.
    assert room([q(1, in_hand=70), q(2)], 1000) == {2: 64}
    # What is left is shared in the order given, the last one cut to fit, none after it.
    assert room([q(1), q(2), q(3)], 100) == {1: 64, 2: 36}
    assert room([q(1), q(2)], 64) == {1: 64}
    assert room([q(1)], 0) == {} and room([q(1)], -5) == {}


def test_an_endpoint_with_a_backlog_gets_no_room_and_leaves_it_to_others() -> None:
    assert room([q(1, backlog=True), q(2)], 64) == {2: 64}


def test_the_events_claimed_are_those_whose_deliveries_fit() -> None:
    queues = [q(1), q(2)]  # 128 deliveries of room
    assert fits(queues, 1000, 0.0, 8.0, False) == 16
    assert fits(queues, 1000, 0.0, 3.0, False) == 42  # rounded down: never more than fit
    # Deliveries of fan-outs in progress take their room first.
    assert fits(queues, 1000, 64.0, 8.0, False) == 8
    # An event makes at least one delivery (matches per event below 1 count as 1).
    assert fits(queues, 1000, 0.0, 0.5, False) == 128
    # Within what is left of the relay's room, not only the queues'.
    assert fits(queues, 40, 0.0, 8.0, False) == 5


def test_no_events_until_half_of_the_room_there_can_be_is_free() -> None:
    assert fits([q(1, in_hand=33)], 1000, 0.0, 1.0, False) == 0  # 31 free of 64
    assert fits([q(1, in_hand=32)], 1000, 0.0, 1.0, False) == 32  # half
    assert fits([q(1)], 1000, 33.0, 1.0, False) == 0  # fan-outs in progress count
    # Half of what the relay has left when that is less than the queues' depth: a relay
    # with a small max_in_flight is not held back for ever.
    assert fits([q(1)], 10, 0.0, 1.0, False) == 10
    assert fits([q(1, in_hand=60)], 10, 0.0, 1.0, False) == 0  # 4 free: less than 5


def test_a_backlog_or_deliveries_not_yet_read_hold_the_events_back() -> None:
    assert fits([q(1), q(2, backlog=True)], 1000, 0.0, 8.0, False) == 0
    assert fits([q(1)], 1000, 0.0, 8.0, True) == 0


def test_no_fast_endpoint_or_a_busy_relay_claims_as_many_events_as_asked() -> None:
    assert fits([], 1000, 0.0, 8.0, False) is None
    assert fits([], 1000, 0.0, 8.0, True) is None
    # Less than one event's deliveries left: the claim shares the room out (fair share).
    assert fits([q(1)], 7, 0.0, 8.0, False) is None
    assert fits([q(1)], 8, 0.0, 8.0, False) == 1
    assert fits([q(1, backlog=True)], 0, 0.0, 1.0, True) is None
