"""The circuit breaker: pure rules over a clock the tests move, no database or network."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from relay import breaker as breaker_module
from relay.breaker import Breaker, State


class Clock:
    """Stands in for time.monotonic in relay.breaker; moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(breaker_module, "time", SimpleNamespace(monotonic=c.monotonic))
    return c


def fail(b: Breaker, n: int) -> list[bool]:
    return [b.failure() for _ in range(n)]


def test_a_new_breaker_is_closed_and_allows(clock: Clock) -> None:
    b = Breaker(threshold=3, cooldown=4.0, max_cooldown=60.0)
    assert (b.state, b.allows(), b.retry_in()) == (State.CLOSED, True, 0.0)
    assert b.success() is False  # nothing to close


def test_it_opens_at_the_threshold_of_consecutive_failures(clock: Clock) -> None:
    b = Breaker(threshold=3, cooldown=4.0, max_cooldown=60.0)
    assert fail(b, 2) == [False, False]
    assert (b.state, b.allows(), b.retry_in()) == (State.CLOSED, True, 0.0)
    assert b.failure() is True  # the third: this one opened it
    assert (b.state, b.allows(), b.retry_in()) == (State.OPEN, False, 4.0)


def test_a_threshold_of_one_opens_at_the_first_failure(clock: Clock) -> None:
    b = Breaker(threshold=1, cooldown=2.0, max_cooldown=60.0)  # as the Kafka sink's
    assert b.failure() is True
    assert b.state is State.OPEN


def test_a_success_resets_the_count_of_failures(clock: Clock) -> None:
    b = Breaker(threshold=3, cooldown=4.0, max_cooldown=60.0)
    fail(b, 2)
    assert b.success() is False  # it was not open
    assert fail(b, 2) == [False, False]  # counting from zero again
    assert b.state is State.CLOSED
    assert b.failure() is True


def test_retry_in_counts_down_the_cool_down_then_it_is_half_open(clock: Clock) -> None:
    b = Breaker(threshold=1, cooldown=4.0, max_cooldown=60.0)
    b.failure()
    clock.now += 3.5
    assert (b.state, b.allows(), b.retry_in()) == (State.OPEN, False, 0.5)
    clock.now += 0.5  # exactly the cool-down
    assert (b.state, b.allows(), b.retry_in()) == (State.HALF_OPEN, True, 0.0)
    clock.now += 10
    assert (b.state, b.retry_in()) == (State.HALF_OPEN, 0.0)  # never negative


def test_failures_while_open_neither_reopen_nor_extend_it(clock: Clock) -> None:
    """Results of sends made before it opened may still arrive: they change nothing."""
    b = Breaker(threshold=2, cooldown=4.0, max_cooldown=60.0)
    fail(b, 2)
    clock.now += 1
    assert fail(b, 3) == [False, False, False]
    assert (b.state, b.retry_in()) == (State.OPEN, 3.0)


def test_a_failed_probe_reopens_for_twice_the_cool_down_up_to_the_max(clock: Clock) -> None:
    b = Breaker(threshold=1, cooldown=4.0, max_cooldown=20.0)
    b.failure()
    for expected in (8.0, 16.0, 20.0, 20.0):
        clock.now += 100  # well past any cool-down: half-open
        assert b.state is State.HALF_OPEN
        assert b.failure() is False  # reopened, not opened (the webhook sink logs a probe)
        assert (b.state, b.allows(), b.retry_in()) == (State.OPEN, False, expected)


def test_a_success_closes_it_and_restores_the_first_cool_down(clock: Clock) -> None:
    b = Breaker(threshold=1, cooldown=4.0, max_cooldown=60.0)
    b.failure()
    clock.now += 4
    b.failure()  # a failed probe: 8 s now
    clock.now += 8
    assert b.success() is True  # this closed an open circuit
    assert (b.state, b.allows(), b.retry_in()) == (State.CLOSED, True, 0.0)
    assert b.success() is False
    assert b.failure() is True
    assert b.retry_in() == 4.0  # the base again, not the doubled one


def test_a_success_while_still_open_closes_it(clock: Clock) -> None:
    """An answer to a send made before it opened: the target is up after all."""
    b = Breaker(threshold=1, cooldown=4.0, max_cooldown=60.0)
    b.failure()
    assert b.success() is True
    assert b.state is State.CLOSED


def test_defaults_open_after_five_failures_for_five_seconds_up_to_five_minutes(
    clock: Clock,
) -> None:
    b = Breaker()
    assert (b.threshold, b.base_cooldown, b.max_cooldown) == (5, 5.0, 300.0)
    assert fail(b, 5) == [False, False, False, False, True]
    waits = [b.retry_in()]
    for _ in range(7):
        clock.now += 1000
        b.failure()
        waits.append(b.retry_in())
    assert waits == [5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0]
