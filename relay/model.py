"""What flows through the relay: claimed rows in, delivery outcomes out."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

# What datetime can hold, as epoch seconds: a row's time outside it (PostgreSQL's 'infinity',
# a year beyond 9999) is read as the nearest end.
MIN_EPOCH = datetime.min.replace(tzinfo=UTC).timestamp()
MAX_EPOCH = datetime.max.replace(tzinfo=UTC).timestamp()


def epoch(seconds: float) -> float:
    """``seconds`` within what datetime can hold."""
    if MIN_EPOCH <= seconds <= MAX_EPOCH:
        return seconds
    return MIN_EPOCH if seconds < MIN_EPOCH else MAX_EPOCH


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


# The hot path's records (Envelope, Outcome, Record in relay/db/store.py) are plain slotted
# dataclasses, not frozen ones: a frozen dataclass sets each field through
# object.__setattr__, which made building one 4-5 times slower (3.3 against 0.6 µs for an
# Envelope on the benchmark machine), three of them per event. Nothing changes them once
# built; treat them as values.
@dataclass(slots=True, eq=False)
class Envelope:
    """One claimed outbox row, as sinks see it.

    ``headers`` is what the row holds: enqueue() stores a map of strings, but rows written
    with plain SQL can hold anything (see header_problem). ``token`` is the fencing token the
    claim returned (the row's ``claims``): every write the relay makes about the row
    (heartbeat, outcome, release) applies only while the row still carries it.
    ``event_type`` is the row's (migration 0006), None when it has none. ``created`` is the
    row's created_at in epoch seconds (see :func:`epoch`); :attr:`created_at` is the same as
    a datetime, built when asked for (most deliveries never ask).
    """

    id: int
    destination: str
    key: str | None
    payload: bytes
    content_type: str
    headers: dict[str, str]
    attempts: int  # attempts before this one
    created: float
    token: int
    lease: Lease
    event_type: str | None = None

    def held(self) -> bool:
        """Whether this relay still holds the row (so may send it)."""
        return self.lease.held(self.id)

    @property
    def created_at(self) -> datetime:
        try:
            return datetime.fromtimestamp(self.created, UTC)
        except (OverflowError, ValueError, OSError):  # at the very ends of datetime's range
            return (datetime.max if self.created > 0 else datetime.min).replace(tzinfo=UTC)


class Result(StrEnum):
    DELIVERED = "delivered"
    RETRY = "retry"  # transient: back to pending after backoff, counts as an attempt
    FAILED = "failed"  # permanent: retrying cannot help
    DEFER = "defer"  # not attempted (e.g. circuit open): back to pending, attempt not counted


@dataclass(slots=True, unsafe_hash=True)
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
    # The sink wrote this outcome itself, in the statement that did the delivery (the
    # endpoints sink records an event in its fan-out's statement): the completer only
    # counts it as written.
    recorded: bool = False

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
