"""Exceptions raised to applications that enqueue events."""

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
