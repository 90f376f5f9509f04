"""How the relay words an exception in logs, errors and ``last_error``: one place for it."""

from __future__ import annotations


def describe(exc: BaseException) -> str:
    """``"TypeName: message"``, or the type name alone when the message adds nothing."""
    name = type(exc).__name__
    text = str(exc)
    return f"{name}: {text}" if text and text != name else name
