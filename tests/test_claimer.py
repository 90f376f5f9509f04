"""The claim loop's waits: it sleeps while nothing can be claimed, and wakes when a full sink
has room again, whatever the other destinations are doing."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

from relay.config import RelaySettings
from relay.obs.metrics import Metrics
from relay.pipeline.claimer import Claimer
from relay.pipeline.leases import Leases


class FakeSink:
    def __init__(self, available: bool) -> None:
        self.open = available

    def available(self, destination: str) -> bool:
        return self.open

    def claim_limit(self, destination: str, limit: int) -> int:
        return limit


class FakeStore:
    """Claims nothing; notes when each destination was claimed for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    async def claim(self, destination: str, limit: int) -> list[Any]:
        self.calls.append((destination, time.monotonic()))
        return []


def claimer(sinks: dict[str, FakeSink], store: FakeStore) -> tuple[Claimer, Leases]:
    metrics = Metrics()
    leases = Leases(metrics, Counter())
    routes = {n: SimpleNamespace(sink=s, name=n, ordered=False) for n, s in sinks.items()}
    c = Claimer(
        RelaySettings(poll_interval=5.0),
        routes,  # type: ignore[arg-type]
        store,  # type: ignore[arg-type]
        leases,
        lambda batch: None,
        frozenset,
        metrics,
        Counter(),
        asyncio.Event(),
    )
    return c, leases


async def test_a_notify_while_every_sink_is_full_does_not_spin() -> None:
    c, _ = claimer({"hook": FakeSink(available=False)}, FakeStore())
    calls = 0
    real = c.claimable

    def counting() -> list[str]:
        nonlocal calls
        calls += 1
        return real()

    c.claimable = counting  # type: ignore[method-assign]
    task = asyncio.create_task(c.run())
    await asyncio.sleep(0.05)
    c.wake()  # an insert's NOTIFY while the only endpoint is full (or paused, or open)
    await asyncio.sleep(0.5)
    c.stopping.set()
    await task
    assert calls < 10, f"claimable() ran {calls} times in 0.5 s"


async def test_room_in_a_full_sink_wakes_the_claim_while_another_destination_idles() -> None:
    full = FakeSink(available=False)
    store = FakeStore()
    c, leases = claimer({"full": full, "idle": FakeSink(available=True)}, store)
    task = asyncio.create_task(c.run())
    await asyncio.sleep(0.2)
    full.open = True
    freed = time.monotonic()
    leases.capacity.set()  # the full sink's rows were handed off
    await asyncio.sleep(1.0)
    c.stopping.set()
    await task
    claims = [t for name, t in store.calls if name == "full"]
    assert claims and claims[0] - freed < 0.5, "the full destination waited for the poll"
