"""In-memory sinks for the relay's own bookkeeping (integration tests use the real ones)."""

from __future__ import annotations

from collections.abc import Sequence

from relay.breaker import Breaker
from relay.model import Envelope, Outcome
from relay.sinks import SinkBase


class MemorySink(SinkBase):
    """Always available, nothing to start or close; subclasses decide each outcome."""

    kind = "memory"

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def available(self, destination: str) -> bool:
        return True

    def ready(self, destination: str) -> bool:
        return self.available(destination)

    def circuits(self) -> dict[str, Breaker]:
        return {}

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
        raise NotImplementedError
