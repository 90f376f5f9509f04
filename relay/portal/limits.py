"""Rate limits of the portal, per tenant and per replica (a token bucket each, in memory):
one tenant's script cannot take the database from the others. At most MAX_TENANTS buckets are
kept; the least recently used go first."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MAX_TENANTS = 10_000


@dataclass(frozen=True, slots=True)
class Rate:
    per_second: float
    burst: float

    def __post_init__(self) -> None:
        if not (self.per_second > 0 and self.burst >= 1):
            raise ValueError("a rate needs per_second > 0 and a burst of at least 1")


class Limits:
    """Token buckets by key (tenant, or tenant and kind of request)."""

    def __init__(self, rate: Rate, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, key: str) -> float:
        """Take one token for ``key``: 0.0 if there was one, else the seconds until there is
        (the request is refused; nothing is taken)."""
        now = self._clock()
        tokens, at = self._buckets.pop(key, (self.rate.burst, now))
        tokens = min(self.rate.burst, tokens + (now - at) * self.rate.per_second)
        wait = 0.0
        if tokens >= 1:
            tokens -= 1
        else:
            wait = (1 - tokens) / self.rate.per_second
        self._buckets[key] = (tokens, now)
        while len(self._buckets) > MAX_TENANTS:
            self._buckets.popitem(last=False)
        return wait
