"""Calls made together (relay/sinks/endpoints/together.py): the calls of a key that arrive while
one runs are made as one run after it; each caller gets that run's result or error; a cancelled
caller takes nothing from the others; and, against a real database, the fan-outs that come
while one runs go out as one statement."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from relay.model import Envelope
from relay.sinks.endpoints.together import Together
from tests.support.relays import wait_until
from tests.test_endpoint_delivery import fetch
from tests.test_endpoint_ops import DEST, endpoint, event
from tests.test_endpoint_source import Served, served


class Runs:
    """A run function whose runs each wait for the test to let them end."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []
        self.gates: list[asyncio.Event] = []
        self.fail: BaseException | None = None
        self.running = 0
        self.most = 0

    async def __call__(self, key: str, items: list[int]) -> list[int]:
        self.calls.append((key, list(items)))
        gate = asyncio.Event()
        self.gates.append(gate)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await gate.wait()
        finally:
            self.running -= 1
        if self.fail is not None:
            raise self.fail
        return sorted(items)

    async def started(self, n: int) -> None:
        await wait_until(lambda: len(self.calls) >= n, timeout=2, what=f"{n} runs started")

    def end(self, i: int) -> None:
        self.gates[i].set()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


Call = asyncio.Task[list[int]]


async def _behind_a_run(
    runs: Runs, *batches: list[int], cap: int = 100, ident: bool = False
) -> tuple[Together[str, int, list[int]], Call, list[Call]]:
    """A Together of key "a" whose first call (its items [0]) runs, and calls of ``batches``
    made while it does: the Together, the first call and the others. ``ident``: items of the
    same last digit never share a run."""
    together: Together[str, int, list[int]] = Together(
        runs, cap=cap, ident=(lambda i: i % 10) if ident else None
    )
    first = asyncio.create_task(together("a", [0]))
    await runs.started(1)
    later = [asyncio.create_task(together("a", b)) for b in batches]
    await _settle()
    return together, first, later


async def test_calls_that_come_while_one_runs_are_made_as_one_run_after_it() -> None:
    runs = Runs()
    _, first, later = await _behind_a_run(runs, [2, 12], [3, 13], [4, 14])
    assert len(runs.calls) == 1  # they wait for the first, not each for the one before
    runs.end(0)
    assert await first == [0]
    await runs.started(2)
    assert runs.calls[1] == ("a", [2, 12, 3, 13, 4, 14])
    runs.end(1)
    assert [await t for t in later] == [[2, 3, 4, 12, 13, 14]] * 3
    assert runs.most == 1 and len(runs.calls) == 2


async def test_a_key_runs_one_at_a_time_and_keys_apart() -> None:
    runs = Runs()
    together: Together[str, int, list[int]] = Together(runs, cap=100)
    a = asyncio.create_task(together("a", [1]))
    b = asyncio.create_task(together("b", [2]))
    await runs.started(2)  # another key's run does not wait
    assert sorted(runs.calls) == [("a", [1]), ("b", [2])]
    runs.end(0)
    runs.end(1)
    assert (await a, await b) == ([1], [2])


async def _end_each(runs: Runs, n: int) -> None:
    """Let ``n`` runs end, one after the other, each once it started."""
    for i in range(n):
        await runs.started(i + 1)
        runs.end(i)


async def test_a_full_group_goes_its_way_and_the_next_call_starts_another() -> None:
    runs = Runs()
    # [4, 5] is over the cap of [1, 2, 3]: the next; [6, 7, 8, 9], alone over it, its own.
    _, first, later = await _behind_a_run(runs, [1, 2], [3], [4, 5], [6, 7, 8, 9], cap=3)
    await _end_each(runs, 4)
    assert [c[1] for c in runs.calls] == [[0], [1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert await first == [0]
    assert [await t for t in later] == [[1, 2, 3], [1, 2, 3], [4, 5], [6, 7, 8, 9]]


async def test_every_caller_of_a_run_that_raises_gets_its_error() -> None:
    runs = Runs()
    together, first, later = await _behind_a_run(runs, [2], [3])
    runs.end(0)
    await first
    await runs.started(2)
    runs.fail = ConnectionResetError("gone")
    runs.end(1)
    for t in later:
        with pytest.raises(ConnectionResetError, match="gone"):
            await t
    # Nothing is left behind: the next call runs.
    runs.fail = None
    nxt = asyncio.create_task(together("a", [9]))
    await runs.started(3)
    runs.end(2)
    assert await nxt == [9]


async def test_when_the_caller_that_runs_is_cancelled_the_others_run_without_it() -> None:
    runs = Runs()
    _, first, (leader, follower) = await _behind_a_run(runs, [2], [3])
    runs.end(0)
    await first
    await runs.started(2)
    assert runs.calls[1] == ("a", [2, 3])
    leader.cancel()  # mid-run: the run is cancelled with it
    with pytest.raises(asyncio.CancelledError):
        await leader
    await runs.started(3)
    assert runs.calls[2] == ("a", [3])  # the follower's items again, not the leader's
    runs.end(2)
    assert await follower == [3]


async def test_a_cancelled_caller_that_waits_leaves_the_run_to_the_others() -> None:
    runs = Runs()
    _, first, (leader, follower) = await _behind_a_run(runs, [2], [3])
    follower.cancel()
    with pytest.raises(asyncio.CancelledError):
        await follower
    runs.end(0)
    await first
    await runs.started(2)
    runs.end(1)
    # Its items were given: they go in the run (a fan-out of its events is safe to make).
    assert await leader == [2, 3]
    assert len(runs.calls) == 2


async def test_a_leader_cancelled_before_its_turn_leaves_nothing_open() -> None:
    runs = Runs()
    together, first, (leader,) = await _behind_a_run(runs, [2])
    leader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leader
    runs.end(0)
    await first
    nxt = asyncio.create_task(together("a", [5]))
    await runs.started(2)
    assert runs.calls[1] == ("a", [5])  # not [2, 5]: the cancelled group is closed
    runs.end(1)
    assert await nxt == [5]


async def test_callers_all_cancelled_at_once_run_nothing_again() -> None:
    """A stop's cancel of every late send in one go (runtime/shutdown.py): the follower of a
    cancelled leader, cancelled itself, must not run its items again."""
    runs = Runs()
    _, first, later = await _behind_a_run(runs, [2], [3])
    runs.end(0)
    await first
    await runs.started(2)
    for t in later:
        t.cancel()
    for t in later:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(t, 1)  # run again, the follower would wait for its gate
    await _settle()
    assert len(runs.calls) == 2


async def test_items_of_one_ident_never_share_a_run() -> None:
    runs = Runs()
    # 12 has the ident of 2: the next run.
    _, first, later = await _behind_a_run(runs, [2], [12], [3], ident=True)
    await _end_each(runs, 3)
    await asyncio.gather(first, *later)
    assert [c[1] for c in runs.calls] == [[0], [2], [12, 3]]


@asynccontextmanager
async def _first_fan_out_waits(
    s: Served, db_url: str, batch: Sequence[Envelope]
) -> AsyncIterator[asyncio.Task[dict[int, int]]]:
    """The fan-out of ``batch`` started and waiting for the fan-outs' lock, which another
    session holds until the block ends."""
    blocker = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await blocker.execute("SELECT pg_advisory_lock($1::int, 1)", s.source.store._serial)
        first = asyncio.create_task(s.source.fan_out(batch, "none"))
        await wait_until(
            lambda: blocker.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            ),
            what="the first fan-out waits for the lock",
        )
        yield first
    finally:
        await blocker.close()  # its lock with it


async def test_fan_outs_that_come_while_one_runs_go_out_as_one_statement(db_url: str) -> None:
    """Three batches of events handed to the deliveries source while the first one's FAN_OUT
    waits (here for the fan-outs' lock, held by another session): two statements in all, each
    batch told of its own events only, one delivery per event."""
    ep = endpoint(db_url)
    for _ in range(3):
        event(db_url, status="pending")
    async with served(db_url) as s:
        statements = s.source.store.store.statements
        envs = await s.source.store.store.claim(DEST, 3)
        assert len(envs) == 3
        async with _first_fan_out_waits(s, db_url, envs[:1]) as first:
            rest = [asyncio.create_task(s.source.fan_out([e], "none")) for e in envs[1:]]
            await asyncio.sleep(0.2)
            assert statements["fan_out"] == 1
        answers = await asyncio.gather(first, *rest)
        assert answers == [{e.id: 1} for e in envs]
        assert statements["fan_out"] == 2
        assert s.source._fanning == 0  # each call took back what it expected
    rows = await fetch(db_url, "SELECT event_id, endpoint_id FROM outbox_deliveries ORDER BY 1")
    assert [tuple(r) for r in rows] == [(e.id, ep) for e in envs]


async def test_a_stale_claim_gathered_with_its_events_new_claim_is_not_told_it_was_recorded(
    db_url: str,
) -> None:
    """An event claimed again by this relay (its first claim's lease ran out in a stall, it was
    reaped, and claimed anew) while the first claim's batch still waits for its fan-out: both
    batches gathered in one FAN_OUT. Only the new claim's token is recorded; the stale batch
    must not be told its event was delivered (alone, its FAN_OUT answered nothing for it)."""
    endpoint(db_url)
    for _ in range(2):
        event(db_url, status="pending")
    async with served(db_url) as s:
        envs = await s.source.store.store.claim(DEST, 2)
        assert len(envs) == 2
        stale = envs[1]
        async with _first_fan_out_waits(s, db_url, envs[:1]) as first:
            # Reaped and claimed again by this relay: a new fencing token.
            await fetch(db_url, "UPDATE outbox SET claims = claims + 1 WHERE id = $1", stale.id)
            fresh = dataclasses.replace(stale, token=stale.token + 1)
            old = asyncio.create_task(s.source.fan_out([stale], "none"))
            new = asyncio.create_task(s.source.fan_out([fresh], "none"))
            await asyncio.sleep(0.1)
        answers = await asyncio.gather(first, old, new)
    assert answers == [{envs[0].id: 1}, {}, {stale.id: 1}]
