"""Retry delays: exponential with a cap, or an explicit schedule, with jitter."""

from __future__ import annotations

import random

from relay.config import Backoff


def delay(policy: Backoff, attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
    n = max(1, attempt)
    if policy.schedule:
        base = policy.schedule[min(n, len(policy.schedule)) - 1]
    else:
        # Compare exponents rather than computing factor**n, which overflows for large n.
        base = policy.max
        if policy.factor == 1 or n < 1100:
            base = min(policy.max, policy.base * policy.factor ** (n - 1))
    if policy.jitter and base > 0:
        r = (rng or random).uniform(-policy.jitter, policy.jitter)
        base = base * (1 + r)
    return max(0.0, base)
