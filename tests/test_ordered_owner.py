"""An ordered destination's owner (relay/pipeline/ordered.py, queries.CLAIM_OWNED): one relay at a
time, fresh rows read once and kept in memory behind their key, a takeover that waits for the keys
in flight, the walk while a relay of an earlier release serves the destination."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Collection
from typing import Any

import asyncpg
import pytest

import outbox
from outbox.dburl import to_asyncpg_dsn
from outbox.status import Status
from relay.db import queries
from relay.db.owned import OwnedLane
from relay.db.store import DB_ERRORS, Record, Store, create_pool
from relay.model import Envelope
from relay.pipeline import claimer as claimer_module
from relay.pipeline.ordered import Mode, Ownership
from tests.test_ordering import ordered_claimer, run_for


async def open_store(db_url: str, relay_id: str) -> Store:
    pool = await create_pool(to_asyncpg_dsn(db_url), relay_id, 4)
    return Store(pool, "public", relay_id, 30.0)


async def close_store(store: Store) -> None:
    await store.disown()
    await store.pool.close()


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[Store]:
    s = await open_store(db_url, "owner")
    try:
        yield s
    finally:
        await close_store(s)


async def connect(db_url: str) -> asyncpg.Connection:
    return await asyncpg.connect(to_asyncpg_dsn(db_url))


async def add(db_url: str, keys: list[str | None], dest: str = "o") -> list[int]:
    conn = await connect(db_url)
    try:
        async with conn.transaction():
            return await outbox.enqueue_many(
                conn, [{"destination": dest, "key": k, "payload": {"k": k}} for k in keys]
            )
    finally:
        await conn.close()


async def execute(db_url: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await connect(db_url)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


async def take_over(store: Store) -> None:
    """Take "o" once its owner's terminated backend has ended (a moment after
    pg_terminate_backend returns), and its lock with it."""
    for _ in range(100):
        if await store.own("o"):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the lock of the terminated owner was never released")


async def claim(
    store: Store,
    lane: OwnedLane,
    busy: Collection[str] = (),
    limit: int = 10,
    park: bool = False,
    scan: int = 40,
) -> list[int]:
    assert await store.own("o")
    rows, _ = await store.claim_owned("o", limit, park, scan, lane, busy, 30.0)
    return sorted(e.id for e in rows)


def delivered(*rows: int, key: str = "k") -> list[Record]:
    return [Record(i, 1, "delivered", 1, 0.0, None, "o", key) for i in rows]


async def test_one_relay_owns_a_destination_until_its_connection_ends(db_url: str) -> None:
    a, b = await open_store(db_url, "a"), await open_store(db_url, "b")
    try:
        assert await a.own("o") and a.owns("o")
        assert not await b.own("o") and not b.owns("o")
        assert await b.own("other")  # each destination has an owner of its own
        # The owner's connection ends (a crash, a network cut): its session lock with it.
        pid = a.owner.conn.get_server_pid()  # type: ignore[union-attr]
        await execute(db_url, "SELECT pg_terminate_backend($1)", pid)
        with pytest.raises(DB_ERRORS):
            await a.claim_owned("o", 10, False, 40, OwnedLane(), (), 30.0)
        assert not a.owns("o")
        await take_over(b)
        assert not await a.own("o")
    finally:
        await close_store(a)
        await close_store(b)


async def test_a_key_waits_behind_its_row_in_flight_and_its_rows_wait_in_memory(
    db_url: str, store: Store
) -> None:
    k1, j1, k2, k3, j2 = await add(db_url, ["k", "j", "k", "k", "j"])
    lane = OwnedLane()
    assert await claim(store, lane) == [k1, j1]
    # Read once: the rows behind their keys are kept, and not read again.
    assert queued(lane) == {"k": [k2, k3], "j": [j2]} and lane.count == 3
    assert await claim(store, lane, busy={"k", "j"}) == []
    await store.record(delivered(k1) + delivered(j1, key="j"))
    assert await claim(store, lane, busy=set()) == [k2, j2]
    assert queued(lane) == {"k": [k3]}
    await store.record(delivered(k2) + delivered(j2, key="j"))
    assert await claim(store, lane) == [k3] and lane.count == 0


async def test_a_reading_cut_short_goes_on_from_where_it_stopped(db_url: str, store: Store) -> None:
    ids = await add(db_url, [f"k{i}" for i in range(10)])
    lane = OwnedLane()
    assert await store.own("o")
    rows, more = await store.claim_owned("o", 10, False, 4, lane, (), 30.0)
    assert sorted(e.id for e in rows) == ids[:4] and more is True and lane.hw == ids[3]
    rows, more = await store.claim_owned("o", 10, False, 4, lane, (), 30.0)
    assert sorted(e.id for e in rows) == ids[4:8] and more is True
    rows, more = await store.claim_owned("o", 10, False, 4, lane, (), 30.0)
    assert sorted(e.id for e in rows) == ids[8:] and more is False


async def test_after_a_full_batch_the_next_claim_takes_from_memory_without_reading_ahead(
    db_url: str, store: Store
) -> None:
    first = await add(db_url, [f"k{i}" for i in range(12)])
    lane = OwnedLane()
    assert await claim(store, lane, limit=5) == first[:5]
    assert lane.full and lane.count == 7
    later = await add(db_url, ["x", "y"])
    assert await claim(store, lane, limit=5) == first[5:10]  # from memory only
    assert lane.count == 2 and lane.hw < later[0]
    assert await claim(store, lane, limit=5) == first[10:]  # still nothing read: 2 of 5
    assert not lane.full
    assert await claim(store, lane, limit=5) == later


async def test_a_retried_head_holds_its_key_until_due_and_goes_first(
    db_url: str, store: Store
) -> None:
    k1, k2, j1 = await add(db_url, ["k", "k", "j"])
    lane = OwnedLane()
    assert await claim(store, lane) == [k1, j1]
    await store.record([Record(k1, 1, "pending", 1, 60.0, "try later", "o", "k")])
    await store.record(delivered(j1, key="j"))
    assert await claim(store, lane) == []  # k2 waits behind k1, which backs off
    await execute(db_url, "UPDATE outbox SET run_after = now() WHERE id = $1", k1)
    assert await claim(store, lane) == [k1]
    await store.record([Record(k1, 2, "delivered", 1, 0.0, None, "o", "k")])
    assert await claim(store, lane) == [k2]


@pytest.mark.parametrize("park", [False, True])
async def test_a_failed_head_blocks_its_key_or_is_parked(
    db_url: str, store: Store, park: bool
) -> None:
    k1, k2 = await add(db_url, ["k", "k"])
    lane = OwnedLane()
    assert await claim(store, lane, park=park) == [k1]
    await store.record([Record(k1, 1, "failed", 1, 0.0, "poison", "o", "k")])
    assert await claim(store, lane, park=park) == ([k2] if park else [])


async def test_a_row_skipped_while_kept_in_memory_is_forgotten(db_url: str, store: Store) -> None:
    """A row changed by someone else while the owner keeps it (skipped, purged) must not stay
    its key's head for ever: found gone when chosen, it is dropped, and the key goes on."""
    k1, k2, k3 = await add(db_url, ["k", "k", "k"])
    lane = OwnedLane()
    assert await claim(store, lane) == [k1]
    await store.record(delivered(k1))
    await execute(db_url, "UPDATE outbox SET status = 'skipped' WHERE id = $1", k2)
    assert await claim(store, lane) == []  # k2 was chosen, and found gone
    assert queued(lane) == {"k": [k3]} and lane.count == 1
    assert await claim(store, lane) == [k3]


async def test_rows_without_a_key_flow_whatever_is_in_flight(db_url: str, store: Store) -> None:
    ids = await add(db_url, [None, "k", None, "k", None])
    lane = OwnedLane()
    assert await claim(store, lane, limit=2) == ids[:2]
    assert await claim(store, lane, busy={"k"}) == [ids[2], ids[4]]
    assert lane.count == 1 and not lane.keyless


async def test_a_relay_of_an_earlier_release_stops_the_owners_claim(
    db_url: str, store: Store
) -> None:
    await add(db_url, ["k", "j"])
    await execute(
        db_url, "INSERT INTO outbox_relays (relay_id, destinations) VALUES ('before', '{o}')"
    )
    assert await store.own("o")
    rows, more = await store.claim_owned("o", 10, False, 40, OwnedLane(), (), 30.0)
    assert rows == [] and more is None
    states = await execute(db_url, "SELECT DISTINCT status FROM outbox")
    assert [r["status"] for r in states] == ["pending"]
    # One that stopped, or was last seen long ago, does not count.
    await execute(db_url, "UPDATE outbox_relays SET seen_at = now() - interval '1 hour'")
    rows, more = await store.claim_owned("o", 10, False, 40, OwnedLane(), (), 30.0)
    assert len(rows) == 2


async def test_a_truncate_forgets_the_rows_in_memory(db_url: str, store: Store) -> None:
    """Ids in memory may name other rows after TRUNCATE ... RESTART IDENTITY: the new epoch
    empties the lane, and the new rows are read from the start."""
    await add(db_url, ["k", "k", "j"])
    lane = OwnedLane()
    assert len(await claim(store, lane)) == 2 and lane.count == 1
    await execute(db_url, "TRUNCATE outbox RESTART IDENTITY")
    new = await add(db_url, ["x", "j"])
    assert await claim(store, lane) == new
    assert lane.count == 0


def queued(lane: OwnedLane) -> dict[str, list[int]]:
    return {k: list(q) for k, q in lane.queues.items()}


def _buffers(plan: list[asyncpg.Record]) -> int:
    first = next(r[0] for r in plan if "Buffers:" in r[0])
    return sum(int(n) for n in re.findall(r"(?:hit|read)=(\d+)", first))


async def test_under_a_held_snapshot_the_claim_reads_no_more_for_more_history(
    db_url: str,
) -> None:
    """The claim's reads do not grow with the rows delivered while a snapshot is held: with
    the planner told few rows are pending (as ANALYZE says of a busy queue), locking the
    chosen rows through the partial index of pending rows would read every dead entry of the
    destination (it did: 140 ms a claim after two minutes at 3,000 events/s)."""
    held = await connect(db_url)
    conn = await connect(db_url)
    sql = queries.render_ops(queries.CLAIM_OWNED, "public")
    try:
        await held.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await held.fetchval("SELECT 1")
        costs = []
        for _ in range(2):
            await conn.execute(
                "INSERT INTO outbox (destination, key, payload) "
                "SELECT 'o', 'k' || (g % 50), '\\x00' FROM generate_series(1, 20000) AS g"
            )
            await conn.execute(
                "UPDATE outbox SET status = 'running', claims = 1 WHERE status = 'pending'"
            )
            await conn.execute("UPDATE outbox SET status = 'delivered' WHERE status = 'running'")
            await conn.execute("ANALYZE outbox")
            fresh = await add(db_url, [f"k{i}" for i in range(20)])
            top = fresh[-1]
            async with conn.transaction():
                await conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
                plan = await conn.fetch(
                    "EXPLAIN (ANALYZE, BUFFERS) " + sql,
                    "o",
                    500,
                    "me",
                    30.0,
                    fresh[0] - 1,
                    top,
                    2000,
                    True,
                    [],
                    [],
                    [],
                    [],
                    30.0,
                )
                text = "\n".join(r[0] for r in plan)
                assert "outbox_claim_idx" not in text and "outbox_key_idx" not in text, text
                costs.append(_buffers(plan))
                await conn.execute("SELECT 1")
            await conn.execute("UPDATE outbox SET status = 'delivered' WHERE status <> 'delivered'")
        # Twice the history: about the same reads (the 20 rows claimed, the indexes' paths).
        assert costs[1] < 1.5 * costs[0] + 50, costs
    finally:
        await held.close()
        await conn.close()


async def test_a_relay_taking_over_waits_for_the_keys_its_predecessor_left_in_flight(
    db_url: str,
) -> None:
    """The claim loop of a relay that takes over: a key whose row the previous owner still
    holds waits until that row is no longer running; the other keys go at once."""
    a, b = await open_store(db_url, "a"), await open_store(db_url, "b")
    claimed: list[Envelope] = []
    try:
        k1, k2, j1 = await add(db_url, ["k", "k", "j"])
        lane = OwnedLane()
        assert await a.own("o")
        rows, _ = await a.claim_owned("o", 1, False, 40, lane, (), 30.0)
        assert [e.id for e in rows] == [k1]
        await a.disown()  # A is gone as an owner; its row k1 is still running
        loop = ordered_claimer(b, ["o"], claimed, poll_interval=0.1)
        await run_for(loop, 0.5)
        assert sorted(e.id for e in claimed) == [j1]
        owner = loop._owners["o"]
        assert owner.mode is Mode.OWNED and set(owner.foreign) == {k1}
        await a.record(delivered(k1))
        loop.stopping.clear()
        await run_for(loop, 0.5)
        assert sorted(e.id for e in claimed) == sorted([j1, k2])
        assert owner.foreign == {}
    finally:
        await close_store(a)
        await close_store(b)


async def test_more_rows_in_memory_than_the_cap_walks_the_keys_for_a_while(
    db_url: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key held up with a long backlog behind it would fill the owner's memory: past the
    cap the owner walks the keys (keeping nothing) for a minute, then reads fresh rows again,
    and walks twice as long if the cap is hit again."""
    monkeypatch.setattr(claimer_module, "MEMORY_CAP", 5)
    ids = await add(db_url, ["k"] * 12)
    claimed: list[Envelope] = []
    loop = ordered_claimer(store, ["o"], claimed, poll_interval=0.05)

    async def next_of_the_key(row: int) -> None:
        await store.record(delivered(row))
        loop.leases.forget([e for e in claimed if e.id == row])
        loop.stopping.clear()
        await run_for(loop, 0.3)

    await run_for(loop, 0.3)
    owner = loop._owners["o"]
    assert [e.id for e in claimed] == ids[:1]
    assert owner.mode is Mode.WALK and owner.capped and owner.lane.count == 0
    assert owner.walk_until > time.monotonic() + 50 and owner.walk_for == 120.0
    await next_of_the_key(ids[0])  # the walk claims in order
    assert [e.id for e in claimed] == ids[:2] and owner.mode is Mode.WALK
    owner.walk_until = time.monotonic()  # its minute is up
    await next_of_the_key(ids[1])
    # Read again from the start: the cap is hit again, and the next walk is longer.
    assert [e.id for e in claimed] == ids[:3]
    assert owner.mode is Mode.WALK and owner.walk_for == 240.0
    for n in range(2, 11):
        await next_of_the_key(ids[n])
    assert [e.id for e in claimed] == ids


# Found by a review of the owner's claim; each of these failed before its fix.

LATER = (
    "INSERT INTO outbox (destination, key, payload, run_after) "
    "VALUES ('o', 'k', '\\x00', now() + interval '1 hour') RETURNING id"
)


async def enqueued_for_later_and_due(db_url: str) -> int:
    """A row of key k enqueued for later (the waiting lane), and due now."""
    row = int((await execute(db_url, LATER))[0]["id"])
    await execute(db_url, "UPDATE outbox SET run_after = now() WHERE id = $1", row)
    return row


async def test_a_waiting_row_above_a_reading_cut_short_waits_for_its_key(
    db_url: str, store: Store
) -> None:
    *_, k1 = await add(db_url, ["a", "b", "c", "d", "k"])
    later = await enqueued_for_later_and_due(db_url)
    lane = OwnedLane()
    assert later not in await claim(store, lane, scan=4)  # k1 not read yet
    assert await claim(store, lane, scan=4) == [k1]
    await store.record(delivered(k1))
    assert await claim(store, lane, scan=4) == [later]


async def test_a_waiting_row_above_the_fence_waits_for_a_lower_id_still_open(
    db_url: str, store: Store
) -> None:
    open_tx = await connect(db_url)
    try:
        await open_tx.execute("BEGIN")
        k1 = await open_tx.fetchval(
            "INSERT INTO outbox (destination, key, payload) VALUES ('o', 'k', '\\x00') RETURNING id"
        )
        later = await enqueued_for_later_and_due(db_url)
        lane = OwnedLane()
        assert await claim(store, lane) == []  # k1 may still commit
        await open_tx.execute("COMMIT")
    finally:
        await open_tx.close()
    assert await claim(store, lane) == [k1]
    await store.record(delivered(k1))
    assert await claim(store, lane) == [later]


async def test_a_row_given_up_without_an_outcome_holds_its_key_while_it_runs(
    db_url: str, store: Store
) -> None:
    """The completer gives up writing an outcome (the row stays running until reaped): the
    key's next row must wait for it, as for a row the previous owner left in flight."""
    k1, k2 = await add(db_url, ["k", "k"])
    claimed: list[Envelope] = []
    loop = ordered_claimer(store, ["o"], claimed, poll_interval=0.05)
    await run_for(loop, 0.3)
    assert [e.id for e in claimed] == [k1]
    token = claimed[0].token
    gave_up = Record(k1, token, Status.FAILED, 1, 0.0, "x", "o", "k")
    loop.leases.recorded([gave_up], set(), {(k1, token)})
    loop.stopping.clear()
    await run_for(loop, 0.3)
    assert [e.id for e in claimed] == [k1]
    await execute(db_url, "UPDATE outbox SET status = 'pending' WHERE id = $1", k1)  # reaped
    loop.stopping.clear()
    await run_for(loop, 0.3)
    assert [e.id for e in claimed] == [k1, k1]
    await store.record([Record(k1, token + 1, Status.DELIVERED, 1, 0.0, None, "o", "k")])
    loop.leases.forget([e for e in claimed if e.id == k1])
    loop.stopping.clear()
    await run_for(loop, 0.3)
    assert [e.id for e in claimed] == [k1, k1, k2]


OLD_REGISTER = """
INSERT INTO {relays} (relay_id, host, pid, version, destinations, circuits)
VALUES ($1, $2, $3, $4, $5::text[], $6::jsonb)
ON CONFLICT (relay_id) DO UPDATE
SET host = EXCLUDED.host, pid = EXCLUDED.pid, version = EXCLUDED.version,
    destinations = EXCLUDED.destinations, circuits = EXCLUDED.circuits, seen_at = now(),
    stopped_at = NULL
"""


async def test_a_relay_rolled_back_under_the_same_id_counts_as_an_earlier_release(
    db_url: str, store: Store
) -> None:
    """The earlier release's registration (REGISTER before migration 0013) leaves features
    alone: a relay with a fixed id (a StatefulSet's pod) rolled back must not pass for one
    that claims as an owner."""
    new = await open_store(db_url, "relay-1")
    try:
        await new.register("h", 1, "new", ["o"])
        assert not await store.unowned_peers("o", 30.0)
    finally:
        await close_store(new)
    await execute(
        db_url, queries.render_ops(OLD_REGISTER, "public"), "relay-1", "h", 2, "old", ["o"], "{}"
    )
    assert await store.unowned_peers("o", 30.0)


async def test_a_walking_owner_whose_lock_is_gone_claims_nothing(db_url: str) -> None:
    """Walking (a relay of an earlier release serves it, or memory ran over), an owner runs
    its claims on the connection that holds the lock too: once that connection ends and
    another relay owns the destination, it claims nothing."""
    a, b = await open_store(db_url, "a"), await open_store(db_url, "b")
    try:
        claimed: list[Envelope] = []
        loop = ordered_claimer(a, ["o"], claimed, poll_interval=0.05)
        assert await a.own("o")
        loop._owners["o"] = Ownership(mode=Mode.WALK, capped=True, walk_until=float("inf"))
        pid = a.owner.conn.get_server_pid()  # type: ignore[union-attr]
        await execute(db_url, "SELECT pg_terminate_backend($1)", pid)
        await take_over(b)
        await add(db_url, ["k"])
        await run_for(loop, 0.3)
        assert claimed == []
        assert "o" not in loop._owners or not a.owns("o")
    finally:
        await close_store(a)
        await close_store(b)


# Found by a second review; each of these failed before its fix.


async def test_a_row_dropped_while_a_claim_pass_awaits_still_holds_its_key(
    db_url: str, store: Store
) -> None:
    k1, _ = await add(db_url, ["k", "k"])
    claimed: list[Envelope] = []
    loop = ordered_claimer(store, ["o"], claimed, poll_interval=0.05)
    batch, err = await loop._claim(["o"], 10)
    assert err is None
    loop._claimed(batch)
    assert [e.id for e in claimed] == [k1]
    token = claimed[0].token
    look_for_peers = store.unowned_peers

    async def completer_gives_up_meanwhile(*args: Any) -> bool:
        gave_up = Record(k1, token, Status.FAILED, 1, 0.0, "x", "o", "k")
        loop.leases.recorded([gave_up], set(), {(k1, token)})
        return await look_for_peers(*args)

    store.unowned_peers = completer_gives_up_meanwhile  # type: ignore[method-assign]
    loop._owners["o"].peers_checked = float("-inf")
    loop._resting.clear()
    batch, err = await loop._claim(["o"], 10)
    assert err is None and batch == []  # k2 waits: k1 is still running


async def test_a_dropped_older_claim_does_not_hide_a_newer_claim_of_its_row(
    db_url: str, store: Store
) -> None:
    k1, _ = await add(db_url, ["k", "k"])
    claimed: list[Envelope] = []
    loop = ordered_claimer(store, ["o"], claimed, poll_interval=0.05)
    batch, err = await loop._claim(["o"], 10)
    loop._claimed(batch)
    env = claimed[0]
    # k1's lease ran out and another owner claimed it again (token + 1): still running.
    await execute(
        db_url,
        "UPDATE outbox SET claims = claims + 1, locked_by = 'other', "
        "locked_until = now() + interval '1 hour' WHERE id = $1",
        k1,
    )
    await store.disown()  # this relay's ownership ended, and is taken again
    loop._resting.clear()
    batch, err = await loop._claim(["o"], 10)
    assert err is None and batch == []
    assert loop._owners["o"].foreign == {k1: (env.token + 1, "k")}
    loop.leases.lose([env], "lease not renewed")  # its own, older claim is let go now
    loop._resting.clear()
    batch, err = await loop._claim(["o"], 10)
    assert err is None and batch == []


async def test_the_owner_connection_is_probed_so_a_vanished_client_frees_its_lock(
    store: Store,
) -> None:
    assert await store.own("o")
    conn = store.owner.conn
    assert conn is not None
    assert await conn.fetchval("SHOW tcp_keepalives_idle") == "10"
    assert await conn.fetchval("SHOW tcp_keepalives_count") == "3"


async def test_a_statement_the_server_refuses_keeps_the_ownership(store: Store) -> None:
    assert await store.own("o")
    with pytest.raises(asyncpg.PostgresError):
        await store.owner.on_owner("o", "fetchval", "SELECT 1/0")
    assert store.owns("o")
