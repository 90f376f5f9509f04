"""The demo's one error: something it needs is not there, and the message says what to do."""

from __future__ import annotations


class DemoError(RuntimeError):
    pass
