"""Exceptions raised to applications that enqueue events, and how any exception is worded."""

from __future__ import annotations

from typing import Self


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

    def at(self, prefix: str) -> Self:
        """The same refusal, its field under ``prefix`` (``enqueue_many`` says ``events[3]``),
        of the same class so callers catching a subclass still catch it."""
        return self._moved(f"{prefix}.{self.field}")

    def _moved(self, field: str) -> Self:
        return type(self)(field, self.message)


class EventSchemaError(OutboxValidationError):
    """An event refused by its type in the catalog (``outbox.catalog``): its payload does not
    match the type's schema, or its destination, key or content type are not the type's.

    ``path`` is the JSON pointer of the value at fault inside the payload ("" for the whole
    payload or for a refusal that is not about the payload), ``keyword`` the schema keyword or
    the check that refused it. No value of the payload is ever part of the message."""

    def __init__(
        self,
        field: str,
        message: str,
        *,
        event_type: str,
        version: int | None,
        path: str = "",
        keyword: str,
    ) -> None:
        super().__init__(field, message)
        self.event_type = event_type
        self.version = version
        self.path = path
        self.keyword = keyword

    def _moved(self, field: str) -> Self:
        return type(self)(
            field,
            self.message,
            event_type=self.event_type,
            version=self.version,
            path=self.path,
            keyword=self.keyword,
        )


class CatalogError(OutboxError, ValueError):
    """An event type or a catalog that cannot be declared or loaded, saying which and where."""


def describe(exc: BaseException) -> str:
    """How an exception is worded in logs, errors and ``last_error``, everywhere (the outbox
    library, the relay, the commands): ``"TypeName: message"``, or the type name alone when
    the message adds nothing."""
    name = type(exc).__name__
    text = str(exc)
    return f"{name}: {text}" if text and text != name else name
