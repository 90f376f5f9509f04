"""The fair share plan (relay/sinks/endpoints/fairness.py): pure, so every rule is pinned here
with exact figures."""

from __future__ import annotations

import pytest

from relay.sinks.endpoints.fairness import (
    LATENCY_WEIGHT,
    RESERVE,
    Holding,
    average,
    group,
    is_slow,
    plan,
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


def test_slow_endpoints_are_capped_in_both_phases() -> None:
    holdings = [h(1, 3, slow=True, cap=2), h(2, 0, slow=True), h(3, 1)]
    assert plan(40, 4, holdings).caps == {1: 2, 2: 1}
    reserve = plan(40, 35, holdings)
    assert reserve.caps == {1: 2, 2: 1}
    assert reserve.skip_endpoints == {1, 2}  # and none of the reserve


def test_in_the_reserve_holders_at_their_share_take_nothing() -> None:
    # 30 held by 8 endpoints taking every tenant, 2 by two endpoints of tenant t: 9 holders
    # (the tenant's two endpoints are one, u holds nothing), share 40 // 10 = 4.
    holdings = [h(i, 4) for i in range(1, 8)] + [h(8, 2)]
    holdings += [h(9, 1, tenant="t"), h(10, 1, tenant="t"), h(11, 0, tenant="u")]
    p = plan(40, 34, holdings)
    assert p.limit == 4  # at most one share, fewer than the 6 free
    assert p.skip_endpoints == frozenset(range(1, 8))  # 8 holds 2 < 4
    assert p.skip_tenants == frozenset()  # t holds 2 < 4
    p = plan(40, 36, [*holdings, h(12, 2, tenant="t")])  # t now holds 4, its share
    assert p.skip_tenants == {"t"} and 12 not in p.skip_endpoints


def test_the_share_counts_holders_not_endpoints_known() -> None:
    idle = [h(i, 0) for i in range(100)]
    p = plan(40, 32, [h(500, 32, tenant="big"), *idle])
    # One holder: share 40 // 2 = 20; big holds 32.
    assert p.skip_tenants == {"big"} and p.limit == 8
    p = plan(40, 32, [h(500, 19, tenant="big"), h(501, 13)])
    # Two holders: share 13; both at it.
    assert p.skip_tenants == {"big"} and p.skip_endpoints == {501} and p.limit == 8


def test_the_share_is_at_least_one() -> None:
    holdings = [h(i, 1) for i in range(50)]
    p = plan(40, 40 - 3, holdings[:37])
    assert p.limit == 1 and p.skip_endpoints == frozenset(range(37))


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
