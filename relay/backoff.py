"""Retry delays: exponential with a cap, or an explicit schedule, with jitter."""

from __future__ import annotations

import math
import random

from relay.config.base import Backoff


def delay(policy: Backoff, attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
    n = max(1, attempt)
    if policy.schedule:
        base = policy.schedule[min(n, len(policy.schedule)) - 1]
    else:
        # Compare logarithms rather than computing factor**(n-1), which overflows a float
        # (the old guard, n < 1100, held for factor 2 only: factor 3 overflowed at n = 647).
        grows = (n - 1) * math.log(policy.factor)
        base = policy.max
        if grows < math.log(policy.max / policy.base):
            base = min(policy.max, policy.base * policy.factor ** (n - 1))
    if policy.jitter and base > 0:
        r = (rng or random).uniform(-policy.jitter, policy.jitter)
        base = base * (1 + r)
    return max(0.0, base)
