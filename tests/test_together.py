"""Calls made together (relay/sinks/endpoints/together.py): the calls of a key that arrive while
one runs are made as one run after it; each caller gets that run's result or error; a cancelled
caller takes nothing from the others; and, against a real database, the fan-outs that come
while one runs go out as one statement."""

from __future__ import annotations

import asyncio
import dataclasses

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from relay.sinks.endpoints.together import Together
from tests.support.relays import wait_until
from tests.test_endpoint_ops import DEST, endpoint, event
from tests.test_endpoint_source import served


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


async def test_calls_that_come_while_one_runs_are_made_as_one_run_after_it() -> None:
    runs = Runs()
    together: Together[str, int, list[int]] = Together(runs, cap=100)
    first = asyncio.create_task(together("a", [1]))
    await runs.started(1)
    later = [asyncio.create_task(together("a", [n, n + 10])) for n in (2, 3, 4)]
    await _settle()
    assert together.waiting("a") == 6
    assert len(runs.calls) == 1  # they wait for the first, not each for the one before
    runs.end(0)
    assert await first == [1]
    await runs.started(2)
    assert runs.calls[1] == ("a", [2, 12, 3, 13, 4, 14])
    assert together.waiting("a") == 0  # the group runs: a call now starts the next one
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


async def test_a_full_group_goes_its_way_and_the_next_call_starts_another() -> None:
    runs = Runs()
    together: Together[str, int, list[int]] = Together(runs, cap=3)
    first = asyncio.create_task(together("a", [0]))
    await runs.started(1)
    second = asyncio.create_task(together("a", [1, 2]))
    third = asyncio.create_task(together("a", [3]))
    fourth = asyncio.create_task(together("a", [4, 5]))  # over the cap of [1, 2, 3]: the next
    big = asyncio.create_task(together("a", [6, 7, 8, 9]))  # alone over the cap: its own group
    await _settle()
    for i in range(3):
        runs.end(i)
        await runs.started(i + 2)
    runs.end(3)
    assert [c[1] for c in runs.calls] == [[0], [1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert await first == [0]
    assert await second == await third == [1, 2, 3]
    assert await fourth == [4, 5] and await big == [6, 7, 8, 9]


async def test_every_caller_of_a_run_that_raises_gets_its_error() -> None:
    runs = Runs()
    together: Together[str, int, list[int]] = Together(runs, cap=100)
    first = asyncio.create_task(together("a", [1]))
    await runs.started(1)
    later = [asyncio.create_task(together("a", [n])) for n in (2, 3)]
    await _settle()
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
    together: Together[str, int, list[int]] = Together(runs, cap=100)
    first = asyncio.create_task(together("a", [1]))
    await runs.started(1)
    leader = asyncio.create_task(together("a", [2]))
    follower = asyncio.create_task(together("a", [3]))
    await _settle()
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
    together: Together[str, int, list[int]] = Together(runs, cap=100)
    first = asyncio.create_task(together("a", [1]))
    await runs.started(1)
    leader = asyncio.create_task(together("a", [2]))
    follower = asyncio.create_task(together("a", [3]))
    await _settle()
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
    together: Together[str, int, list[int]] = Together(runs, cap=100)
    first = asyncio.create_task(together("a", [1]))
    await runs.started(1)
    leader = asyncio.create_task(together("a", [2]))
    await _settle()
    leader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leader
    assert together.waiting("a") == 0
    runs.end(0)
    await first
    nxt = asyncio.create_task(together("a", [5]))
    await runs.started(2)
    assert runs.calls[1] == ("a", [5])
    runs.end(1)
    assert await nxt == [5]


async def test_callers_all_cancelled_at_once_run_nothing_again() -> None:
    """A stop's cancel of every late send in one go (runtime/shutdown.py): the follower of a
    cancelled leader, cancelled itself, must not run its items again."""
    runs = Runs()
    together: Together[str, int, list[int]] = Together(runs, cap=100)
    first = asyncio.create_task(together("a", [1]))
    await runs.started(1)
    leader = asyncio.create_task(together("a", [2]))
    follower = asyncio.create_task(together("a", [3]))
    await _settle()
    runs.end(0)
    await first
    await runs.started(2)
    for t in (leader, follower):
        t.cancel()
    for t in (leader, follower):
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(t, 1)  # run again, the follower would wait for its gate
    await _settle()
    assert len(runs.calls) == 2 and together.waiting("a") == 0


async def test_items_of_one_ident_never_share_a_run() -> None:
    runs = Runs()
    together: Together[str, int, list[int]] = Together(runs, cap=100, ident=lambda i: i % 10)
    first = asyncio.create_task(together("a", [1]))
    await runs.started(1)
    a = asyncio.create_task(together("a", [2]))
    b = asyncio.create_task(together("a", [12]))  # the same ident as 2: the next run
    c = asyncio.create_task(together("a", [3]))
    await _settle()
    for i in range(2):
        runs.end(i)
        await runs.started(i + 2)
    runs.end(2)
    await asyncio.gather(first, a, b, c)
    assert [c[1] for c in runs.calls] == [[1], [2], [12, 3]]


async def test_fan_outs_that_come_while_one_runs_go_out_as_one_statement(db_url: str) -> None:
    """Three batches of events handed to the deliveries source while the first one's FAN_OUT
    waits (here for the fan-outs' lock, held by another session): two statements in all, each
    batch told of its own events only, one delivery per event."""
    ep = endpoint(db_url)
    for _ in range(3):
        event(db_url, status="pending")
    async with served(db_url) as s:
        store = s.source.store
        envs = await store.store.claim(DEST, 3)
        assert len(envs) == 3
        blocker = await asyncpg.connect(to_asyncpg_dsn(db_url))
        try:
            await blocker.execute("SELECT pg_advisory_lock($1::int, 1)", store._serial)
            first = asyncio.create_task(s.source.fan_out(envs[:1], "none"))
            await wait_until(
                lambda: blocker.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                ),
                what="the first fan-out waits for the lock",
            )
            rest = [asyncio.create_task(s.source.fan_out([e], "none")) for e in envs[1:]]
            await asyncio.sleep(0.2)
            assert store.store.statements["fan_out"] == 1
            await blocker.execute("SELECT pg_advisory_unlock($1::int, 1)", store._serial)
            answers = await asyncio.gather(first, *rest)
        finally:
            await blocker.close()
        assert answers == [{e.id: 1} for e in envs]
        assert store.store.statements["fan_out"] == 2
        assert s.source._fanning == 0  # each call took back what it expected
        rows = await asyncio.wait_for(
            _deliveries(db_url),
            10,
        )
    assert rows == [(e.id, ep) for e in envs]


async def _deliveries(db_url: str) -> list[tuple[int, int]]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        rows = await conn.fetch(
            "SELECT event_id, endpoint_id FROM outbox_deliveries ORDER BY event_id"
        )
    finally:
        await conn.close()
    return [(r[0], r[1]) for r in rows]


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
        store = s.source.store
        envs = await store.store.claim(DEST, 2)
        assert len(envs) == 2
        stale = envs[1]
        blocker = await asyncpg.connect(to_asyncpg_dsn(db_url))
        try:
            await blocker.execute("SELECT pg_advisory_lock($1::int, 1)", store._serial)
            first = asyncio.create_task(s.source.fan_out(envs[:1], "none"))
            await wait_until(
                lambda: blocker.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                ),
                what="the first fan-out waits for the lock",
            )
            # Reaped and claimed again by this relay: a new fencing token.
            await blocker.execute("UPDATE outbox SET claims = claims + 1 WHERE id = $1", stale.id)
            fresh = dataclasses.replace(stale, token=stale.token + 1)
            old = asyncio.create_task(s.source.fan_out([stale], "none"))
            new = asyncio.create_task(s.source.fan_out([fresh], "none"))
            await asyncio.sleep(0.1)
            await blocker.execute("SELECT pg_advisory_unlock($1::int, 1)", store._serial)
            answers = await asyncio.gather(first, old, new)
        finally:
            await blocker.close()
    assert answers == [{envs[0].id: 1}, {}, {stale.id: 1}]
