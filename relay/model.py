"""What flows through the relay: claimed rows in, delivery outcomes out."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum


@dataclass(frozen=True, slots=True)
class Envelope:
    """One claimed outbox row, as sinks see it."""

    id: int
    destination: str
    key: str | None
    payload: bytes
    content_type: str
    headers: dict[str, str]
    attempts: int  # attempts before this one
    created_at: datetime


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
    # The HTTP status the endpoint answered, for sinks that speak HTTP (metrics count attempts
    # by status class); None for Kafka and when no response arrived.
    http_status: int | None = None

    @classmethod
    def delivered(cls, id: int, *, http_status: int | None = None) -> Outcome:
        return cls(id, Result.DELIVERED, http_status=http_status)

    @classmethod
    def retry(
        cls, id: int, error: str, retry_in: float | None = None, *, http_status: int | None = None
    ) -> Outcome:
        return cls(id, Result.RETRY, error, retry_in, http_status)

    @classmethod
    def failed(cls, id: int, error: str, *, http_status: int | None = None) -> Outcome:
        return cls(id, Result.FAILED, error, http_status=http_status)

    @classmethod
    def defer(cls, id: int, reason: str, retry_in: float) -> Outcome:
        return cls(id, Result.DEFER, reason, retry_in)


MAX_ERROR_CHARS = 2000


def truncate_error(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """Keep ``last_error`` readable and bounded: one line-ish, at most ``limit`` chars."""
    text = text.replace("\x00", "")
    return text if len(text) <= limit else text[: limit - 15] + "… [truncated]"


def header_problem(headers: object) -> str | None:
    """Why a row's stored headers cannot be sent, or None. enqueue() validates them; rows
    inserted with plain SQL are checked here."""
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
