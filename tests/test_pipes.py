"""Two sources of claimable rows on one pipeline: the events and another table whose ids are
the same numbers (as endpoint deliveries' ids may be). Each source has its own pipe (Leases,
Completer, heartbeat, release), and nothing one does reaches the other's rows. Pure: the two
sources are tables in memory that answer the lease statements as the database does."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import asyncpg
from structlog.testing import capture_logs

from outbox.status import Status
from relay.config import RelaySettings
from relay.db.store import Record
from relay.maintenance.reaper import FULL_EVERY, MARGIN, REAP_LIMIT, Reaper
from relay.model import Envelope, Lease
from relay.obs.metrics import Metrics
from relay.pipeline.claimer import Claimer, Feed
from relay.pipeline.completer import Completer
from relay.pipeline.leases import Leases
from relay.runtime.pipes import EVENTS, Pipe
from relay.runtime.shutdown import release_leftover
from tests.webhook_helpers import envelope

IDS = (1, 2, 3)


@dataclass(slots=True, eq=False)
class Item:
    """A row of the other source, as its Leases holds it (a Held that is no Envelope)."""

    id: int
    token: int
    lease: Lease
    destination: str = "hooks"
    key: str | None = None


@dataclass(slots=True, unsafe_hash=True)
class LoggedRecord(Record):
    """A source's record with fields of its own (as a delivery's, with its attempt's log)."""

    http_status: int | None = None
    response: str | None = None


class Table:
    """A source's rows in memory: id -> [token, status]. Its statements apply to a row only
    under the token of its current claim, as the SQL ones do; every call is noted."""

    def __init__(self, name: str, rows: Iterable[tuple[int, int]]) -> None:
        self.name = name
        self.rows = {i: [token, "running"] for i, token in rows}
        self.calls: list[tuple[str, list[tuple[int, int]]]] = []
        self.refuse: set[int] = set()  # ids whose outcome this "database" refuses

    def _mine(self, i: int, token: int) -> bool:
        return i in self.rows and self.rows[i][0] == token and self.rows[i][1] == "running"

    async def record(self, records: Sequence[Record]) -> set[tuple[int, int]]:
        self.calls.append(("record", [(r.id, r.token) for r in records]))
        if any(r.id in self.refuse and r.status != Status.FAILED for r in records):
            raise asyncpg.DataError("value out of range")
        written = set()
        for r in records:
            if self._mine(r.id, r.token):
                self.rows[r.id][1] = str(r.status)
                written.add((r.id, r.token))
        return written

    async def heartbeat(self, leases: Sequence[tuple[int, int]]) -> set[int]:
        self.calls.append(("heartbeat", list(leases)))
        return {i for i, t in leases if self._mine(i, t)}

    async def settled(self, leases: Sequence[tuple[int, int]]) -> set[int]:
        self.calls.append(("settled", list(leases)))
        return {i for i, t in leases if self.rows.get(i, [None, None]) == [t, "delivered"]}

    async def release(self, leases: Sequence[tuple[int, int]]) -> None:
        self.calls.append(("release", list(leases)))
        for i, t in leases:
            if self._mine(i, t):
                self.rows[i][1] = "pending"

    def taken_back(self, i: int) -> None:
        """Reaped after a stall, and claimed again by another relay."""
        self.rows[i] = [self.rows[i][0] + 1, "running"]


def events_pipe(table: Table) -> Pipe[Envelope]:
    envs = [dataclasses.replace(envelope(id=i), token=10) for i in IDS]
    pipe: Pipe[Envelope] = Pipe(EVENTS, table, Leases(Metrics(), Counter()))
    pipe.leases.claimed(envs)
    return pipe


def items_pipe(table: Table) -> Pipe[Item]:
    lease = Lease(time.monotonic() + 3600)
    pipe: Pipe[Item] = Pipe("deliveries", table, Leases(Metrics(), Counter()))
    pipe.leases.claimed([Item(i, 20, lease) for i in IDS])
    return pipe


def two_pipes() -> tuple[Table, Pipe[Envelope], Table, Pipe[Item]]:
    events = Table("events", [(i, 10) for i in IDS])
    others = Table("deliveries", [(i, 20) for i in IDS])
    return events, events_pipe(events), others, items_pipe(others)


async def test_a_heartbeat_renews_and_loses_only_its_own_sources_rows() -> None:
    events, e_pipe, others, o_pipe = two_pipes()
    others.taken_back(2)  # the other source's row 2 was reaped: its events' twin was not
    [(name, job, interval, _)] = o_pipe.jobs(30.0)
    assert (name, interval) == ("heartbeat:deliveries", 10.0)
    await job()
    assert events.calls == []
    assert others.calls == [
        ("heartbeat", [(1, 20), (2, 20), (3, 20)]),
        ("settled", [(2, 20)]),
    ]
    assert o_pipe.leases.tokens() == [(1, 20), (3, 20)]
    assert [i.id for i in o_pipe.leases.take_dropped()] == [2]
    # The events' row 2 is still held, sendable and renewed by its own heartbeat.
    assert e_pipe.leases.tokens() == [(1, 10), (2, 10), (3, 10)]
    assert all(e.held() for e in e_pipe.leases)
    [(name, job, _, _)] = e_pipe.jobs(30.0)
    assert name == "heartbeat"  # the events' jobs keep their names
    others.calls.clear()
    await job()
    assert events.calls == [("heartbeat", [(1, 10), (2, 10), (3, 10)])]
    assert others.calls == []
    assert e_pipe.leases.tokens() == [(1, 10), (2, 10), (3, 10)]


async def test_outcomes_are_written_to_their_own_source_and_let_go_of_there_only() -> None:
    events, e_pipe, others, o_pipe = two_pipes()
    o_pipe.leases.handed(list(o_pipe.leases))
    o_pipe.completer.add(
        [
            Record(1, 20, Status.DELIVERED, 1, 0.0, None),
            Record(2, 20, Status.PENDING, 1, 5.0, "503"),
        ]
    )
    assert await o_pipe.completer.flush_once()
    assert events.calls == [] and events.rows[1] == [10, "running"]
    assert others.rows[1] == [20, "delivered"] and others.rows[2] == [20, "pending"]
    assert o_pipe.leases.tokens() == [(3, 20)]
    assert o_pipe.leases.stats == Counter({Status.DELIVERED: 1, Status.PENDING: 1})
    # The events' rows of the same ids are still held, and nothing of theirs was counted.
    assert e_pipe.leases.tokens() == [(1, 10), (2, 10), (3, 10)]
    assert e_pipe.leases.stats == Counter()
    # The events' own outcome of row 3 leaves the other source's row 3 held.
    e_pipe.completer.add([Record(3, 10, Status.DELIVERED, 1, 0.0, None)])
    assert await e_pipe.completer.flush_once()
    assert others.rows[3] == [20, "running"] and o_pipe.leases.tokens() == [(3, 20)]
    assert e_pipe.leases.tokens() == [(1, 10), (2, 10)]


async def test_an_outcome_of_a_stale_claim_is_lost_in_its_own_source_only() -> None:
    """An outcome under an older token: the other source's row was claimed again meanwhile."""
    events, e_pipe, others, o_pipe = two_pipes()
    others.taken_back(1)
    with capture_logs() as logs:
        o_pipe.completer.add([Record(1, 20, Status.DELIVERED, 1, 0.0, None)])
        assert await o_pipe.completer.flush_once()
    assert [e["ids"] for e in logs if e["event"] == "relay.lease.lost"] == [[1]]
    assert o_pipe.leases.stats["lease_lost"] == 1 and e_pipe.leases.stats["lease_lost"] == 0
    assert others.rows[1] == [21, "running"]  # the newer claim's, untouched
    assert events.calls == [] and e_pipe.leases.tokens() == [(1, 10), (2, 10), (3, 10)]


async def test_a_lost_row_of_one_source_is_still_sendable_in_the_other() -> None:
    _, e_pipe, _, o_pipe = two_pipes()
    o_pipe.leases.lose([i for i in o_pipe.leases if i.id == 1], "lease not renewed")
    assert 1 in next(iter(o_pipe.leases.take_dropped())).lease.lost
    assert [e.id for e in e_pipe.leases if e.held()] == list(IDS)


async def test_a_shutdown_releases_each_sources_rows_through_that_source() -> None:
    events, e_pipe, others, o_pipe = two_pipes()
    with capture_logs() as logs:
        for pipe in (e_pipe, o_pipe):
            await release_leftover(pipe.source, pipe.leases.tokens(), 1.0, **pipe.fields)
    assert events.calls == [("release", [(1, 10), (2, 10), (3, 10)])]
    assert others.calls == [("release", [(1, 20), (2, 20), (3, 20)])]
    released = [e for e in logs if e["event"] == "relay.released"]
    assert [(e["count"], e.get("source")) for e in released] == [(3, None), (3, "deliveries")]


async def test_a_refused_outcome_fails_its_row_with_the_fields_of_its_records_kept() -> None:
    """A record the database refuses is replaced by its row's failure: a copy, so that a
    source's own fields (the attempt's log) go with it."""
    others = Table("deliveries", [(7, 20)])
    written: list[Sequence[Record]] = []
    completer = Completer(others, lambda records, w, a: written.append(records))
    others.refuse.add(7)
    bad = LoggedRecord(7, 20, Status.PENDING, 1, 5.0, "boom", "hooks", None, False, 503, "busy")
    completer.add([bad])
    assert await completer.flush_once()
    [[failed]] = written
    assert isinstance(failed, LoggedRecord)
    assert (failed.status, failed.counted, failed.http_status, failed.response) == (
        Status.FAILED,
        1,
        503,
        "busy",
    )
    assert failed.error is not None and "could not record" in failed.error
    assert others.rows[7] == [20, "failed"]


def test_statuses_of_another_source_are_compared_by_value() -> None:
    """A source whose records carry plain strings: "pending" is pending, "cancelled" ends
    its row (the next row of its key may go)."""
    leases: Leases[Item] = Leases(Metrics(), Counter())
    lease = Lease(time.monotonic() + 3600)
    leases.claimed([Item(1, 20, lease, key="k"), Item(2, 20, lease, key="k")])
    pending = Record(1, 20, "pending", 1, 5.0, "503", "hooks", "k")  # type: ignore[arg-type]
    assert not leases.recorded([pending], {(1, 20)}, set())
    cancelled = Record(2, 20, "cancelled", 0, 0.0, None, "hooks", "k")  # type: ignore[arg-type]
    assert leases.recorded([cancelled], {(2, 20)}, set())


# --- the claimer and the reaper serve another source beside the events ----------------------


class EventsStore:
    """Claims the events 1..3 of destination d once."""

    def __init__(self) -> None:
        self.claims = 0

    async def claim(self, destination: str, limit: int) -> list[Envelope]:
        self.claims += 1
        if self.claims > 1:
            return []
        return [dataclasses.replace(envelope("d", id=i), token=10) for i in IDS]


class ItemSource(Table):
    """The other source, claiming its rows 1..3 once, when woken."""

    def __init__(self) -> None:
        super().__init__("deliveries", [(i, 20) for i in IDS])
        self.due = True
        self.limits: list[int] = []
        self.held: list[list[int]] = []
        self.reaped = 0
        self.withins: list[float | None] = []
        self.woken = 0

    async def claim(self, limit: int, held: Iterable[Item]) -> Sequence[Item]:
        self.limits.append(limit)
        self.held.append(sorted(i.id for i in held))
        self.due = False
        lease = Lease(time.monotonic() + 3600)
        return [Item(i, 20, lease) for i in IDS] if len(self.limits) == 1 else []

    async def reap(
        self, max_attempts: int, limits: Mapping[str, int], within: float | None = None
    ) -> int:
        self.withins.append(within)
        return self.reaped

    def wake(self) -> None:
        self.woken += 1
        self.due = True


async def test_the_claimer_holds_and_dispatches_each_sources_rows_apart() -> None:
    metrics = Metrics()
    stats: Counter[str] = Counter()
    leases: Leases[Envelope] = Leases(metrics, stats)
    source = ItemSource()
    other: Leases[Item] = Leases(metrics, Counter())
    events_sent: list[list[int]] = []
    items_sent: list[list[int]] = []
    sink = SimpleNamespace(available=lambda destination: True, claim_limit=lambda d, n: n)
    routes = {"d": SimpleNamespace(sink=sink, name="d", ordered=False)}
    claimer = Claimer(
        RelaySettings(poll_interval=5.0, batch_size=100, max_in_flight=1000),
        routes,  # type: ignore[arg-type]
        EventsStore(),  # type: ignore[arg-type]
        leases,
        lambda batch: events_sent.append([e.id for e in batch]),
        frozenset,
        metrics,
        stats,
        asyncio.Event(),
        sources=[Feed(source, other, lambda b: items_sent.append([i.id for i in b]), 5)],
    )
    task = asyncio.create_task(claimer.run())
    await asyncio.sleep(0.2)
    assert events_sent == [[1, 2, 3]] and items_sent == [[1, 2, 3]]
    assert source.limits == [5]  # its own room, not the events'
    assert leases.tokens() == [(1, 10), (2, 10), (3, 10)]
    assert other.tokens() == [(1, 20), (2, 20), (3, 20)]
    assert stats["claimed"] == 3  # the events' count only
    # Not due, claimed less than a poll ago: a wake-up claims the events, not the source.
    claimer.wake()
    await asyncio.sleep(0.1)
    assert len(source.limits) == 1
    source.wake()
    claimer.wake_sources()  # what the source's on_due is set to
    await asyncio.sleep(0.1)
    assert source.limits == [5, 2] and source.held == [[], [1, 2, 3]]  # the room left
    claimer.stopping.set()
    await task


class _Batches:
    async def reap(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []


class _NoExpiredEvents:
    """The reaper's store, with no event's lease expired."""

    lease = 30.0
    batch_leases = _Batches()

    async def reap(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []

    async def forget_batches(self, keep: float) -> int:
        return 0


async def test_the_reaper_reaps_each_other_source_after_the_events() -> None:
    class Refusing(ItemSource):
        async def reap(
            self, max_attempts: int, limits: Mapping[str, int], within: float | None = None
        ) -> int:
            raise asyncpg.PostgresError("refused")

    refusing, reaping, idle = Refusing(), ItemSource(), ItemSource()
    reaping.reaped = 2
    woken: list[str] = []
    reaper = Reaper(
        _NoExpiredEvents(),  # type: ignore[arg-type]
        5,
        {},
        Metrics(),
        lambda: woken.append("events"),
        extra=[refusing, reaping, idle],
    )
    with capture_logs() as logs:
        await reaper()
    assert woken == [] and (refusing.woken, reaping.woken, idle.woken) == (0, 1, 0)
    assert [(e["event"], e.get("source")) for e in logs] == [
        ("relay.reap.source_failed", "deliveries"),
        ("relay.source.reaped", "deliveries"),
    ]


async def test_the_reaper_bounds_each_other_sources_pass_after_a_complete_one() -> None:
    """A delivery's reap, as the events': a held snapshot keeps the dead running version of
    every delivery recorded since, each with the lease it had, and a pass over every lease
    ever ended grew with them. After a complete pass, a pass takes only the leases that ended
    since it began (and MARGIN before); every FULL_EVERY, all of them; a pass that reaped its
    limit was not complete, and the next looks as far back as before."""
    source = ItemSource()
    store: Any = _NoExpiredEvents()
    reaper = Reaper(store, 5, {}, Metrics(), lambda: None, extra=[source])
    await reaper()
    await asyncio.sleep(0.05)
    await reaper()
    first, second = source.withins
    assert first is None  # the first pass: every lease ever ended
    assert second is not None and MARGIN <= second < MARGIN + 1.0
    await asyncio.sleep(0.2)
    source.reaped = REAP_LIMIT  # a pass cut at its limit: not complete
    await reaper()
    source.reaped = 0
    await reaper()
    cut, after = source.withins[2:]
    # Both from the last complete pass, 0.2 s back and more: the cut one did not count.
    assert cut is not None and after is not None and MARGIN + 0.2 <= cut <= after
    reaper._source_full[0] = time.monotonic() - FULL_EVERY  # a full pass is due
    await reaper()
    assert source.withins[-1] is None


class Backlog(ItemSource):
    """A source with more rows than a claim takes: each claim returns ``limit`` fresh rows.
    Due once (woken); what it claims says nothing of its due-ness afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.next_id = 1

    async def claim(self, limit: int, held: Iterable[Item]) -> Sequence[Item]:
        self.limits.append(limit)
        self.due = False
        lease = Lease(time.monotonic() + 3600)
        items = [Item(i, 20, lease) for i in range(self.next_id, self.next_id + limit)]
        self.next_id += limit
        return items


async def test_a_source_whose_claim_came_back_full_is_claimed_again_at_once() -> None:
    """Feed's contract: claimed "at once again after a full claim", until its room is used;
    not one batch a poll interval while a backlog waits."""
    metrics = Metrics()
    stats: Counter[str] = Counter()
    source = Backlog()
    other: Leases[Item] = Leases(metrics, Counter())
    sink = SimpleNamespace(available=lambda destination: True, claim_limit=lambda d, n: n)
    routes = {"d": SimpleNamespace(sink=sink, name="d", ordered=False)}
    claimer = Claimer(
        RelaySettings(poll_interval=5.0, batch_size=3, max_in_flight=1000),
        routes,  # type: ignore[arg-type]
        EventsStore(),  # type: ignore[arg-type]
        Leases(metrics, stats),
        lambda batch: None,
        frozenset,
        metrics,
        stats,
        asyncio.Event(),
        sources=[Feed(source, other, lambda b: None, 9)],
    )
    task = asyncio.create_task(claimer.run())
    try:
        await asyncio.sleep(0.3)  # far less than the poll interval
        assert source.limits == [3, 3, 3]  # its room of 9, in full claims of 3
        assert len(other) == 9
    finally:
        claimer.stopping.set()
        claimer.wake()
        await task


async def test_log_lines_about_another_sources_rows_say_whose_rows_they_are() -> None:
    """Ids of two sources collide: a lost lease or a refused outcome logged by id alone
    would name the events' row of that id as well. The shutdown's lines say the source;
    the leases' and the completer's must too."""
    _, e_pipe, others, o_pipe = two_pipes()
    others.taken_back(1)
    others.refuse.add(2)
    with capture_logs() as logs:
        o_pipe.completer.add([Record(1, 20, Status.DELIVERED, 1, 0.0, None)])
        assert await o_pipe.completer.flush_once()
        o_pipe.completer.add([Record(2, 20, Status.PENDING, 1, 5.0, "503")])
        assert await o_pipe.completer.flush_once()
        e_pipe.leases.lose([e for e in e_pipe.leases if e.id == 1], "lease not renewed")
    lost = [(e["ids"], e.get("source")) for e in logs if e["event"] == "relay.lease.lost"]
    assert lost == [([1], "deliveries"), ([1], None)]
    rejected = [(e["id"], e.get("source")) for e in logs if e["event"] == "relay.record.rejected"]
    assert rejected == [(2, "deliveries")]


class _StoppingStore:
    """What a shutdown asks of the store beyond the pipes' statements: nothing to do."""

    pool = SimpleNamespace(close=lambda: asyncio.sleep(0), terminate=lambda: None)

    async def disown(self) -> None:
        return None

    async def unregister(self) -> None:
        return None


def stopping_relay(pipes: Sequence[Pipe[Any]], *, shutdown_timeout: float) -> Any:
    """A relay as relay.runtime.shutdown reads it, over ``pipes`` alone."""
    return SimpleNamespace(
        settings=SimpleNamespace(relay=SimpleNamespace(shutdown_timeout=shutdown_timeout)),
        metrics=Metrics(),
        http=None,
        pipes=list(pipes),
        sinks={},
        store=_StoppingStore(),
    )


class Hanging(Table):
    """A source whose outcome writes never return (a hung connection)."""

    async def record(self, records: Sequence[Record]) -> set[tuple[int, int]]:
        self.calls.append(("record", [(r.id, r.token) for r in records]))
        try:
            await asyncio.Event().wait()
        finally:
            self.calls.append(("record cut short", []))
        raise AssertionError("unreachable")


async def test_a_shutdown_writes_then_releases_each_pipe_and_a_hung_one_holds_back_no_other(
    monkeypatch: Any,
) -> None:
    """shutdown() itself, over two pipes: the events' outcome is written and the rest of its
    rows released; the other source's write hangs, so its completer is given up (said, with
    the source) and cancelled, and all its rows are released, after that and only once."""
    import relay.runtime.shutdown as stopping

    monkeypatch.setattr(stopping, "FINAL_BUDGET", 2.0)
    events = Table("events", [(i, 10) for i in IDS])
    others = Hanging("deliveries", [(i, 20) for i in IDS])
    e_pipe, o_pipe = events_pipe(events), items_pipe(others)
    background = {*e_pipe.tasks(), *o_pipe.tasks()}
    e_pipe.completer.add([Record(1, 10, Status.DELIVERED, 1, 0.0, None)])
    o_pipe.completer.add([Record(1, 20, Status.DELIVERED, 1, 0.0, None)])

    relay = stopping_relay([e_pipe, o_pipe], shutdown_timeout=0.1)
    claimer = asyncio.create_task(asyncio.sleep(0))
    with capture_logs() as logs:
        await asyncio.wait_for(stopping.shutdown(relay, claimer, background), 10)
    assert all(t.done() for t in background)
    assert events.calls == [("record", [(1, 10)]), ("release", [(2, 10), (3, 10)])]
    # The hung write is stopped before its rows are released, not after.
    assert others.calls == [
        ("record", [(1, 20)]),
        ("record cut short", []),
        ("release", [(1, 20), (2, 20), (3, 20)]),
    ]
    assert events.rows[1] == [10, "delivered"] and others.rows[1] == [20, "pending"]
    unrecorded = [
        (e["outcomes"], e.get("source")) for e in logs if e["event"] == "relay.shutdown.unrecorded"
    ]
    assert unrecorded == [(1, "deliveries")]


async def test_rows_in_flight_and_leases_lost_are_counted_by_source() -> None:
    """outbox_in_flight_rows and outbox_leases_lost_total say whose rows they are: a
    delivery whose lease was lost is not counted as an event's, and the deliveries held show
    beside the events (before, they were not shown at all)."""
    metrics = Metrics()
    events, others = Table("events", [(i, 10) for i in IDS]), Table("deliveries", [(1, 20)])
    e_pipe: Pipe[Envelope] = Pipe(
        EVENTS, events, Leases(metrics, Counter()), gauge=metrics.in_flight.labels(EVENTS)
    )
    e_pipe.leases.claimed([dataclasses.replace(envelope(id=i), token=10) for i in IDS])
    o_pipe: Pipe[Item] = Pipe(
        "deliveries",
        others,
        Leases(metrics, Counter()),
        gauge=metrics.in_flight.labels("deliveries"),
    )
    o_pipe.leases.claimed([Item(1, 20, Lease(time.monotonic() + 3600))])
    others.taken_back(1)
    await o_pipe.leases.heartbeat(others, 30.0)

    def value(name: str, source: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"source": source})

    assert value("outbox_in_flight_rows", "events") == 3
    assert value("outbox_in_flight_rows", "deliveries") == 0  # lost: no longer held
    assert value("outbox_leases_lost_total", "deliveries") == 1
    assert value("outbox_leases_lost_total", "events") in (None, 0)
