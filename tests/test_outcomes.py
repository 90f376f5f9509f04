"""From an outcome to the record written for its row: pure rules, no database."""

from __future__ import annotations

import math
import time

import pytest

from outbox.schema import Status
from relay.config import MAX_SECONDS, Backoff
from relay.model import MAX_ERROR_CHARS, Envelope, Lease, Outcome
from relay.outcomes import clamp_delay, crashed, to_record

FIXED = Backoff(base=2, factor=3, max=100, jitter=0)


def envelope(attempts: int = 0, key: str | None = "k") -> Envelope:
    return Envelope(
        id=7,
        destination="orders",
        key=key,
        payload=b"{}",
        content_type="application/json",
        headers={},
        attempts=attempts,
        created=time.time(),
        token=3,
        lease=Lease(time.monotonic() + 30),
    )


def test_delivered_is_final_and_counts_an_attempt() -> None:
    rec = to_record(envelope(), Outcome.delivered(7), 5, FIXED)
    assert (rec.id, rec.token, rec.status, rec.counted, rec.error) == (
        7,
        3,
        Status.DELIVERED,
        1,
        None,
    )
    assert (rec.destination, rec.key) == ("orders", "k")  # an ordered key's head is let go


def test_failed_is_final_with_its_error_bounded() -> None:
    rec = to_record(envelope(), Outcome.failed(7, "x" * 10_000), 5, FIXED)
    assert rec.status is Status.FAILED and rec.counted == 1
    assert rec.error is not None and len(rec.error) <= MAX_ERROR_CHARS


def test_retry_waits_the_backoff_of_its_attempt() -> None:
    # attempts before: 2, so this was attempt 3: base * factor**2 = 18 s.
    rec = to_record(envelope(attempts=2), Outcome.retry(7, "HTTP 503"), 5, FIXED)
    assert (rec.status, rec.counted, rec.delay, rec.error) == (Status.PENDING, 1, 18.0, "HTTP 503")


def test_retry_of_the_last_attempt_gives_up() -> None:
    rec = to_record(envelope(attempts=4), Outcome.retry(7, "HTTP 503"), 5, FIXED)
    assert rec.status is Status.FAILED and rec.counted == 1
    assert rec.error == "gave up after 5 attempts: HTTP 503"


def test_the_sink_s_delay_wins_over_the_backoff_and_is_clamped() -> None:
    asked = to_record(envelope(), Outcome.retry(7, "429", retry_in=42.0), 5, FIXED)
    assert asked.delay == 42.0
    not_a_number = to_record(envelope(), Outcome.retry(7, "429", retry_in=math.nan), 5, FIXED)
    assert not_a_number.delay == 2.0  # the backoff's
    huge = to_record(envelope(), Outcome.retry(7, "429", retry_in=math.inf), 5, FIXED)
    assert huge.delay == MAX_SECONDS  # PostgreSQL can still add it to now()


def test_deferred_is_not_an_attempt() -> None:
    rec = to_record(envelope(attempts=4), Outcome.defer(7, "circuit open", 3.5), 5, FIXED)
    assert (rec.status, rec.counted, rec.delay) == (Status.PENDING, 0, 3.5)  # not given up
    assert to_record(envelope(), Outcome.not_held(7), 5, FIXED).counted == 0


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(None, 9.0), (math.nan, 9.0), (-1.0, 0.0), (5.0, 5.0), (1e300, MAX_SECONDS)],
)
def test_clamp_delay(seconds: float | None, expected: float) -> None:
    assert clamp_delay(seconds, 9.0) == expected


def test_a_crashed_delivery_counts_and_gives_up_at_the_limit() -> None:
    again = crashed(envelope(attempts=0), "KeyError: 'x'", 2, 5.0)
    assert (again.status, again.counted, again.delay) == (Status.PENDING, 1, 5.0)
    assert again.error == "relay error during delivery: KeyError: 'x'"
    last = crashed(envelope(attempts=1), "KeyError: 'x'", 2, 5.0)
    assert last.status is Status.FAILED
    assert last.error == "gave up after 2 attempts: relay error during delivery: KeyError: 'x'"
