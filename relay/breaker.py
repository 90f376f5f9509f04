"""A circuit breaker: stop sending to a target that keeps failing, probe it after a pause."""

from __future__ import annotations

import time
from enum import StrEnum


class State(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Breaker:
    """Opens after ``threshold`` consecutive failures, for ``cooldown`` seconds.

    After the cool-down it is half-open: traffic is allowed again, and the next outcome closes
    it (success) or reopens it for twice the cool-down, up to ``max_cooldown``.
    """

    def __init__(
        self, threshold: int = 5, cooldown: float = 5.0, max_cooldown: float = 300.0
    ) -> None:
        self.threshold = threshold
        self.base_cooldown = cooldown
        self.max_cooldown = max_cooldown
        self._cooldown = cooldown
        self._failures = 0
        self._opened_at: float | None = None

    @property
    def state(self) -> State:
        if self._opened_at is None:
            return State.CLOSED
        if time.monotonic() - self._opened_at >= self._cooldown:
            return State.HALF_OPEN
        return State.OPEN

    def allows(self) -> bool:
        return self.state is not State.OPEN

    def retry_in(self) -> float:
        if self._opened_at is None:
            return 0.0
        return max(0.0, self._opened_at + self._cooldown - time.monotonic())

    def success(self) -> bool:
        """Record a success; True if this closed an open circuit."""
        was_open = self._opened_at is not None
        self._failures = 0
        self._opened_at = None
        self._cooldown = self.base_cooldown
        return was_open

    def failure(self) -> bool:
        """Record a failure; True if this opened the circuit."""
        state = self.state
        if state is State.HALF_OPEN:
            self._cooldown = min(self.max_cooldown, self._cooldown * 2)
            self._opened_at = time.monotonic()
            return False
        self._failures += 1
        if state is State.CLOSED and self._failures >= self.threshold:
            self._opened_at = time.monotonic()
            return True
        return False
