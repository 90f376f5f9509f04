"""A fair share of a relay's deliveries in flight, per endpoint and per tenant.

A relay holds at most ``max_in_flight`` deliveries. Left alone, endpoints that answer slowly
but successfully (never opening a circuit) keep theirs for seconds each, and enough of them
(ten slow endpoints at max_concurrency 4 beside max_in_flight 40; or 500 endpoints of one
tenant at the defaults) hold every slot while healthy endpoints wait. The claim therefore
follows a plan made from what the relay holds:

* While more than a quarter of the capacity is free, any endpoint may take slots, up to
  its max_concurrency (counted across relays by the claim) and, while it is slow or not yet
  known (no request of it ended on this relay: it starts slow), up to its destination's
  ``slow_concurrency``: the last quarter is kept back.
* Once only that reserve is left, it goes to those below their fair share: a tenant (or an
  endpoint that takes every tenant) holding its share (max-min: :func:`share`) takes
  nothing more, and neither do slow endpoints, nor those with requests in flight and none
  ended yet (slow ones in the making, as far as anyone knows). A claim then takes at most
  one share.

So no endpoint or tenant takes the last quarter while others wait, slow endpoints never
hold it, and as the holders' requests end, each is held to its share. An endpoint is slow
when its requests' moving average, or one of its requests still in flight, is past the
destination's ``latency_budget``.

Pure: the deliveries source passes what it holds and applies the plan to its claim statement.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

RESERVE = 0.25  # of the capacity, kept for holders below their share
UNCAPPED = 100_000  # the cap of an endpoint known to be fast: its max_concurrency applies
# The weight of the newest request in an endpoint's latency average.
LATENCY_WEIGHT = 0.3


@dataclass(frozen=True, slots=True)
class Holding:
    """What the plan needs to know of one endpoint this relay holds deliveries of."""

    endpoint_id: int
    tenant: str | None  # None: the endpoint takes every tenant, a group of its own
    in_hand: int
    slow: bool
    slow_concurrency: int = 1  # its destination's: a slow endpoint's cap
    known: bool = True  # a request of it has ended: its latency is known


@dataclass(frozen=True, slots=True)
class Plan:
    """What the next claim may take."""

    limit: int  # deliveries in all
    skip_endpoints: frozenset[int]  # endpoints that take nothing this claim
    skip_tenants: frozenset[str]  # tenants none of whose endpoints takes anything
    # Each known endpoint's cap on requests in flight (UNCAPPED: its max_concurrency); one
    # missing starts at its destination's slow_concurrency.
    caps: dict[int, int]


def group(h: Holding) -> str:
    """The tenant of an endpoint, or a name of its own for one that takes every tenant."""
    return f"tenant:{h.tenant}" if h.tenant is not None else f"endpoint:{h.endpoint_id}"


def plan(capacity: int, held: int, holdings: Iterable[Holding]) -> Plan:
    """The next claim's plan, with ``held`` deliveries of ``capacity`` held now; ``holdings``
    the endpoints this relay holds deliveries of or knows the latency of."""
    holdings = list(holdings)
    # An endpoint missing from the caps starts slow (its destination's slow_concurrency)
    # until one of its requests ends: what it costs is unknown until then.
    caps = {h.endpoint_id: h.slow_concurrency if h.slow else UNCAPPED for h in holdings if h.known}
    free = max(0, capacity - held)
    reserve = int(capacity * RESERVE)
    if free > reserve:
        return Plan(free - reserve, frozenset(), frozenset(), caps)
    usage: Counter[str] = Counter()
    for h in holdings:
        usage[group(h)] += h.in_hand
    level = share(capacity, [n for n in usage.values() if n > 0])
    full = {g for g, n in usage.items() if n >= level}
    skip_endpoints = frozenset(
        h.endpoint_id
        for h in holdings
        if h.slow
        # Not yet known to be fast: its first requests may well be slow ones in the making.
        or (h.in_hand and not h.known)
        or (h.tenant is None and group(h) in full)
    )
    skip_tenants = frozenset(
        h.tenant for h in holdings if h.tenant is not None and group(h) in full
    )
    return Plan(min(free, max(1, math.ceil(level))), skip_endpoints, skip_tenants, caps)


def share(capacity: int, usage: Iterable[int]) -> float:
    """The fair share of ``capacity`` between holders using ``usage`` and one more that may
    want some (max-min fairness, filled like water): a holder using less than an equal
    share leaves the rest to the others, so holders of a slot or two do not shrink the
    share of those that need more."""
    left, waiting = float(capacity), 1
    ordered = sorted(usage)
    waiting += len(ordered)
    for used in ordered:
        if used >= left / waiting:
            break
        left -= used
        waiting -= 1
    return left / waiting


def average(previous: float | None, seconds: float) -> float:
    """An endpoint's latency average after a request that took ``seconds``."""
    if previous is None:
        return seconds
    return previous + LATENCY_WEIGHT * (seconds - previous)


def is_slow(average_s: float | None, started: Iterable[float], now: float, budget: float) -> bool:
    """Past its latency budget: on average, or with a request in flight for longer."""
    if average_s is not None and average_s > budget:
        return True
    return any(now - t > budget for t in started)


__all__ = ["Holding", "Plan", "average", "group", "is_slow", "plan"]
