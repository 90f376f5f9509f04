"""What operators paused (``outbox-relay pause``): read at start-up and every poll interval;
a paused destination is not claimed, and is claimed at once when resumed."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import structlog

from relay.db.store import Store
from relay.obs.metrics import Metrics

log = structlog.get_logger("relay")


class Pauses:
    def __init__(
        self,
        store: Store,
        destinations: Iterable[str],
        metrics: Metrics,
        resumed: Callable[[], None],
    ) -> None:
        self.store = store
        self.destinations = list(destinations)
        self.metrics = metrics
        self.resumed = resumed
        self.paused: frozenset[str] = frozenset()
        self.refreshes = 0  # for tests: how often the paused set was read

    async def __call__(self) -> None:
        paused = frozenset(await self.store.paused())
        self.refreshes += 1
        if paused != self.paused:
            resumed = self.paused - paused
            for d in sorted(paused - self.paused):
                log.warning("relay.destination.paused", destination=d)
            for d in sorted(resumed):
                log.info("relay.destination.resumed", destination=d)
            self.paused = paused
            if resumed:
                self.resumed()
        self.metrics.set_paused(self.destinations, paused)
