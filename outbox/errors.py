"""Exceptions raised to applications that enqueue events, and how any exception is worded."""

from __future__ import annotations


class OutboxError(Exception):
    """Base class of every error this package raises."""


class OutboxValidationError(OutboxError, ValueError):
    """An event was refused before it reached the database.

    ``field`` names the argument at fault so callers can map it to their own API errors.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def describe(exc: BaseException) -> str:
    """How an exception is worded in logs, errors and ``last_error``, everywhere (the outbox
    library, the relay, the commands): ``"TypeName: message"``, or the type name alone when
    the message adds nothing."""
    name = type(exc).__name__
    text = str(exc)
    return f"{name}: {text}" if text and text != name else name
