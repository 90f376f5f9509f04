"""relay/backoff.py: the retry delay, exact figures for each rule (the property tests in
tests/faults/test_properties.py check its shape over random policies)."""

from __future__ import annotations

import math
import random

import pytest

from relay.backoff import delay
from relay.config.base import Backoff


def policy(**kw: object) -> Backoff:
    return Backoff.model_validate({"jitter": 0, **kw})


def test_exponential_from_base_by_factor() -> None:
    p = policy(base=1.5, factor=3, max=1000)
    assert [delay(p, n) for n in (1, 2, 3, 4)] == [1.5, 4.5, 13.5, 40.5]


def test_attempts_below_one_count_as_the_first() -> None:
    p = policy(base=2, factor=2, max=100)
    assert delay(p, 0) == delay(p, -5) == delay(p, 1) == 2.0


def test_capped_at_max_including_where_the_power_would_overflow() -> None:
    p = policy(base=1, factor=2, max=60)
    assert [delay(p, n) for n in (6, 7, 8)] == [32.0, 60.0, 60.0]
    assert delay(p, 5000) == 60.0  # 2**4999 overflows a float
    huge = policy(base=1, factor=1000, max=86400)
    assert delay(huge, 2) == 1000.0 and delay(huge, 3) == 86400.0 and delay(huge, 10**6) == 86400


def test_the_cap_exactly_at_a_power() -> None:
    p = policy(base=1, factor=2, max=8)
    assert [delay(p, n) for n in (3, 4, 5)] == [4.0, 8.0, 8.0]


def test_factor_one_is_constant() -> None:
    p = policy(base=7, factor=1, max=10)
    assert {delay(p, n) for n in range(1, 50)} == {7.0}


def test_a_schedule_replaces_the_formula_and_repeats_its_last_entry() -> None:
    p = policy(schedule=[0, 5, 300], base=1, factor=2, max=2)
    assert [delay(p, n) for n in (1, 2, 3, 4, 100)] == [0.0, 5.0, 300.0, 300.0, 300.0]
    assert delay(p, 0) == 0.0


def test_jitter_stays_within_its_fraction_and_varies() -> None:
    p = Backoff(base=10, factor=1, max=10, jitter=0.2)
    rng = random.Random(7)
    seen = [delay(p, 1, rng) for _ in range(2000)]
    assert min(seen) >= 8.0 and max(seen) <= 12.0
    assert min(seen) < 8.2 and max(seen) > 11.8  # both ends reached
    assert len(set(seen)) > 1900


def test_jitter_uses_the_generator_given() -> None:
    p = Backoff(base=10, factor=1, max=10, jitter=0.5)
    first = [delay(p, 1, random.Random(1)) for _ in range(3)]
    assert first[0] == first[1] == first[2]
    expected = 10 * (1 + random.Random(1).uniform(-0.5, 0.5))
    assert first[0] == pytest.approx(expected)


def test_no_jitter_on_a_zero_delay_and_never_negative() -> None:
    p = Backoff(schedule=[0.0], jitter=1.0)
    assert {delay(p, 1, random.Random(n)) for n in range(50)} == {0.0}
    full = Backoff(base=1, factor=1, max=1, jitter=1.0)
    assert all(0.0 <= delay(full, 1, random.Random(n)) <= 2.0 for n in range(200))


def test_without_jitter_nothing_random_is_drawn() -> None:
    class Exploding(random.Random):
        def uniform(self, a: float, b: float) -> float:
            raise AssertionError("drew a random number without jitter")

    assert delay(policy(base=3, factor=2, max=100), 2, Exploding()) == 6.0
    assert math.isfinite(delay(policy(base=3, factor=2, max=100), 10**9))


def test_a_tiny_base_and_a_huge_factor_neither_overflow_nor_skip_the_first_delays() -> None:
    p = policy(base=1e-303, factor=1000, max=86400)
    assert delay(p, 1) == 1e-303 and delay(p, 2) == pytest.approx(1e-300)
    delays = [delay(p, n) for n in range(1, 400)]  # 1000.0**103 overflows a float
    assert all(math.isfinite(d) and d <= 86400 for d in delays)
    assert delays[-1] == 86400 and delays == sorted(delays)


def test_jitter_applies_to_delays_under_a_second_but_draws_nothing_for_zero() -> None:
    p = Backoff(base=0.5, factor=1, max=1, jitter=0.5)
    seen = {delay(p, 1, random.Random(n)) for n in range(50)}
    assert len(seen) == 50 and all(0.25 <= d <= 0.75 for d in seen)

    class Exploding(random.Random):
        def uniform(self, a: float, b: float) -> float:
            raise AssertionError("drew a random number for a zero delay")

    assert delay(Backoff(schedule=[0.0], jitter=0.5), 1, Exploding()) == 0.0
