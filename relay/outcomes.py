"""From a delivery outcome to the record written for its row: attempts, backoff, giving up.

Pure functions of the envelope, the outcome and the destination's retry policy, so every rule
is testable without a database. The relay writes what they return.
"""

from __future__ import annotations

import math

from outbox.status import Status
from relay import backoff
from relay.config.base import MAX_SECONDS, Backoff
from relay.db.store import Record
from relay.model import Envelope, Outcome, Result, truncate_error


def clamp_delay(seconds: float | None, fallback: float) -> float:
    """A delay PostgreSQL can add to now(): finite, at least 0, at most MAX_SECONDS."""
    if seconds is None or math.isnan(seconds):
        seconds = fallback
    return min(max(0.0, seconds), MAX_SECONDS)


def to_record(env: Envelope, outcome: Outcome, max_attempts: int, policy: Backoff) -> Record:
    """The record for ``env`` after ``outcome``: delivered, failed, back to pending after a
    backoff (an attempt counted), or back to pending unattempted (deferred)."""
    error = truncate_error(outcome.error) if outcome.error else None
    token = env.token
    if outcome.result is Result.DELIVERED:
        # An error with a delivered outcome is a note (an event no endpoint subscribed to).
        return Record(
            env.id,
            token,
            Status.DELIVERED,
            1,
            0.0,
            error,
            env.destination,
            env.key,
            outcome.recorded,
        )
    if outcome.result is Result.FAILED:
        return Record(env.id, token, Status.FAILED, 1, 0.0, error, env.destination, env.key)
    if outcome.result is Result.DEFER:
        later = clamp_delay(outcome.retry_in, 0.0)
        return Record(env.id, token, Status.PENDING, 0, later, error, env.destination, env.key)
    attempt = env.attempts + 1
    if attempt >= max_attempts:
        gave_up = f"gave up after {attempt} attempts: {error}"
        return Record(env.id, token, Status.FAILED, 1, 0.0, gave_up, env.destination, env.key)
    asked = outcome.retry_in
    wait = backoff.delay(policy, attempt) if asked is None or math.isnan(asked) else asked
    return Record(
        env.id,
        token,
        Status.PENDING,
        1,
        clamp_delay(wait, policy.max),
        error,
        env.destination,
        env.key,
    )


def crashed(env: Envelope, error: str, max_attempts: int, delay: float) -> Record:
    """The record for a row whose delivery raised before it had an outcome: retried after
    ``delay`` with the error, an attempt counted (a bug that always raises must not retry
    the row for ever), failed once the attempts are spent. Nothing here can raise."""
    attempt = env.attempts + 1
    text = truncate_error(f"relay error during delivery: {error}")
    if attempt >= max_attempts:
        return Record(
            env.id,
            env.token,
            Status.FAILED,
            1,
            0.0,
            f"gave up after {attempt} attempts: {text}",
            env.destination,
            env.key,
        )
    return Record(env.id, env.token, Status.PENDING, 1, delay, text, env.destination, env.key)
