"""Another source's rows on the relay's pipeline, from claim to shutdown: the claimer claims a
source in a room of its own (whatever the events hold or whether a destination can be
claimed), a source coming due costs no events' claim, the source's sends hand each outcome on
as it ends and settle what they leave (crashed, cut short by a stop), and a shutdown waits
for them before releasing anything. Pure: the sources are tables in memory (tests/test_pipes.py)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any

import asyncpg

from outbox.status import Status
from relay.config import RelaySettings
from relay.db.store import Record
from relay.model import Envelope, Lease
from relay.obs.metrics import Metrics
from relay.pipeline.claimer import Claimer, Feed
from relay.pipeline.leases import Leases
from relay.pipeline.source_sending import SourceSending
from relay.runtime.pipes import Pipe
from tests.test_pipes import (
    IDS,
    EventsStore,
    Item,
    ItemSource,
    Table,
    events_pipe,
    stopping_relay,
)


def claimer_for(
    source: ItemSource,
    *,
    events: EventsStore | None = None,
    max_in_flight: int = 1000,
    available: bool = True,
    room: int = 5,
) -> tuple[Claimer, list[list[int]], Leases[Envelope]]:
    metrics = Metrics()
    stats: Counter[str] = Counter()
    leases: Leases[Envelope] = Leases(metrics, stats)
    sent: list[list[int]] = []
    now = time.monotonic()  # claimed just now: not due by its poll in these tests
    sink = SimpleNamespace(available=lambda destination: available, claim_limit=lambda d, n: n)
    routes = {"d": SimpleNamespace(sink=sink, name="d", ordered=False)}
    claimer = Claimer(
        RelaySettings(poll_interval=5.0, batch_size=3, max_in_flight=max_in_flight),
        routes,  # type: ignore[arg-type]
        events or EventsStore(),  # type: ignore[arg-type]
        leases,
        lambda batch: None,
        frozenset,
        metrics,
        stats,
        asyncio.Event(),
        sources=[
            Feed(source, Leases(metrics, Counter()), lambda b: sent.append(ids(b)), room, now)
        ],
    )
    return claimer, sent, leases


def ids(items: Sequence[Item]) -> list[int]:
    return [i.id for i in items]


async def stop(claimer: Claimer, task: asyncio.Task[None]) -> None:
    claimer.stopping.set()
    await asyncio.wait_for(task, 5)


async def test_a_source_is_claimed_while_the_events_hold_their_whole_room() -> None:
    source = ItemSource()
    source.due = False
    claimer, sent, leases = claimer_for(source, max_in_flight=3)
    task = asyncio.create_task(claimer.run())
    await asyncio.sleep(0.1)
    assert len(leases) == 3  # the events' room is taken
    source.wake()
    claimer.wake_sources()
    await asyncio.sleep(0.1)
    assert sent == [[1, 2, 3]]
    await stop(claimer, task)


async def test_a_source_is_claimed_while_no_destination_can_be_claimed() -> None:
    source = ItemSource()
    source.due = False
    claimer, sent, _ = claimer_for(source, available=False)
    task = asyncio.create_task(claimer.run())
    await asyncio.sleep(0.05)
    source.wake()
    claimer.wake_sources()
    await asyncio.sleep(0.1)
    assert sent == [[1, 2, 3]]
    await stop(claimer, task)


async def test_a_source_coming_due_claims_the_sources_and_not_the_events() -> None:
    events = EventsStore()
    source = ItemSource()
    claimer, _, _ = claimer_for(source, events=events)
    task = asyncio.create_task(claimer.run())
    await asyncio.sleep(0.1)
    claims = events.claims
    for _ in range(5):
        source.wake()
        claimer.wake_sources()
        await asyncio.sleep(0.02)
    assert len(source.limits) >= 6  # claimed at every wake-up
    assert events.claims == claims  # and the events not once more
    claimer.wake()  # a NOTIFY: the events' claim again
    await asyncio.sleep(0.05)
    assert events.claims == claims + 1
    await stop(claimer, task)


async def test_a_failing_events_claim_does_not_keep_a_source_from_being_claimed() -> None:
    class Down(EventsStore):
        async def claim(self, destination: str, limit: int) -> list[Envelope]:
            self.claims += 1
            raise asyncpg.PostgresError("the events' claim fails")

    source = ItemSource()
    claimer, sent, _ = claimer_for(source, events=Down())
    task = asyncio.create_task(claimer.run())
    await asyncio.sleep(0.1)
    assert sent == [[1, 2, 3]]
    await stop(claimer, task)


# --- sending a source's rows ---------------------------------------------------------------


class Sender(ItemSource):
    """Sends each group by ``send(item)``: a record, or None for no outcome; groups by
    ``group_of``."""

    def __init__(self, send: Callable[[Item], Any], group_of: Callable[[Item], Hashable]) -> None:
        super().__init__()
        self.send = send
        self.group_of = group_of
        self.groups: list[list[int]] = []
        self.on_due: Callable[[], None] = lambda: None
        self.halted = False

    def group(self, item: Item) -> Hashable:
        return self.group_of(item)

    async def deliver(self, items: Sequence[Item], emit: Callable[[Record, Item], None]) -> None:
        self.groups.append([i.id for i in items])
        for item in items:
            if self.halted:
                return  # not started: left without an outcome
            record = await self.send(item)
            if record is not None:
                emit(record, item)

    def crashed(self, item: Item, exc: BaseException) -> Record:
        return Record(item.id, item.token, Status.PENDING, 1, 5.0, f"crashed: {exc}")

    def cut_short(self, item: Item) -> Record | None:
        if item.id == 1:  # its request had gone out
            return Record(item.id, item.token, Status.PENDING, 1, 5.0, "cut short")
        return None

    def halt(self) -> None:
        self.halted = True


def sending_pipe(source: Sender) -> tuple[Pipe[Item], SourceSending[Item]]:
    pipe: Pipe[Item] = Pipe("deliveries", source, Leases(Metrics(), Counter()))
    lease = Lease(time.monotonic() + 3600)
    pipe.leases.claimed([Item(i, 20, lease) for i in IDS])
    sending = SourceSending(source, pipe.leases, pipe.completer, Metrics())
    pipe.sending = sending
    return pipe, sending


def buffered(pipe: Pipe[Item]) -> list[tuple[int, str, str | None]]:
    return [(r.id, str(r.status), r.error) for r in pipe.completer._buffer]


async def test_each_group_is_sent_apart_and_each_outcome_handed_on_as_it_ends() -> None:
    gate = asyncio.Event()

    async def send(item: Item) -> Record:
        if item.id == 3:
            await gate.wait()
        return Record(item.id, item.token, Status.DELIVERED, 1, 0.0, None)

    source = Sender(send, lambda i: i.id == 3)
    pipe, sending = sending_pipe(source)
    sending.dispatch(list(pipe.leases))
    await asyncio.sleep(0.05)
    assert sorted(source.groups) == [[1, 2], [3]]
    # Rows 1 and 2 are with the completer, 3 is still being sent.
    assert [i for i, _, _ in buffered(pipe)] == [1, 2]
    assert set(pipe.leases._handed) == {1, 2}
    gate.set()
    await asyncio.gather(*sending.tasks)
    assert [i for i, _, _ in buffered(pipe)] == [1, 2, 3]


async def test_a_group_whose_sending_raised_has_every_row_left_recorded_as_crashed() -> None:
    async def send(item: Item) -> Record:
        if item.id == 2:
            raise RuntimeError("a bug")
        return Record(item.id, item.token, Status.DELIVERED, 1, 0.0, None)

    source = Sender(send, lambda i: 0)
    pipe, sending = sending_pipe(source)
    sending.dispatch(list(pipe.leases))
    await asyncio.gather(*sending.tasks)
    assert buffered(pipe) == [
        (1, "delivered", None),
        (2, "pending", "crashed: a bug"),
        (3, "pending", "crashed: a bug"),
    ]


async def test_a_row_a_source_left_without_an_outcome_is_recorded_as_crashed() -> None:
    async def send(item: Item) -> Record | None:
        return None if item.id == 2 else Record(item.id, item.token, Status.DELIVERED, 1, 0, None)

    source = Sender(send, lambda i: 0)
    pipe, sending = sending_pipe(source)
    sending.dispatch(list(pipe.leases))
    await asyncio.gather(*sending.tasks)
    assert [(i, s) for i, s, _ in buffered(pipe)] == [
        (1, "delivered"),
        (3, "delivered"),
        (2, "pending"),
    ]


async def test_a_stop_that_cuts_a_group_short_records_the_requests_out_and_holds_the_rest() -> None:
    async def send(item: Item) -> Record:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    source = Sender(send, lambda i: 0)
    pipe, sending = sending_pipe(source)
    sending.dispatch(list(pipe.leases))
    await asyncio.sleep(0.02)
    for t in sending.tasks:
        t.cancel()
    await asyncio.gather(*sending.tasks, return_exceptions=True)
    # Row 1's request had gone out: an attempt; 2 and 3 stay held, to be released.
    assert buffered(pipe) == [(1, "pending", "cut short")]
    assert sorted(i for i, _ in pipe.leases.tokens()) == [1, 2, 3]
    assert set(pipe.leases._handed) == {1}


async def test_a_shutdown_waits_for_a_sources_sends_before_releasing_its_rows(
    monkeypatch: Any,
) -> None:
    """Released while its request was out, a row would be claimed and sent again: the
    shutdown waits for a source's sends as for the events', within shutdown_timeout."""
    import relay.runtime.shutdown as stopping

    async def send(item: Item) -> Record:
        await asyncio.sleep(0.3)
        return Record(item.id, item.token, Status.DELIVERED, 1, 0.0, None)

    events = Table("events", [])
    source = Sender(send, lambda i: i.id)
    pipe, sending = sending_pipe(source)
    e_pipe = events_pipe(events)
    e_pipe.leases._held.clear()
    background = {*e_pipe.tasks(), *pipe.tasks()}
    sending.dispatch(list(pipe.leases))

    relay = stopping_relay([e_pipe, pipe], shutdown_timeout=5.0)
    claimer = asyncio.create_task(asyncio.sleep(0))
    await asyncio.wait_for(stopping.shutdown(relay, claimer, background), 10)
    assert source.rows == {i: [20, "delivered"] for i in IDS}
    assert "release" not in [call for call, _ in source.calls]


async def test_one_pipes_failing_close_keeps_no_other_pipe_from_its_release(
    monkeypatch: Any,
) -> None:
    import relay.runtime.shutdown as stopping

    events = Table("events", [(i, 10) for i in IDS])
    others = Table("deliveries", [(i, 20) for i in IDS])
    e_pipe = events_pipe(events)
    o_pipe: Pipe[Item] = Pipe("deliveries", others, Leases(Metrics(), Counter()))
    o_pipe.leases.claimed([Item(i, 20, Lease(time.monotonic() + 3600)) for i in IDS])

    async def broken(timeout: float) -> bool:
        raise RuntimeError("a bug in the events' completer")

    e_pipe.completer.close = broken  # type: ignore[method-assign]
    background = {*e_pipe.tasks(), *o_pipe.tasks()}

    relay = stopping_relay([e_pipe, o_pipe], shutdown_timeout=0.1)
    claimer = asyncio.create_task(asyncio.sleep(0))
    await asyncio.wait_for(stopping.shutdown(relay, claimer, background), 10)
    assert ("release", [(1, 20), (2, 20), (3, 20)]) in others.calls
    assert ("release", [(1, 10), (2, 10), (3, 10)]) in events.calls


class Walking(ItemSource):
    """A source whose claims leave off mid-way (a walk cut by its scan limit): each takes one
    row and says it is still due, until its rows are all claimed."""

    async def claim(self, limit: int, held: Iterable[Item]) -> Sequence[Item]:
        self.limits.append(limit)
        n = len(self.limits)
        self.due = n < 3
        return [Item(n, 20, Lease(time.monotonic() + 3600))] if n <= 3 else []


async def test_a_source_still_due_after_its_claim_is_claimed_again_at_once() -> None:
    source = Walking()
    claimer, sent, _ = claimer_for(source, room=100)
    task = asyncio.create_task(claimer.run())
    await asyncio.sleep(0.2)  # the poll is 5 s
    assert sent == [[1], [2], [3]]
    await stop(claimer, task)


class Endless(ItemSource):
    """A source with a backlog that never ends: every claim is full."""

    async def claim(self, limit: int, held: Iterable[Item]) -> Sequence[Item]:
        self.limits.append(limit)
        await asyncio.sleep(0.005)
        return []

    @property
    def due(self) -> bool:
        return True

    @due.setter
    def due(self, value: bool) -> None:
        return None


async def test_the_events_are_still_polled_while_a_source_is_claimed_at_once() -> None:
    """A source that keeps the loop claiming it at once must not keep the events' claim
    from its poll: rows due again (a retry's run_after) are found only by polling."""
    events = EventsStore()
    source = Endless()
    claimer, _, _ = claimer_for(source, events=events)
    claimer.settings = RelaySettings(poll_interval=0.2, batch_size=3, max_in_flight=1000)
    task = asyncio.create_task(claimer.run())
    await asyncio.sleep(0.1)
    before, claims = events.claims, len(source.limits)
    await asyncio.sleep(0.7)
    assert len(source.limits) - claims > 20  # claimed over and over
    assert events.claims - before >= 2  # and the events polled meanwhile, not only at once
    assert events.claims - before < (len(source.limits) - claims) / 4  # not at every turn
    await stop(claimer, task)


async def test_outcomes_that_end_within_the_linger_share_one_statement() -> None:
    """A source's outcomes come one by one (a delivery per request): with a linger, those
    that end within it are written by one statement; without, each goes alone."""
    for linger, writes in ((0.05, 1), (0.0, 3)):
        table = Table("deliveries", [(i, 20) for i in IDS])
        pipe: Pipe[Item] = Pipe("deliveries", table, Leases(Metrics(), Counter()), linger=linger)
        pipe.leases.claimed([Item(i, 20, Lease(time.monotonic() + 3600)) for i in IDS])
        task = asyncio.create_task(pipe.completer.run())
        for i in IDS:
            pipe.completer.add([Record(i, 20, Status.DELIVERED, 1, 0.0, None)])
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)
        assert [call for call, _ in table.calls] == ["record"] * writes, (linger, table.calls)
        assert table.rows == {i: [20, "delivered"] for i in IDS}
        await pipe.completer.close(timeout=1.0)
        await task


async def test_a_stop_does_not_wait_out_the_linger() -> None:
    table = Table("deliveries", [(1, 20)])
    pipe: Pipe[Item] = Pipe("deliveries", table, Leases(Metrics(), Counter()), linger=30.0)
    pipe.leases.claimed([Item(1, 20, Lease(time.monotonic() + 3600))])
    task = asyncio.create_task(pipe.completer.run())
    pipe.completer.add([Record(1, 20, Status.DELIVERED, 1, 0.0, None)])
    await asyncio.sleep(0.05)
    started = time.monotonic()
    assert await pipe.completer.close(timeout=5.0)
    await asyncio.wait_for(task, 1.0)
    assert time.monotonic() - started < 1.0
    assert table.rows[1] == [20, "delivered"]


async def test_a_halt_starts_no_group_and_leaves_the_rows_not_started_held() -> None:
    """A stop halts the sending: a group whose rows were queued behind its first request
    leaves those not started without an outcome, and they stay held for the shutdown to put
    back unattempted (not recorded as crashed, which counts an attempt); rows claimed after
    the halt start no group at all."""
    sending_started = asyncio.Event()
    go_on = asyncio.Event()

    async def send(item: Item) -> Record:
        sending_started.set()
        await go_on.wait()
        return Record(item.id, item.token, Status.DELIVERED, 1, 0.0, None)

    source = Sender(send, group_of=lambda item: 0)
    pipe, sending = sending_pipe(source)
    items = sorted(pipe.leases, key=lambda i: i.id)
    sending.dispatch(items[:2])
    await sending_started.wait()
    sending.halt()
    go_on.set()
    await asyncio.gather(*sending.tasks)
    assert buffered(pipe) == [(IDS[0], "delivered", None)]  # the second is not crashed
    assert sorted(i for i, _ in pipe.leases.tokens()) == list(IDS)  # held, for the release
    sending.dispatch(items[2:])
    assert not sending.tasks and source.groups == [list(IDS[:2])]


async def test_a_row_left_without_an_outcome_after_its_request_went_out_counts_an_attempt() -> None:
    """After a halt, rows a source left without an outcome stay held for the release, unless
    their request had gone out (cut_short says so): that one may have reached its receiver,
    and is recorded as an attempt, as when a stop cuts a group short."""
    go_on = asyncio.Event()
    started = asyncio.Event()

    async def send(item: Item) -> None:
        started.set()
        await go_on.wait()
        return None  # a source that leaves the row without an outcome

    source = Sender(send, group_of=lambda item: 0)
    pipe, sending = sending_pipe(source)
    items = sorted(pipe.leases, key=lambda i: i.id)
    sending.dispatch(items[:2])  # the fake's cut_short: item 1's request had gone out
    await started.wait()
    sending.halt()
    go_on.set()
    await asyncio.gather(*sending.tasks)
    assert buffered(pipe) == [(IDS[0], "pending", "cut short")]
