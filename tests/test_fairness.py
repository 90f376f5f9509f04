"""The fair share plan (relay/sinks/endpoints/fairness.py): pure, so every rule is pinned here
with exact figures."""

from __future__ import annotations

import pytest

from relay.sinks.endpoints.fairness import (
    LATENCY_WEIGHT,
    RESERVE,
    UNCAPPED,
    Holding,
    average,
    group,
    is_slow,
    plan,
    share,
)


def h(
    eid: int,
    in_hand: int,
    *,
    tenant: str | None = None,
    slow: bool = False,
    known: bool = True,
    cap: int = 1,
) -> Holding:
    return Holding(eid, tenant, in_hand, slow, cap, known=known)


def test_the_reserve_is_a_quarter() -> None:
    assert RESERVE == 0.25


def test_a_full_relay_claims_nothing() -> None:
    assert plan(40, 40, [h(1, 40)]).limit == 0
    assert plan(40, 41, []).limit == 0  # more held than the capacity (a stale claim)
    assert plan(40, 39, []).limit == 1
    assert plan(40, 41, [h(1, 2, slow=True)]).caps == {1: 1}  # caps whatever is free


def test_the_reserve_begins_where_only_a_quarter_is_free() -> None:
    holdings = [h(1, 30)]
    assert plan(40, 29, holdings).skip_endpoints == frozenset()  # 11 free: not yet
    at = plan(40, 30, holdings)  # 10 free: the reserve
    assert at.skip_endpoints == {1} and at.limit == 10  # share 40 // 2 = 20


def test_while_more_than_the_reserve_is_free_anyone_claims_all_but_the_reserve() -> None:
    p = plan(40, 0, [])
    assert (p.limit, p.skip_endpoints, p.skip_tenants, p.caps) == (30, frozenset(), frozenset(), {})
    p = plan(40, 29, [h(1, 29, tenant="big")])  # 11 free, reserve 10
    assert (p.limit, p.skip_endpoints, p.skip_tenants) == (1, frozenset(), frozenset())


def test_known_endpoints_are_capped_by_their_latency_and_new_ones_start_slow() -> None:
    holdings = [h(1, 3, slow=True, cap=2), h(2, 0, slow=True), h(3, 1), h(4, 1, known=False)]
    p = plan(40, 5, holdings)
    # 4 is missing: the claim starts it at its destination's slow_concurrency.
    assert p.caps == {1: 2, 2: 1, 3: UNCAPPED}
    reserve = plan(40, 35, holdings)
    assert reserve.caps == p.caps
    assert reserve.skip_endpoints == {1, 2, 4}  # slow, or not yet known: none of the reserve


def test_the_share_is_filled_like_water() -> None:
    assert share(40, []) == 40.0  # a newcomer alone may have it all
    assert share(40, [30]) == 20.0
    # The four holders of one slot leave theirs to the rest: (40 - 4) / 2.
    assert share(40, [1, 1, 1, 30]) == pytest.approx(18.5)
    assert share(10, [5, 5]) == pytest.approx(10 / 3)
    assert share(40, [1] * 37) == pytest.approx(3.0)  # all below: the free slots
    assert share(40, [30, 1, 1, 1]) == share(40, [1, 1, 30, 1])  # order does not matter


def test_in_the_reserve_holders_at_their_share_take_nothing() -> None:
    # Tenant t holds 30 over two endpoints, four endpoints one each: share 18.
    holdings = [h(1, 20, tenant="t"), h(2, 10, tenant="t")]
    holdings += [h(i, 1) for i in range(3, 7)] + [h(7, 0, tenant="u")]
    p = plan(40, 34, holdings)
    assert p.skip_tenants == {"t"} and p.skip_endpoints == frozenset()
    assert p.limit == 6  # the free slots, fewer than a share
    # An endpoint taking every tenant is a group of its own.
    q = plan(40, 34, [h(1, 30), *holdings[2:]])
    assert q.skip_endpoints == {1} and q.skip_tenants == frozenset()


def test_the_share_counts_holders_not_endpoints_known() -> None:
    idle = [h(i, 0) for i in range(100)]
    p = plan(40, 32, [h(500, 32, tenant="big"), *idle])
    # One holder: share 40 / 2 = 20; big holds 32.
    assert p.skip_tenants == {"big"} and p.limit == 8
    p = plan(40, 32, [h(500, 19, tenant="big"), h(501, 13)])
    # Two holders: share (40 - 13) / 2 = 13.5; big is past it, 501 below.
    assert p.skip_tenants == {"big"} and p.skip_endpoints == frozenset() and p.limit == 8


def test_a_claim_in_the_reserve_takes_at_most_a_share() -> None:
    p = plan(40, 33, [h(1, 30, tenant="t"), h(2, 3, tenant="u")])
    # share: 3 < 40/3, then (40 - 3) / 2 = 18.5; the claim takes at most 19, here the 7 free.
    assert p.limit == 7
    p = plan(10, 8, [h(i, 1) for i in range(8)])  # share (10 - 8) / 1 = 2
    assert p.limit == 2


def test_endpoints_with_requests_in_flight_and_none_ended_wait_in_the_reserve() -> None:
    p = plan(40, 35, [h(1, 2, known=False), h(2, 0, known=False), h(3, 2)])
    assert p.skip_endpoints == {1}  # 2 holds nothing yet: it may take its first
    assert plan(40, 0, [h(1, 2, known=False)]).skip_endpoints == frozenset()


def test_groups() -> None:
    assert group(h(7, 0)) == "endpoint:7"
    assert group(h(7, 0, tenant="acme")) == "tenant:acme"
    assert group(h(7, 0, tenant="7")) != group(h(7, 0))


def test_the_latency_average() -> None:
    assert average(None, 2.5) == 2.5
    assert average(1.0, 2.0) == pytest.approx(1.0 + LATENCY_WEIGHT)
    assert LATENCY_WEIGHT == 0.3
    assert average(4.0, 0.0) == pytest.approx(2.8)


def test_slow_on_average_or_with_a_request_in_flight_past_the_budget() -> None:
    assert not is_slow(None, [], 100.0, 2.0)
    assert not is_slow(2.0, [], 100.0, 2.0)  # at the budget: not past it
    assert is_slow(2.01, [], 100.0, 2.0)
    assert not is_slow(0.1, [98.0], 100.0, 2.0)
    assert is_slow(0.1, [99.0, 97.9], 100.0, 2.0)
    assert is_slow(None, [97.0], 100.0, 2.0)


def test_holders_of_one_slot_leave_theirs_to_the_others() -> None:
    # Eight endpoints holding one each and tenant A eight: share (20 - 8) / 2 = 6.
    holdings = [h(i, 1) for i in range(8)] + [h(100, 8, tenant="A")]
    p = plan(20, 16, holdings)
    assert p.skip_tenants == {"A"} and p.skip_endpoints == frozenset()


def test_a_holder_exactly_at_its_share_is_full() -> None:
    holdings = [h(1, 10, tenant="a"), h(2, 10, tenant="b"), h(3, 10, tenant="c")]
    p = plan(40, 30, holdings)  # share 40 / 4 = 10, each at it
    assert p.skip_tenants == {"a", "b", "c"} and p.limit == 10
