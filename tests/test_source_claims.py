"""A source of rows on the relay's one claimer (issue #29) takes nothing from the events: their
poll, their claims at a NOTIFY, their backoff and their readiness are theirs whatever the
source does (wakes up all the time, fails, hangs), and a source whose walk left off mid-way is
claimed again at once. Found by a review of the wiring; each failed on it. Pure: the sources
are tables in memory (tests/test_pipes.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from types import SimpleNamespace

from relay.config import RelaySettings
from relay.model import Envelope, Lease
from relay.obs.metrics import Metrics
from relay.pipeline.claimer import Claimer, Feed
from relay.pipeline.leases import Leases
from tests.test_pipes import IDS, Item, ItemSource
from tests.webhook_helpers import envelope


class EveryClaim:
    """The events' store: each claim finds one row (a retry come due, a row another relay
    released: nothing NOTIFYs for those); counts its claims."""

    def __init__(self) -> None:
        self.claims = 0

    async def claim(self, destination: str, limit: int) -> list[Envelope]:
        self.claims += 1
        return [dataclasses.replace(envelope("d", id=100 + self.claims), token=10)]


def claimer(
    source: ItemSource, events: object, poll: float, *, batch_size: int = 3
) -> tuple[Claimer, list[list[int]]]:
    metrics = Metrics()
    stats: Counter[str] = Counter()
    sink = SimpleNamespace(available=lambda destination: True, claim_limit=lambda d, n: n)
    routes = {"d": SimpleNamespace(sink=sink, name="d", ordered=False)}
    sent: list[list[int]] = []
    c = Claimer(
        RelaySettings(poll_interval=poll, batch_size=batch_size, max_in_flight=1000),
        routes,  # type: ignore[arg-type]
        events,  # type: ignore[arg-type]
        Leases(metrics, stats),
        lambda batch: None,
        frozenset,
        metrics,
        stats,
        asyncio.Event(),
        sources=[
            Feed(
                source,
                Leases(metrics, Counter()),
                lambda b: sent.append([i.id for i in b]),
                1000,
                time.monotonic(),
            )
        ],
    )
    return c, sent


async def test_a_sources_steady_wake_ups_do_not_starve_the_events_poll() -> None:
    """Deliveries finishing wake the source every few ms (_wake_soon, WAKE_COALESCE): each of
    those wake-ups ends the claimer's wait, and the wait after it starts a fresh poll
    interval, with events_due False. So while deliveries flow, the events are claimed only on
    a NOTIFY: retries come due, rows released by a stopping relay, a sink whose circuit
    closed again, are never claimed."""
    events = EveryClaim()
    source = ItemSource()
    source.due = False
    c, _ = claimer(source, events, poll=0.2)
    task = asyncio.create_task(c.run())
    await asyncio.sleep(0.05)
    first = events.claims
    for _ in range(40):  # 1.2 s: six poll intervals of deliveries finishing
        source.wake()
        c.wake_sources()
        await asyncio.sleep(0.03)
    claims = events.claims - first
    c.stopping.set()
    await asyncio.wait_for(task, 5)
    assert claims >= 3, f"the events were claimed {claims} times in six poll intervals"


class CursorLeftOff(ItemSource):
    """A claim that scanned its SCAN endpoints and found none with a due delivery (dead
    endpoints backing off) leaves its cursor: DeliverySource.due stays True ("a scan left off
    mid-way"). The next bite, from the cursor, finds the rows."""

    async def claim(self, limit: int, held: Iterable[Item]) -> list[Item]:
        self.limits.append(limit)
        if len(self.limits) == 1:
            self.due = True  # _cursor is not None
            return []
        self.due = False
        lease = Lease(time.monotonic() + 3600)
        return [Item(i, 20, lease) for i in IDS] if len(self.limits) == 2 else []


async def test_a_source_whose_scan_left_off_midway_is_claimed_again_at_once() -> None:
    """The dispatcher claimed again at once while its cursor was set (`elif self._cursor is
    None: wait`); the claimer waits a whole poll interval (or a wake-up) instead, so with
    more than SCAN endpoints backing off, a healthy endpoint past them waits
    poll_interval x (endpoints / SCAN) for each delivery."""
    events = EveryClaim()
    source = CursorLeftOff()
    source.due = True
    c, sent = claimer(source, events, poll=5.0)
    task = asyncio.create_task(c.run())
    await asyncio.sleep(0.5)
    c.stopping.set()
    await asyncio.wait_for(task, 5)
    assert sent == [[1, 2, 3]], f"claims {source.limits}, sent {sent}"


class Notified(EveryClaim):
    """The events' store: a claim finds the rows enqueued (each NOTIFYing) since the last."""

    def __init__(self) -> None:
        super().__init__()
        self.pending = 0

    async def claim(self, destination: str, limit: int) -> list[Envelope]:
        self.claims += 1
        n, self.pending = min(limit, self.pending), self.pending - min(limit, self.pending)
        return [
            dataclasses.replace(envelope("d", id=1000 * self.claims + i), token=10)
            for i in range(n)
        ]


class Broken(ItemSource):
    """A source whose claim fails (a DELIVERY_CLAIM that times out, a bug)."""

    async def claim(self, limit: int, held: Iterable[Item]) -> list[Item]:
        self.limits.append(limit)
        raise RuntimeError("a bug in the deliveries' claim")


async def test_a_failing_source_claim_does_not_throttle_the_events() -> None:
    """A source's claim error goes through the events' _failed and back-off (0.1 s doubling
    to 5 s): the events, which have nothing to do with it, are then claimed once per back-off
    instead of at every NOTIFY. The dispatcher's claim errors were its own (a warning)."""
    events = Notified()
    source = Broken()
    c, _ = claimer(source, events, poll=5.0, batch_size=100)
    task = asyncio.create_task(c.run())
    await asyncio.sleep(0.05)
    first = events.claims
    for _ in range(30):  # 1.5 s of NOTIFYs, one every 50 ms
        events.pending += 1
        c.wake()
        await asyncio.sleep(0.05)
    claims = events.claims - first
    error = c.error
    c.stopping.set()
    await asyncio.wait_for(task, 10)
    assert claims >= 20, f"30 NOTIFYs, each for a fresh event: {claims} claims"
    assert error is None  # readiness is the events' claim's: not failed by the source's
    # The source backs off (0.1 s doubling), not claimed at every turn, nor given up on.
    assert 3 <= len(source.limits) <= 8, source.limits


class Hangs(ItemSource):
    """A source whose claim waits (a lock on outbox_deliveries, a claim under a held
    snapshot reading every dead entry of its index)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def claim(self, limit: int, held: Iterable[Item]) -> list[Item]:
        self.limits.append(limit)
        await self.gate.wait()
        return []


async def test_a_slow_source_claim_does_not_hold_up_the_events() -> None:
    """The dispatcher's claim was a loop of its own; on the one claimer, the events' next
    claim waits for the deliveries' claim to return: a slow DELIVERY_CLAIM delays every
    Kafka or webhook event by as long."""
    events = Notified()
    source = Hangs()
    c, _ = claimer(source, events, poll=5.0, batch_size=100)
    task = asyncio.create_task(c.run())
    await asyncio.sleep(0.05)
    first = events.claims
    events.pending += 1
    c.wake()  # a NOTIFY
    await asyncio.sleep(0.5)
    claims = events.claims - first
    source.gate.set()
    c.stopping.set()
    await asyncio.wait_for(task, 5)
    assert claims >= 1, "the event NOTIFYed waited for the deliveries' claim"


async def test_a_deliverys_refused_outcome_does_not_name_the_events_retry() -> None:
    """The completer fails a record the database refuses, its error saying "fix the cause,
    then outbox-relay retry --id <id>": for a delivery, the id is the delivery's, and that
    command retries the *event* of that id (another row of another table), or nothing. The
    dispatcher left such a delivery to its lease (the reaper retried it)."""
    from relay.db.store import Record
    from relay.runtime.pipes import Pipe
    from relay.sinks.endpoints.source import DeliverySource
    from relay.sinks.endpoints.store import DeliveryRecord
    from tests.test_pipes import Table

    record = DeliveryRecord(7, 20, "pending", 1, 5.0, "503", event_id=90, endpoint_id=3)

    class Logged(Table):
        """The deliveries' table, with the deliveries source's command for a refused row."""

        retry_hint = DeliverySource.retry_hint

        def __init__(self) -> None:
            super().__init__("deliveries", [(7, 20)])
            self.errors: list[str | None] = []

        async def record(self, records: Sequence[Record]) -> set[tuple[int, int]]:
            self.errors += [r.error for r in records]
            return await super().record(records)

    deliveries = Logged()
    deliveries.refuse.add(7)
    pipe: Pipe[Item] = Pipe("deliveries", deliveries, Leases(Metrics(), Counter()))
    pipe.leases.claimed([Item(7, 20, Lease(time.monotonic() + 3600))])
    pipe.completer.add([record])
    assert await pipe.completer.flush_once()
    assert deliveries.rows[7][1] == "failed"
    written = deliveries.errors[-1] or ""
    assert "retry --id 7" not in written, written
    assert "then outbox-relay replay 90 --endpoint 3" in written, written
