"""Per-key ordered delivery: the visibility fence, parking, and order under concurrency."""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any

import asyncpg
import pytest
from structlog.testing import capture_logs

import outbox
from outbox.dburl import to_asyncpg_dsn
from relay.config import RelaySettings
from relay.db import queries
from relay.db.store import Record, Store, create_pool
from relay.model import Envelope, Lease, Outcome
from relay.obs.metrics import Metrics
from relay.pipeline.claimer import Claimer
from relay.pipeline.leases import Leases
from tests.support.relays import running, settings, status_counts, wait_until
from tests.support.sinks import MemorySink


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[Store]:
    pool = await create_pool(to_asyncpg_dsn(db_url), "t", 4)
    store = Store(pool, "public", "t", 30.0)
    try:
        yield store
    finally:
        await store.disown()
        await pool.close()


async def connect(db_url: str) -> asyncpg.Connection:
    return await asyncpg.connect(to_asyncpg_dsn(db_url))


async def add(conn: asyncpg.Connection, key: str | None, n: int = 1, dest: str = "o") -> list[int]:
    async with conn.transaction():
        return await outbox.enqueue_many(
            conn, [{"destination": dest, "key": key, "payload": {"n": i}} for i in range(n)]
        )


def ids(rows: Sequence[Envelope]) -> list[int]:
    return sorted(e.id for e in rows)


async def claim(store: Store, limit: int = 10, park: bool = False, scan: int = 40) -> list[int]:
    """Claim from destination "o" through every key (following the cursor to the end)."""
    ids: list[int] = []
    cursor: str | None = None
    while True:
        rows, cursor = await store.claim_ordered("o", limit - len(ids), park, scan, cursor)
        ids += [e.id for e in rows]
        if cursor is None or len(ids) >= limit:
            return sorted(ids)


async def test_fence_holds_rows_behind_an_uncommitted_lower_id(db_url: str, store: Store) -> None:
    a, b = await connect(db_url), await connect(db_url)
    try:
        tx = a.transaction()
        await tx.start()
        (first,) = await outbox.enqueue_many(a, [{"destination": "o", "key": "k", "payload": b"1"}])
        (second,) = await add(b, "k")  # a later id of the same key commits first
        (other,) = await add(b, "j")
        assert first < second < other
        # id 1 may still commit: nothing after it can go, whatever its key.
        assert await claim(store) == []
        await tx.commit()
        # One head per key: the key's later row waits for its head.
        assert await claim(store) == [first, other]
        assert await claim(store) == []
        await store.record(
            [
                Record(first, 1, "delivered", 1, 0.0, None, "o", "k"),
                Record(other, 1, "delivered", 1, 0.0, None, "o", "j"),
            ]
        )
        assert await claim(store) == [second]
    finally:
        await a.close()
        await b.close()


async def test_rolled_back_lower_id_releases_the_fence(db_url: str, store: Store) -> None:
    a, b = await connect(db_url), await connect(db_url)
    try:
        tx = a.transaction()
        await tx.start()
        await outbox.enqueue(a, destination="o", key="k", payload=b"gone")
        (kept,) = await add(b, "k")
        assert await claim(store) == []
        await tx.rollback()
        assert await claim(store) == [kept]
    finally:
        await a.close()
        await b.close()


async def test_failed_head_blocks_or_is_passed_over(db_url: str, store: Store) -> None:
    conn = await connect(db_url)
    try:
        ids = await add(conn, "k", 3)
        assert await claim(store) == [ids[0]]
        await store.record([Record(ids[0], 1, "failed", 1, 0.0, "poison", "o", "k")])
        # block: the key waits, and says why.
        assert await claim(store) == []
        blocked = await store.blocked_keys(["o"])
        assert [(r["key"], r["failed_id"], r["waiting"]) for r in blocked] == [("k", ids[0], 2)]
        # park: the failed row no longer counts as the key's head.
        assert await claim(store, park=True) == [ids[1]]
    finally:
        await conn.close()


async def test_backing_off_head_holds_its_key_only(db_url: str, store: Store) -> None:
    conn = await connect(db_url)
    try:
        k = await add(conn, "k", 2)
        j = await add(conn, "j", 2)
        assert await claim(store) == [k[0], j[0]]
        await store.record(
            [
                Record(k[0], 1, "pending", 1, 60.0, "try later", "o", "k"),  # backoff
                Record(j[0], 1, "delivered", 1, 0.0, None, "o", "j"),
            ]
        )
        assert await claim(store) == [j[1]]  # k's head is not due, so k waits
    finally:
        await conn.close()


@pytest.mark.parametrize("park", [False, True])
async def test_a_row_in_flight_holds_its_key_wherever_it_is(
    db_url: str, store: Store, park: bool
) -> None:
    """A key never has two rows in flight, even when its running row is not its lowest open
    one (rows claimed while the destination was unordered, or an operator's retry of an
    earlier row): the earlier row waits for the running one's outcome."""
    conn = await connect(db_url)
    try:
        k = await add(conn, "k", 3)
        j = await add(conn, "j", 1)
        await conn.execute(
            "UPDATE outbox SET status = 'running', locked_by = 'other', claims = 1, "
            "locked_until = now() + interval '1 minute' WHERE id = $1",
            k[1],
        )
        assert await claim(store, park=park) == [j[0]]
        assert await claim(store, park=park) == []
        await conn.execute("UPDATE outbox SET status = 'delivered' WHERE id = $1", k[1])
        assert await claim(store, park=park) == [k[0]]
    finally:
        await conn.close()


async def test_walk_resumes_after_the_cursor(db_url: str, store: Store) -> None:
    conn = await connect(db_url)
    try:
        heads = [(await add(conn, f"key-{i:02}"))[0] for i in range(12)]
        # Examine at most 5 keys per claim: the cursor carries the walk over all keys.
        first, cursor = await store.claim_ordered("o", 100, False, 5, None)
        assert [e.id for e in first] == heads[:5] and cursor == "key-04"
        second, cursor = await store.claim_ordered("o", 100, False, 5, cursor)
        assert [e.id for e in second] == heads[5:10] and cursor == "key-09"
        third, cursor = await store.claim_ordered("o", 100, False, 5, cursor)
        assert [e.id for e in third] == heads[10:] and cursor is None
        # A full batch stops at its last key and says so.
        await conn.execute("UPDATE outbox SET status = 'pending'")
        rows, cursor = await store.claim_ordered("o", 3, False, 50, None)
        assert [e.id for e in rows] == heads[:3] and cursor == "key-02"
    finally:
        await conn.close()


async def test_walk_from_a_cursor_goes_round_to_the_keys_before_it(
    db_url: str, store: Store
) -> None:
    """A round that starts at a cursor walks on past the last key to the first ones, up to
    the cursor's own key: keys that became free behind the cursor are claimed by this
    statement, not left for a claim that only comes at the next wake-up or poll."""
    conn = await connect(db_url)

    async def again() -> None:
        await conn.execute("UPDATE outbox SET status = 'pending'")

    try:
        heads = [(await add(conn, f"key-{i:02}"))[0] for i in range(12)]
        rows, cursor = await store.claim_ordered("o", 100, False, 50, "key-05", "key-05")
        assert ids(rows) == heads and cursor is None
        # A full batch stops at the last key it took, past the wrap; the round goes on from
        # there to its end.
        await again()
        rows, cursor = await store.claim_ordered("o", 8, False, 50, "key-05", "key-05")
        assert ids(rows) == sorted(heads[6:] + heads[:2]) and cursor == "key-01"
        await again()
        rows, cursor = await store.claim_ordered("o", 100, False, 50, cursor, "key-05")
        assert ids(rows) == heads[2:6] and cursor is None
        # The scan limit counts keys across the wrap; its cursor is the last key examined.
        await again()
        rows, cursor = await store.claim_ordered("o", 100, False, 8, "key-05", "key-05")
        assert ids(rows) == sorted(heads[6:] + heads[:2]) and cursor == "key-01"
        # Each key is examined once, the round's own key last: 11 keys leave the round short
        # of it, the 12th ends it (no cursor: the round is over).
        await again()
        rows, cursor = await store.claim_ordered("o", 100, False, 11, "key-05", "key-05")
        assert ids(rows) == sorted(heads[6:] + heads[:5]) and cursor == "key-04"
        await again()
        rows, cursor = await store.claim_ordered("o", 100, False, 12, "key-05", "key-05")
        assert ids(rows) == heads and cursor is None
        # A cursor past every key, before every key, or on the first one: the round still
        # takes every key once. (A round whose own key has no rows cannot tell that its
        # last key examined was its last: a claim of 12 keys says to go on, and the next
        # finds nothing.)
        for start, left in (("zzz", "key-11"), ("", "key-11"), ("key-00", None)):
            await again()
            rows, cursor = await store.claim_ordered("o", 100, False, 12, start, start)
            assert ids(rows) == heads and cursor == left, start
            rows, cursor = await store.claim_ordered("o", 100, False, 12, cursor, start)
            assert rows == [] and cursor is None, start
            await again()
            rows, cursor = await store.claim_ordered("o", 100, False, 13, start, start)
            assert ids(rows) == heads and cursor is None, start
        # A round that began elsewhere ends there, whichever side of the cursor it is.
        await again()
        rows, cursor = await store.claim_ordered("o", 100, False, 50, "key-05", "key-08")
        assert ids(rows) == heads[6:9] and cursor is None
        await again()
        rows, cursor = await store.claim_ordered("o", 100, False, 50, "key-08", "key-02")
        assert ids(rows) == sorted(heads[9:] + heads[:3]) and cursor is None
        # No origin: the round ends at the last key, as when it began with no cursor.
        await again()
        rows, cursor = await store.claim_ordered("o", 100, False, 50, "key-08", None)
        assert ids(rows) == heads[9:] and cursor is None
    finally:
        await conn.close()


@pytest.fixture
async def earlier_release(db_url: str) -> None:
    """A relay of an earlier release serves the ordered destinations of these tests: their
    owner claims by walking the keys, as that relay does (see relay/pipeline/ordered.py)."""
    conn = await connect(db_url)
    try:
        await conn.execute(
            "INSERT INTO outbox_relays (relay_id, destinations) VALUES ('before', $1)",
            ["o", "x", "y", "u"],
        )
    finally:
        await conn.close()


class AlwaysAvailable:
    def available(self, destination: str) -> bool:
        return True

    def claim_limit(self, destination: str, limit: int) -> int:
        return limit


def ordered_claimer(
    store: Store,
    destinations: Sequence[str],
    claimed: list[Envelope],
    unordered: Sequence[str] = (),
    **relay: Any,
) -> Claimer:
    """The real claim loop over ordered destinations (and ``unordered`` ones) whose sinks never
    fill up, with a poll of 5 s (nothing in these tests NOTIFYs) and batches of 10 (40 keys
    examined per claim)."""
    metrics = Metrics()
    routes = {
        d: SimpleNamespace(
            name=d, sink=AlwaysAvailable(), ordered=d not in unordered, parks_poison=False
        )
        for d in [*destinations, *unordered]
    }
    return Claimer(
        RelaySettings(**{"poll_interval": 5.0, "batch_size": 10, **relay}),
        routes,  # type: ignore[arg-type]
        store,
        Leases(metrics, Counter()),
        claimed.extend,
        frozenset,
        metrics,
        Counter(),
        asyncio.Event(),
    )


async def run_for(claimer: Claimer, seconds: float) -> None:
    task = asyncio.create_task(claimer.run())
    await asyncio.sleep(seconds)
    claimer.stopping.set()
    await task


async def fill(conn: asyncpg.Connection, dest: str, keys: int, why: str) -> None:
    """``keys`` keys of two rows each in ``dest``, whose heads cannot be claimed: ``why``."""
    await conn.execute(
        "INSERT INTO outbox (destination, key, payload) SELECT $1, 'k' || lpad(i::text, 4,"
        " '0'), '\\x00' FROM generate_series(1, $2) AS i, generate_series(1, 2) AS j",
        dest,
        keys,
    )
    heads = "id IN (SELECT min(id) FROM outbox WHERE destination = $1 GROUP BY key)"
    await conn.execute(
        {
            "backing off": "UPDATE outbox SET run_after = now() + interval '1 hour'"
            " WHERE destination = $1",
            "blocked": f"UPDATE outbox SET status = 'failed' WHERE {heads}",
            "in flight": "UPDATE outbox SET status = 'running', locked_by = 'other',"
            f" locked_until = now() + interval '1 hour' WHERE {heads}",
        }[why],
        dest,
    )


@pytest.mark.parametrize("why", ["backing off", "blocked", "in flight"])
async def test_a_round_that_claims_nothing_ends_and_waits(
    db_url: str, store: Store, earlier_release: None, why: str
) -> None:
    """Many more keys than a claim examines, none claimable: the claimer walks them all once,
    a claim per scan's worth of keys, then waits for a wake-up or the poll; it does not
    claim again and again (a reviewer's finding: the walk that goes round never reached an
    end, so every claim said to go on)."""
    conn = await connect(db_url)
    try:
        await fill(conn, "o", 100, why)
    finally:
        await conn.close()
    claimed: list[Envelope] = []
    await run_for(ordered_claimer(store, ["o"], claimed), 1.0)
    assert claimed == []
    # 100 keys, 40 per claim: three claims make the round (a fourth if one ends on a key).
    assert 3 <= store.statements["claim"] <= 4, store.statements


async def test_rounds_of_several_ordered_destinations_end_each_on_its_own(
    db_url: str, store: Store, earlier_release: None
) -> None:
    """Two ordered destinations whose rounds take different numbers of claims: each is walked
    once, then waits; the one still walking does not restart the other's round on every
    claim (a review found 1,300 claims before the first wait for 1,000 and 960 keys)."""
    conn = await connect(db_url)
    try:
        await fill(conn, "x", 200, "backing off")
        await fill(conn, "y", 120, "backing off")
    finally:
        await conn.close()
    claimed: list[Envelope] = []
    await run_for(ordered_claimer(store, ["x", "y"], claimed), 1.0)
    assert claimed == []
    # x: 5 claims of 40 keys and one that finds the round's end, y: 3 and one; walked
    # together, the rounds lined up only after 12 claims (24 statements).
    assert store.statements["claim"] == 10, store.statements


async def test_a_small_free_capacity_still_walks_a_whole_claims_worth_of_keys(
    db_url: str, store: Store, earlier_release: None
) -> None:
    """With room for one more row in flight, a claim still examines as many keys as a full
    one: the round takes as many claims as ever, not one per four keys (500 for 2,000)."""
    conn = await connect(db_url)
    try:
        await fill(conn, "o", 100, "backing off")
    finally:
        await conn.close()
    claimed: list[Envelope] = []
    claimer = ordered_claimer(store, ["o"], claimed, max_in_flight=10)
    claimer.leases.claimed(
        [Envelope(-i, "o", None, b"", "", {}, 0, 0.0, 1, Lease(1e12)) for i in range(1, 10)]
    )
    await run_for(claimer, 1.0)
    assert claimed == [] and 3 <= store.statements["claim"] <= 4, store.statements


async def test_a_round_whose_heads_are_locked_elsewhere_ends(
    db_url: str, store: Store, earlier_release: None
) -> None:
    """A batch of heads another transaction holds locked: the claim selects a full batch and
    locks none of it. When the last head selected is the round's own key, the round is over
    all the same (a review found a claim every 2 ms for as long as the locks were held)."""
    conn, holder = await connect(db_url), await connect(db_url)
    try:
        await add(conn, "a")
        for i in range(1, 11):
            await add(conn, f"h{i:02}")
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT id FROM outbox WHERE key LIKE 'h%' ORDER BY id FOR KEY SHARE")
        claimed: list[Envelope] = []
        claimer = ordered_claimer(store, ["o"], claimed)
        # An outcome recorded after the first claim: the next round goes once round from
        # the cursor, h09, and its full batch of locked heads ends on h09 again.
        wake_after_claims(store, claimer, first_only=True)
        await run_for(claimer, 1.0)
        await tx.rollback()
    finally:
        await holder.close()
        await conn.close()
    assert [e.key for e in claimed] == ["a"]
    assert store.statements["claim"] <= 4, store.statements


def wake_after_claims(store: Store, claimer: Claimer, first_only: bool = False) -> None:
    """Wake the claimer after each of its ordered claims (or the first only), as outcomes
    recorded while the claims run would."""
    real = store.claim_ordered
    woken = 0

    async def claim_then_wake(*args: Any) -> tuple[list[Envelope], str | None]:
        nonlocal woken
        result = await real(*args)
        if not (first_only and woken):
            woken += 1
            claimer.wake()
        return result

    store.claim_ordered = claim_then_wake  # type: ignore[method-assign]


@pytest.mark.parametrize("freed", ["a", "zz"])
async def test_a_key_freed_during_a_round_is_claimed_at_the_wake_up(
    db_url: str, store: Store, earlier_release: None, freed: str
) -> None:
    """A wake-up that comes while a round is on its way (an outcome recorded, a NOTIFY) is
    for a key the rest of the round may not reach (a): the claimer goes round again from
    where it stands rather than let the round use up the wake-up and wait for the poll (a
    review: 1.95 s, the poll). Wake-ups after every claim still let the walk reach the last
    keys (zz): each new round starts at the cursor, not at the first key."""
    conn = await connect(db_url)
    try:
        await fill(conn, "o", 100, "backing off")
        claimed: list[Envelope] = []
        claimer = ordered_claimer(store, ["o"], claimed)
        real = store.claim_ordered
        freed_at = asyncio.get_running_loop().create_future()

        async def first_then_free(*args: Any) -> tuple[list[Envelope], str | None]:
            result = await real(*args)
            if not freed_at.done():
                await add(conn, freed)
                freed_at.set_result(asyncio.get_running_loop().time())
            return result

        store.claim_ordered = first_then_free  # type: ignore[method-assign]
        wake_after_claims(store, claimer)
        task = asyncio.create_task(claimer.run())
        await wait_until(lambda: bool(claimed), timeout=3.0)
        took = asyncio.get_running_loop().time() - freed_at.result()
        claimer.stopping.set()
        await task
    finally:
        await conn.close()
    assert [e.key for e in claimed] == [freed] and took < 1.0, took


async def test_a_wake_up_ends_a_rest(db_url: str, store: Store, earlier_release: None) -> None:
    """A destination resting after a round that claimed nothing is claimed at the next
    wake-up (a NOTIFY for its new row), not at the end of its rest."""
    conn = await connect(db_url)
    try:
        await fill(conn, "o", 100, "backing off")
        claimed: list[Envelope] = []
        claimer = ordered_claimer(store, ["o"], claimed)
        task = asyncio.create_task(claimer.run())
        await wait_until(lambda: store.statements["claim"] >= 3)
        await asyncio.sleep(0.3)  # the round is over: resting, the loop waiting
        await add(conn, "new")
        claimer.wake()
        await wait_until(lambda: bool(claimed), timeout=1.0, what="claimed at the wake-up")
        claimer.stopping.set()
        await task
    finally:
        await conn.close()
    assert [e.key for e in claimed] == ["new"]


async def test_a_rest_ends_after_a_poll_interval_while_another_destination_streams(
    db_url: str, store: Store, earlier_release: None
) -> None:
    """An ordered destination rests while another destination's backlog fills every batch
    (the loop never waits): its rows that come due without a wake-up (a backoff over) are
    claimed within about a poll interval all the same."""
    conn = await connect(db_url)
    try:
        await conn.execute(
            "INSERT INTO outbox (destination, payload) SELECT 'u', '\\x00'"
            " FROM generate_series(1, 50000)"
        )
        await conn.execute(
            "INSERT INTO outbox (destination, key, payload, run_after)"
            " VALUES ('o', 'k', '\\x00', now() + interval '0.5 seconds')"
        )
        claimed: list[Envelope] = []
        claimer = ordered_claimer(
            store, ["o"], claimed, unordered=["u"], poll_interval=0.5, max_in_flight=100_000
        )
        task = asyncio.create_task(claimer.run())
        started = asyncio.get_running_loop().time()
        await wait_until(
            lambda: any(e.destination == "o" for e in claimed), timeout=3.0, what="o claimed"
        )
        took = asyncio.get_running_loop().time() - started
        streaming = len(claimed) < 50_001
        claimer.stopping.set()
        await task
    finally:
        await conn.close()
    assert streaming and took < 2.0, took


async def test_fence_ignores_open_inserts_into_another_schemas_outbox(
    db_url: str, store: Store
) -> None:
    """Separate outboxes per schema are separate: a long transaction inserting into one
    holds back the ordered rows of that outbox only."""
    from outbox.migrate import migrate

    await migrate(db_url, schema="elsewhere")
    other = outbox.Outbox(schema="elsewhere")
    a, b = await connect(db_url), await connect(db_url)
    try:
        tx = a.transaction()
        await tx.start()
        await other.enqueue(a, destination="o", key="k", payload=b"open for long")
        (mine,) = await add(b, "k")  # a later id in a sequence of its own, committed
        assert await claim(store) == [mine]
        # The other outbox's own fence does wait for that transaction.
        pool = await create_pool(to_asyncpg_dsn(db_url), "t2", 2)
        try:
            theirs = Store(pool, "elsewhere", "t2", 30.0)
            async with b.transaction():
                await other.enqueue(b, destination="o", key="j", payload=b"committed")
            assert await claim(theirs) == []
            await tx.commit()
            assert len(await claim(theirs)) == 2
        finally:
            await pool.close()
    finally:
        await a.close()
        await b.close()


async def test_fence_counts_inserts_begun_under_the_old_trigger(db_url: str, store: Store) -> None:
    """A transaction that took the untagged key of migration 0003 (it began before 0004 ran)
    still holds the fence back: a rolling upgrade never lets a row pass an open insert."""
    a, b = await connect(db_url), await connect(db_url)
    try:
        tx = a.transaction()
        await tx.start()
        last = await a.fetchval("SELECT coalesce(pg_sequence_last_value('outbox_id_seq'), 0)")
        await a.execute("SELECT pg_advisory_xact_lock_shared(4611686018427387904 + $1)", last)
        (later,) = await add(b, "k")
        assert await claim(store) == []
        await tx.commit()
        assert await claim(store) == [later]
    finally:
        await a.close()
        await b.close()


async def test_an_old_trigger_insert_is_not_hidden_by_a_later_new_one(
    db_url: str, store: Store
) -> None:
    """A transaction that inserted under the trigger of migration 0003 (an untagged key at a
    low value), then, after 0004, inserted again (a tagged and an untagged key at a higher
    value): its first, lower key still holds the fence."""
    a, b = await connect(db_url), await connect(db_url)
    try:
        tx = a.transaction()
        await tx.start()
        low = await a.fetchval("SELECT coalesce(pg_sequence_last_value('outbox_id_seq'), 0)")
        await a.execute("SELECT pg_advisory_xact_lock_shared(4611686018427387904 + $1)", low)
        later = await add(b, "k", 3)  # committed rows above the old insert's key
        await outbox.enqueue(a, destination="o", key="j", payload=b"new trigger")
        assert await claim(store) == []
        await tx.commit()
        assert await claim(store) == [later[0], later[2] + 1]
    finally:
        await a.close()
        await b.close()


async def test_rows_without_a_key_are_not_ordered(db_url: str, store: Store) -> None:
    conn = await connect(db_url)
    try:
        loose = await add(conn, None, 3)
        assert await claim(store) == loose
    finally:
        await conn.close()


async def test_claim_uses_key_index(db_url: str) -> None:
    conn = await connect(db_url)
    try:
        await conn.execute(
            "INSERT INTO outbox (destination, key, payload, status) "
            "SELECT 'o', 'k' || (i % 500), '\\x00'::bytea, 'delivered' "
            "FROM generate_series(1, 30000) i"
        )
        await add(conn, "k1", 50)
        await conn.execute("VACUUM ANALYZE outbox")
        # The claim itself, as the relay runs it: its walk reads the key index, not history.
        plan = await conn.fetchval(
            "EXPLAIN (FORMAT JSON) " + queries.render_ops(queries.CLAIM_ORDERED, "public"),
            "o",
            10,
            "r",
            30.0,
            40,
            False,
            None,
            10**9,
            None,
        )
    finally:
        await conn.close()
    assert "outbox_key_idx" in str(plan) and "Seq Scan" not in str(plan)


class OrderChecker(MemorySink):
    """A sink that fails at random (transiently) and checks the ordering promise itself: a
    row is first sent only after every earlier row of its key was acknowledged."""

    def __init__(self, fail_rate: float, seed: int) -> None:
        self.rng = random.Random(seed)
        self.fail_rate = fail_rate
        self.acked: set[int] = set()
        self.sent_before_ack: list[tuple[int, int]] = []
        self.by_key: dict[str, list[int]] = defaultdict(list)  # first deliveries, in order
        self.expected: dict[str, list[int]] = {}

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
        out = []
        for env in batch:
            assert env.key is not None
            earlier = [i for i in self.expected[env.key] if i < env.id]
            missing = [i for i in earlier if i not in self.acked]
            if missing:
                self.sent_before_ack.append((env.id, missing[0]))
            await asyncio.sleep(0)
            if self.rng.random() < self.fail_rate:
                out.append(Outcome.retry(env.id, "flaky", retry_in=0.01))
                continue
            if env.id not in self.acked:
                self.acked.add(env.id)
                self.by_key[env.key].append(env.id)
            out.append(Outcome.delivered(env.id))
        return out


async def test_three_relays_keep_per_key_order_with_failures_and_late_commits(
    db_url: str,
) -> None:
    keys = [f"acct-{i}" for i in range(40)]
    sink = OrderChecker(fail_rate=0.2, seed=7)
    ids: dict[str, list[int]] = defaultdict(list)
    s = settings(
        db_url,
        "127.0.0.1:1",
        destinations={"o": {"kind": "kafka", "topic": "x", "ordering": "key"}},
        relay={"batch_size": 50, "poll_interval": 0.05, "max_attempts": 100},
    )

    async def writer(w: int) -> None:
        conn = await connect(db_url)
        rng = random.Random(w)
        try:
            for _ in range(25):
                key = rng.choice(keys)
                async with conn.transaction():
                    eid = await outbox.enqueue(conn, destination="o", key=key, payload={"w": w})
                    # Some transactions take their id early and commit late, so later ids of
                    # the same key commit first: the fence must hold those back.
                    if rng.random() < 0.3:
                        await asyncio.sleep(rng.uniform(0.01, 0.15))
                ids[key].append(eid)
        finally:
            await conn.close()

    # The writers add ids here as they commit, so while running the checker knows only the
    # committed rows of each key; the comparison with the complete lists after the run is the
    # decisive check.
    sink.expected = ids
    with capture_logs():
        async with (
            running(s, sinks={"o": sink}),
            running(s, sinks={"o": sink}),
            running(s, sinks={"o": sink}),
        ):
            await asyncio.gather(*(writer(w) for w in range(8)))
            total = sum(len(v) for v in ids.values())
            await wait_until(lambda: _delivered(db_url, total), timeout=60, what="all delivered")
    for key, delivered in sink.by_key.items():
        assert delivered == sorted(ids[key]), key
    assert sum(len(v) for v in sink.by_key.values()) == total == 200
    assert sink.sent_before_ack == []


async def _delivered(db_url: str, n: int) -> bool:
    return (await status_counts(db_url)).get("delivered", 0) == n


class PoisonSink(MemorySink):
    """Delivers everything except the rows whose payload says poison (permanent failure)."""

    def __init__(self) -> None:
        self.delivered: list[int] = []

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
        out = []
        for env in batch:
            if b"poison" in env.payload:
                out.append(Outcome.failed(env.id, "unparseable by the consumer"))
            else:
                self.delivered.append(env.id)
                out.append(Outcome.delivered(env.id))
        return out


async def enqueue_keys(db_url: str, rows: list[tuple[str, str]]) -> list[int]:
    conn = await connect(db_url)
    try:
        async with conn.transaction():
            return await outbox.enqueue_many(
                conn, [{"destination": "o", "key": k, "payload": p} for k, p in rows]
            )
    finally:
        await conn.close()


def run_cli(*args: str) -> str:
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "relay.cli", *args], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.mark.parametrize("policy", ["block", "park"])
async def test_poison_head(db_url: str, policy: str) -> None:
    ids = await enqueue_keys(
        db_url,
        [("a", "a1"), ("a", "poison"), ("a", "a3"), ("b", "b1"), ("b", "b2"), ("a", "a4")],
    )
    a1, bad, a3, b1, b2, a4 = ids
    sink = PoisonSink()
    s = settings(
        db_url,
        "127.0.0.1:1",
        destinations={
            "o": {"kind": "kafka", "topic": "x", "ordering": "key", "poison_policy": policy}
        },
        relay={"poll_interval": 0.05, "report_interval": 0.2},
    )
    with capture_logs() as logs:
        async with running(s, sinks={"o": sink}) as relay:
            await wait_until(lambda: b2 in sink.delivered, what="the other key flows")
            if policy == "park":
                await wait_until(lambda: a4 in sink.delivered, what="key a moves on")
            else:
                await wait_until(
                    lambda: any(e["event"] == "relay.key.blocked" for e in logs),
                    what="blocked key reported",
                )
                assert relay.metrics.blocked_keys.labels("o")._value.get() == 1
    rows = {r["id"]: r for r in await _rows(db_url)}
    assert rows[bad]["status"] == "failed"
    if policy == "park":
        assert [i for i in sink.delivered if i in (a1, a3, a4)] == [a1, a3, a4]
        return
    # block: nothing after the poison row of key a went out; key b is done.
    assert a3 not in sink.delivered and a4 not in sink.delivered
    assert sink.delivered.count(b1) == sink.delivered.count(b2) == 1
    event = next(e for e in logs if e["event"] == "relay.key.blocked")
    assert (event["key"], event["failed_id"], event["waiting"]) == ("a", bad, 2)
    import json

    status = json.loads(run_cli("status", "--database-url", db_url, "--json"))
    (dest,) = status["destinations"]
    assert dest["blocked_keys"] == [
        {"key": "a", "failed_id": bad, "waiting": 2, "error": "unparseable by the consumer"}
    ]
    human = run_cli("status", "--database-url", db_url)
    assert "keys with a failed row ahead of pending rows" in human
    assert "key 'a' held by failed row" in human
    # The operator gives up on the poison row: the key continues, in order.
    assert f"skipped 1 row(s): {bad}" in run_cli(
        "skip", str(bad), "--database-url", db_url, "--yes"
    )
    async with running(s, sinks={"o": sink}):
        await wait_until(lambda: a4 in sink.delivered, what="key a continues after skip")
    assert [i for i in sink.delivered if i in (a1, a3, a4)] == [a1, a3, a4]
    rows = {r["id"]: r for r in await _rows(db_url)}
    assert rows[bad]["status"] == "skipped" and "[skipped by" in rows[bad]["last_error"]


async def _rows(db_url: str) -> list[asyncpg.Record]:
    conn = await connect(db_url)
    try:
        return list(await conn.fetch("SELECT * FROM outbox ORDER BY id"))
    finally:
        await conn.close()


def test_skip_refuses_rows_that_are_not_failed(db_url: str) -> None:
    import subprocess
    import sys

    ids = asyncio.run(enqueue_keys(db_url, [("a", "x")]))
    res = subprocess.run(
        [sys.executable, "-m", "relay.cli", "skip", str(ids[0]), "999", "--database-url", db_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0 and "no outbox row with id 999" in res.stderr


class RecordingSink(MemorySink):
    def __init__(self) -> None:
        self.seen: list[str] = []

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
        self.seen.extend(e.destination for e in batch)
        return [Outcome.delivered(e.id) for e in batch]


async def test_busy_destinations_take_turns(db_url: str) -> None:
    """Each destination always has a full batch waiting; all of them progress together."""
    conn = await connect(db_url)
    try:
        for dest in ("o1", "o2", "u"):
            async with conn.transaction():
                await outbox.enqueue_many(
                    conn,
                    [{"destination": dest, "key": f"k{i}", "payload": b"x"} for i in range(400)],
                )
    finally:
        await conn.close()
    sink = RecordingSink()
    s = settings(
        db_url,
        "127.0.0.1:1",
        destinations={
            "o1": {"kind": "kafka", "topic": "a", "ordering": "key"},
            "o2": {"kind": "kafka", "topic": "b", "ordering": "key"},
            "u": {"kind": "kafka", "topic": "c"},
        },
        relay={"batch_size": 50, "max_in_flight": 50, "poll_interval": 0.05},
    )
    async with running(s, sinks={"o1": sink, "o2": sink, "u": sink}):
        await wait_until(lambda: len(sink.seen) >= 300, what="300 deliveries")
    first = sink.seen[:300]
    assert {d: first.count(d) for d in ("o1", "o2", "u")} == {"o1": 100, "o2": 100, "u": 100}


@pytest.mark.parametrize("park", [False, True])
async def test_a_keys_head_behind_failed_rows(db_url: str, store: Store, park: bool) -> None:
    """A key's lowest open row is its head, unless it is failed and the destination parks
    poison rows: then its lowest pending or running row is. The claim reads the first from
    its walk over the keys and looks the second up; each case, row by row."""
    conn = await connect(db_url)
    try:
        f1, f2, p1, p2 = await add(conn, "k1", 4)  # failed, failed, pending, pending
        g1, r1, q1 = await add(conn, "k2", 3)  # failed, running, pending
        (h1,) = await add(conn, "k3")  # pending: its own head either way
        await conn.execute(
            "UPDATE outbox SET status = 'failed' WHERE id = ANY($1::bigint[])", [f1, f2, g1]
        )
        await conn.execute("UPDATE outbox SET status = 'running' WHERE id = $1", r1)
    finally:
        await conn.close()
    got = await claim(store, park=park)
    # Without parking, a failed head holds its key; with it, k1 moves on to its first pending
    # row and k2 waits for its running one.
    assert got == (sorted([h1, p1]) if park else [h1])
    assert p2 not in got and q1 not in got


async def test_a_truncate_during_an_ordered_drain_does_not_let_a_head_through(
    db_url: str, store: Store
) -> None:
    """Found by a review: the ordered claim went on the FENCE reading of the claim before
    after a full batch, as the unordered drain does. After TRUNCATE ... RESTART IDENTITY that
    reading's fence (the old highest id) let a key's second row through while its first, a
    lower id, could still commit. The ordered claim reads the fence for every claim."""
    conn, open_tx = await connect(db_url), await connect(db_url)
    try:
        for i in range(20):
            await add(conn, f"k{i:02}")
        rows, _ = await store.claim_ordered("o", 10, False, 40, None)
        assert len(rows) == 10  # a full batch
        await conn.execute("TRUNCATE outbox RESTART IDENTITY")
        tx = open_tx.transaction()
        await tx.start()
        (first,) = await outbox.enqueue_many(
            open_tx, [{"destination": "o", "key": "k", "payload": {}}]
        )
        (second,) = await add(conn, "k")  # a later id of the same key commits first
        assert first < second
        rows, _ = await store.claim_ordered("o", 10, False, 40, None)
        await tx.rollback()
        assert second not in [e.id for e in rows]
    finally:
        await open_tx.close()
        await conn.close()
