"""Sinks deliver envelopes to the outside world. Each is one small interface."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from relay.model import Envelope, Outcome


@runtime_checkable
class Sink(Protocol):
    """Delivers batches and says, per envelope, what happened.

    ``deliver`` returns exactly one outcome per envelope (in any order) and never raises for
    a delivery problem: a failure of one message is that message's outcome, so its
    neighbours are still recorded. Exceptions are reserved for bugs; the relay then retries
    the whole batch.
    """

    async def start(self) -> None: ...

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]: ...

    def available(self, destination: str) -> bool:
        """False while the destination is known to be down (circuit open): not claimed."""
        ...

    async def close(self) -> None: ...


__all__ = ["Sink"]
