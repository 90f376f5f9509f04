"""From an outcome to the record written for its row: pure rules, no database."""

from __future__ import annotations

import math
import time

import pytest

from outbox.schema import Status
from relay.config import MAX_SECONDS, Backoff
from relay.db.store import Record
from relay.model import MAX_ERROR_CHARS, Envelope, Lease, Outcome, Result
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
    # The key is kept: an ordered key's head is let go.
    assert rec == Record(7, 3, Status.DELIVERED, 1, 0.0, None, "orders", "k", written=False)


def test_delivered_keeps_its_note_and_whether_the_sink_wrote_it() -> None:
    """The endpoints sink records an event itself, with a note when no endpoint matched."""
    note = "no endpoint matched (none enabled for its destination, tenant and event type)"
    outcome = Outcome(7, Result.DELIVERED, note, recorded=True)
    rec = to_record(envelope(attempts=2, key=None), outcome, 5, FIXED)
    assert rec == Record(7, 3, Status.DELIVERED, 1, 0.0, note, "orders", None, written=True)


def test_failed_is_final_with_its_error_bounded() -> None:
    rec = to_record(envelope(), Outcome.failed(7, "x" * 10_000), 5, FIXED)
    bounded = "x" * (MAX_ERROR_CHARS - 15) + "… [truncated]"
    assert rec == Record(7, 3, Status.FAILED, 1, 0.0, bounded, "orders", "k")
    assert len(bounded) <= MAX_ERROR_CHARS


def test_retry_waits_the_backoff_of_its_attempt() -> None:
    # attempts before: 2, so this was attempt 3: base * factor**2 = 18 s.
    rec = to_record(envelope(attempts=2), Outcome.retry(7, "HTTP 503"), 5, FIXED)
    assert rec == Record(7, 3, Status.PENDING, 1, 18.0, "HTTP 503", "orders", "k")


def test_retry_of_the_last_attempt_gives_up() -> None:
    rec = to_record(envelope(attempts=4), Outcome.retry(7, "HTTP 503"), 5, FIXED)
    gave_up = "gave up after 5 attempts: HTTP 503"
    assert rec == Record(7, 3, Status.FAILED, 1, 0.0, gave_up, "orders", "k")


def test_the_sink_s_delay_wins_over_the_backoff_and_is_clamped() -> None:
    asked = to_record(envelope(), Outcome.retry(7, "429", retry_in=42.0), 5, FIXED)
    assert asked == Record(7, 3, Status.PENDING, 1, 42.0, "429", "orders", "k")
    not_a_number = to_record(envelope(), Outcome.retry(7, "429", retry_in=math.nan), 5, FIXED)
    assert not_a_number.delay == 2.0  # the backoff's
    huge = to_record(envelope(), Outcome.retry(7, "429", retry_in=math.inf), 5, FIXED)
    assert huge.delay == MAX_SECONDS  # PostgreSQL can still add it to now()


def test_deferred_is_not_an_attempt() -> None:
    rec = to_record(envelope(attempts=4), Outcome.defer(7, "circuit open", 3.5), 5, FIXED)
    # Not given up, though this envelope has no attempt left.
    assert rec == Record(7, 3, Status.PENDING, 0, 3.5, "circuit open", "orders", "k")
    lost = to_record(envelope(), Outcome.not_held(7), 5, FIXED)
    assert (lost.status, lost.counted, lost.delay) == (Status.PENDING, 0, 0.0)
    # A deferral without a usable delay is due again at once.
    nan = to_record(envelope(), Outcome.defer(7, "circuit open", math.nan), 5, FIXED)
    assert nan == Record(7, 3, Status.PENDING, 0, 0.0, "circuit open", "orders", "k")


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(None, 9.0), (math.nan, 9.0), (-1.0, 0.0), (5.0, 5.0), (1e300, MAX_SECONDS)],
)
def test_clamp_delay(seconds: float | None, expected: float) -> None:
    assert clamp_delay(seconds, 9.0) == expected


def test_a_crashed_delivery_counts_and_gives_up_at_the_limit() -> None:
    error = "relay error during delivery: KeyError: 'x'"
    again = crashed(envelope(attempts=0), "KeyError: 'x'", 2, 5.0)
    assert again == Record(7, 3, Status.PENDING, 1, 5.0, error, "orders", "k")
    last = crashed(envelope(attempts=1), "KeyError: 'x'", 2, 5.0)
    gave_up = f"gave up after 2 attempts: {error}"
    assert last == Record(7, 3, Status.FAILED, 1, 0.0, gave_up, "orders", "k")
