"""What flows through the relay: claimed rows in, delivery outcomes out."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum


class Lease:
    """This relay's hold on the rows of one claim.

    ``until`` is when the hold is certain to end on this process's monotonic clock, measured
    from before the statement that set it (the claim, then each heartbeat), so it never
    outlives the lease PostgreSQL recorded. ``lost`` holds the rows the relay found it no
    longer holds (reaped after a stall, maybe claimed again). A row that is not ``held`` is
    not sent: another relay may have it by now. One object per claim, shared by its rows.
    """

    __slots__ = ("lost", "until")

    def __init__(self, until: float) -> None:
        self.until = until
        self.lost: set[int] = set()

    def held(self, row_id: int) -> bool:
        return row_id not in self.lost and time.monotonic() < self.until

    def __repr__(self) -> str:
        return f"Lease(until={self.until:.3f}, lost={len(self.lost)})"


@dataclass(frozen=True, slots=True, eq=False)
class Envelope:
    """One claimed outbox row, as sinks see it.

    ``headers`` is what the row holds: enqueue() stores a map of strings, but rows written
    with plain SQL can hold anything (see header_problem). ``token`` is the fencing token the
    claim returned (the row's ``claims``): every write the relay makes about the row
    (heartbeat, outcome, release) applies only while the row still carries it.
    ``event_type`` is the row's (migration 0006), None when it has none.
    """

    id: int
    destination: str
    key: str | None
    payload: bytes
    content_type: str
    headers: dict[str, str]
    attempts: int  # attempts before this one
    created_at: datetime
    token: int
    lease: Lease
    event_type: str | None = None

    def held(self) -> bool:
        """Whether this relay still holds the row (so may send it)."""
        return self.lease.held(self.id)


class Result(StrEnum):
    DELIVERED = "delivered"
    RETRY = "retry"  # transient: back to pending after backoff, counts as an attempt
    FAILED = "failed"  # permanent: retrying cannot help
    DEFER = "defer"  # not attempted (e.g. circuit open): back to pending, attempt not counted


@dataclass(frozen=True, slots=True)
class Outcome:
    id: int
    result: Result
    error: str | None = None
    # Seconds until the next attempt, when the sink knows better than the backoff schedule
    # (a webhook's Retry-After, a circuit's cool-down).
    retry_in: float | None = None
    # The class of the destination's answer, for the metrics (outbox_delivery_attempts'
    # status_class): "2xx" … "5xx" for a sink that speaks HTTP; None when there was no
    # answer, or the protocol has no such thing (Kafka).
    status_class: str | None = None

    @classmethod
    def delivered(cls, id: int, *, status_class: str | None = None) -> Outcome:
        return cls(id, Result.DELIVERED, status_class=status_class)

    @classmethod
    def retry(
        cls, id: int, error: str, retry_in: float | None = None, *, status_class: str | None = None
    ) -> Outcome:
        return cls(id, Result.RETRY, error, retry_in, status_class)

    @classmethod
    def failed(cls, id: int, error: str, *, status_class: str | None = None) -> Outcome:
        return cls(id, Result.FAILED, error, status_class=status_class)

    @classmethod
    def defer(cls, id: int, reason: str, retry_in: float) -> Outcome:
        return cls(id, Result.DEFER, reason, retry_in)

    @classmethod
    def not_held(cls, id: int) -> Outcome:
        """Not sent: this relay's lease on the row may have run out (another relay may hold
        it by now). Recorded as unattempted if the row is still this claim's."""
        return cls(id, Result.DEFER, "lease expired before sending; not attempted", 0.0)


MAX_ERROR_CHARS = 2000


def truncate_error(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """Keep ``last_error`` readable and bounded: one line-ish, at most ``limit`` chars."""
    text = text.replace("\x00", "")
    return text if len(text) <= limit else text[: limit - 15] + "… [truncated]"


class UnreadableHeaders(str):
    """Headers a row holds that Python cannot read (JSON nested too deeply): why, as text."""


def header_problem(headers: object) -> str | None:
    """Why a row's stored headers cannot be sent, or None. enqueue() validates them; rows
    inserted with plain SQL are checked here."""
    if isinstance(headers, UnreadableHeaders):
        return (
            f"headers cannot be read ({headers}); fix the row (UPDATE … SET headers = …) and "
            "run outbox-relay retry --id"
        )
    if not isinstance(headers, dict):
        return (
            f"headers must be a JSON object of strings, found {type(headers).__name__}; fix the "
            "row (UPDATE … SET headers = …) and run outbox-relay retry --id"
        )
    for name, value in headers.items():
        if not isinstance(value, str):
            return (
                f"header {name!r} has a {type(value).__name__} value; header values must be "
                "strings: fix the row and run outbox-relay retry --id"
            )
    return None
