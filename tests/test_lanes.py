"""What a relay keeps of the delivery claim's fresh lane (relay/sinks/endpoints/lanes.py):
pure, no database (mutation-tested: pyproject's [tool.mutmut]). The rules against the
database are in tests/test_delivery_lanes.py."""

from __future__ import annotations

from relay.sinks.endpoints.lanes import CHECK_EVERY, Floors


def test_the_first_read_takes_every_floor_and_the_top() -> None:
    lanes = Floors()
    assert lanes.due(0.0)
    assert lanes.read([(1, 10), (2, 5)], 40, "e1") == []
    assert (lanes.floors, lanes.seen, lanes.epoch) == ({1: 9, 2: 4}, 40, "e1")
    lanes.checked_at = 100.0
    assert not lanes.due(100.0 + CHECK_EVERY - 1) and lanes.due(100.0 + CHECK_EVERY)


def test_a_check_lowers_floors_only_below_what_they_said_before_it() -> None:
    """A check reads in a snapshot taken before claims that commit while it runs: a delivery
    above the floors as they were before it may have been claimed since, and is left to
    the claims; one below them was missed (written late), and lowers its floor."""
    lanes = Floors({1: 9, 2: 4}, seen=40, epoch="e1")
    before = (dict(lanes.floors or {}), lanes.seen)
    lanes.floors = {1: 20, 2: 30}  # claims moved them while the check ran
    # 1: below its floor before (missed); 2: above it (claimed since?); 3: no floor, at or
    # below seen (missed); 4: above seen (the claims' to find).
    missed = lanes.read([(1, 7), (2, 30), (3, 40), (4, 41)], 50, "e1", before)
    assert missed == [1, 3]
    assert lanes.floors == {1: 6, 2: 30, 3: 39}
    assert lanes.seen == 40  # a check never moves seen


def test_a_read_in_another_epoch_takes_everything_afresh() -> None:
    lanes = Floors({1: 9, 2: 4}, seen=40, epoch="e1")
    assert lanes.read([(1, 3)], 5, "e2", ({1: 9, 2: 4}, 40)) == []
    assert (lanes.floors, lanes.seen, lanes.epoch) == ({1: 2}, 5, "e2")


def test_a_claim_moves_the_floors_it_gives_and_drops_an_endpoint_with_none_pending() -> None:
    lanes = Floors({1: 9, 2: 4, 3: 7}, seen=40, epoch="e1")
    given = (dict(lanes.floors or {}), lanes.epoch)
    assert lanes.claimed([(1, 20), (2, None), (5, 44)], 60, "e1", given)
    assert (lanes.floors, lanes.seen) == ({1: 20, 3: 7, 5: 44}, 60)
    assert lanes.as_json() == '{"1":20,"3":7,"5":44}'


def test_a_floor_a_check_lowered_while_a_claim_ran_keeps_the_lower() -> None:
    """The check runs beside the claims: a floor it lowered (a delivery below it) or gave
    (an endpoint that had none) during a claim is not raised again by the claim's answer,
    computed from the floors it was given."""
    lanes = Floors({1: 9, 2: 4}, seen=40, epoch="e1")
    given = (dict(lanes.floors or {}), lanes.epoch)
    lanes.read([(1, 3), (3, 11)], 40, "e1", (dict(given[0]), 40))  # the check
    assert lanes.claimed([(1, 20), (2, None), (3, 30)], 60, "e1", given)
    assert lanes.floors == {1: 2, 3: 10}


def test_a_claim_that_began_before_a_read_afresh_moves_nothing() -> None:
    """A check in a new epoch read everything afresh while a claim ran in the old one's
    floors and seen: the claim's answer is not applied over it (a review's find: the
    claim's seen passed deliveries of endpoints that had no floor)."""
    lanes = Floors({1: 9}, seen=40, epoch="e1")
    given = (dict(lanes.floors or {}), lanes.epoch)
    lanes.read([(2, 3)], 5, "e2", (dict(given[0]), 40))
    assert lanes.claimed([(1, 20)], 60, "e2", given)
    assert (lanes.floors, lanes.seen, lanes.epoch) == ({2: 2}, 5, "e2")


def test_seen_going_back_or_a_new_epoch_drops_every_floor_until_read_again() -> None:
    for seen, epoch in ((39, "e1"), (41, "e2")):
        lanes = Floors({1: 9}, seen=40, epoch="e1")
        assert not lanes.claimed([(1, 20)], seen, epoch, ({1: 9}, "e1"))
        assert lanes.floors is None and lanes.due(0.0) and lanes.as_json() == "{}"
        assert lanes.claimed([(1, 20)], seen, epoch, ({}, None))  # not read: nothing to move


def test_a_claim_that_finds_nothing_new_keeps_the_floors() -> None:
    """seen unchanged (no delivery written since) is no reset; an endpoint walked for its
    deliveries due again only, with no floor, and none fresh, has nothing to drop."""
    lanes = Floors({1: 9}, seen=40, epoch="e1")
    assert lanes.claimed([(7, None)], 40, "e1", ({1: 9}, "e1"))
    assert (lanes.floors, lanes.seen) == ({1: 9}, 40)


def test_a_floor_a_check_moved_during_a_claim_is_kept_whatever_the_claim_said() -> None:
    """The claim said none pending (None), or a floor of its own: the check's stays when it
    is lower, the claim's when that is lower still."""
    lanes = Floors({1: 9, 2: 9}, seen=40, epoch="e1")
    given = ({1: 9, 2: 9}, "e1")
    lanes.floors = {1: 5, 2: 5}  # a check lowered both while the claim ran
    assert lanes.claimed([(1, None), (2, 3)], 40, "e1", given)
    assert lanes.floors == {1: 5, 2: 3}


def test_a_check_never_raises_a_floor_it_finds_a_delivery_below() -> None:
    lanes = Floors({1: 9}, seen=40, epoch="e1")
    lanes.floors = {1: 2}  # lower still than the delivery the check finds
    assert lanes.read([(1, 7)], 40, "e1", ({1: 9}, 40)) == [1]
    assert lanes.floors == {1: 2}
