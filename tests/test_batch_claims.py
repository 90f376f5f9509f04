"""Batch leases (relay.claims = "batch") against a real PostgreSQL: a claim of an unordered
destination's fresh rows writes one row of outbox_batches and none of the outbox; the rows are
written once, by their outcome, fenced by the batch (its relay, its lease); the reaper puts
back what an expired batch did not record; the chain of batches passes over no committed row
and takes none twice, under concurrent claims and inserts, open transactions and a TRUNCATE."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from outbox.status import Status
from relay.db import queries
from relay.db.store import Record, Store, create_pool
from relay.model import Envelope
from tests.support.relays import wait_until

D = "d"
LEASE = 60.0
INSERT = (
    "INSERT INTO outbox (destination, payload) "
    "SELECT $1, '\\x00'::bytea FROM generate_series(1, $2) RETURNING id"
)
LEASE_EXPIRED = "lease expired: relay {} stopped before recording an outcome"


def batch_store(pool: asyncpg.Pool, relay: str, lease: float = LEASE) -> Store:
    return Store(pool, "public", relay, lease, batched={D, "e"})


@contextlib.asynccontextmanager
async def opened(db_url: str, relay: str, size: int = 2) -> AsyncIterator[Store]:
    """A Store of relay ``relay`` on a pool of its own, made as the relay makes it."""
    pool = await create_pool(to_asyncpg_dsn(db_url), relay, size)
    try:
        yield batch_store(pool, relay)
    finally:
        await pool.close()


@pytest.fixture
async def admin(db_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        yield conn
    finally:
        await conn.close()


async def insert(conn: asyncpg.Connection, n: int, destination: str = D) -> list[int]:
    return sorted(r[0] for r in await conn.fetch(INSERT, destination, n))


def delivered(envs: Sequence[Envelope]) -> list[Record]:
    return [Record(e.id, e.token, Status.DELIVERED, 1, 0.0, None) for e in envs]


def retry(envs: Sequence[Envelope], delay: float, error: str = "boom") -> list[Record]:
    return [Record(e.id, e.token, Status.PENDING, 1, delay, error) for e in envs]


def pairs(envs: Sequence[Envelope]) -> set[tuple[int, int]]:
    return {(e.id, e.token) for e in envs}


async def versions(conn: asyncpg.Connection, ids: Sequence[int]) -> dict[int, tuple[str, str]]:
    """Each row's current version: its inserting transaction and its place."""
    rows = await conn.fetch(
        "SELECT id, xmin::text, ctid::text FROM outbox WHERE id = ANY($1::bigint[])", list(ids)
    )
    return {r[0]: (r[1], r[2]) for r in rows}


async def state(conn: asyncpg.Connection, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
    rows = await conn.fetch(
        "SELECT id, status, claims, attempts, last_error, locked_by, "
        "run_after > created_at AS waiting, run_after - now() AS due_in, "
        "delivered_at IS NOT NULL AS delivered_at, finished_at IS NOT NULL AS finished_at "
        "FROM outbox WHERE id = ANY($1::bigint[])",
        list(ids),
    )
    return {r["id"]: dict(r) for r in rows}


async def fresh(conn: asyncpg.Connection, ids: Sequence[int]) -> bool:
    """Whether every row of ``ids`` is as written: pending, never claimed, due when written."""
    rows = await state(conn, ids)
    return len(rows) == len(ids) and all(
        (r["status"], r["claims"], r["attempts"], r["waiting"]) == ("pending", 0, 0, False)
        for r in rows.values()
    )


async def batches(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        "SELECT id, destination, epoch, first_id, last_id, relay, "
        "extract(epoch FROM lease_until - now())::float8 AS lease_left "
        "FROM outbox_batches ORDER BY destination, epoch, first_id"
    )
    return [dict(r) for r in rows]


async def filenode(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval("SELECT pg_relation_filenode('outbox')::bigint"))


async def expire(conn: asyncpg.Connection, relay: str) -> None:
    """``relay`` stopped heartbeating its batches a while ago."""
    await conn.execute(
        "UPDATE outbox_batches SET lease_until = now() - interval '1 second' WHERE relay = $1",
        relay,
    )


# --- 1. the claim writes no row; the outcome writes each once --------------------------------


async def updates(pool: asyncpg.Pool, admin: asyncpg.Connection) -> int:
    """Row versions written to the outbox so far (pg_stat_user_tables.n_tup_upd), with the
    statistics of the pool's one connection and of ``admin`` flushed first."""
    await pool.fetchval("SELECT pg_stat_force_next_flush()")
    await admin.fetchval("SELECT pg_stat_force_next_flush()")
    return int(
        await admin.fetchval("SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'outbox'")
    )


async def test_a_batch_claim_writes_no_row_and_an_outcome_writes_each_once(
    db_url: str, admin: asyncpg.Connection
) -> None:
    ids = await insert(admin, 30)
    written = await versions(admin, ids)
    # One connection: the store's statements and the statistics' flush run on it.
    async with opened(db_url, "relay-a", size=1) as store:
        before = await updates(store.pool, admin)
        envs = await store.claim(D, 20)
        assert [e.id for e in envs] == ids[:20]
        (token,) = {e.token for e in envs}
        assert token < 0 and all(e.attempts == 0 for e in envs)
        # One lease row: the chain's first batch, from 0 to the last row taken.
        (batch,) = await batches(admin)
        assert batch["id"] == -token
        assert (batch["destination"], batch["first_id"], batch["last_id"]) == (D, 0, ids[19])
        assert batch["relay"] == "relay-a" and batch["epoch"] == await filenode(admin)
        assert LEASE - 5 < batch["lease_left"] <= LEASE
        # And not a row written: the same versions, still fresh.
        assert await versions(admin, ids) == written
        assert await fresh(admin, ids)
        assert await updates(store.pool, admin) == before

        # 15 delivered, 5 to be retried in 30 s: one new version of each of the 20 rows.
        done = await store.record(delivered(envs[:15]) + retry(envs[15:], 30.0))
        assert done == pairs(envs)
        assert await updates(store.pool, admin) == before + 20
        now = await versions(admin, ids)
        assert all(now[i] != written[i] for i in ids[:20])
        assert all(now[i] == written[i] for i in ids[20:])
        rows = await state(admin, ids)
        for i in ids[:15]:
            assert (rows[i]["status"], rows[i]["claims"], rows[i]["attempts"]) == (
                "delivered",
                1,
                1,
            )
            assert rows[i]["delivered_at"] and rows[i]["finished_at"]
        for i in ids[15:20]:
            # The waiting lane: claimed once, an attempt counted, due in 30 s.
            r = rows[i]
            assert (r["status"], r["claims"], r["attempts"], r["waiting"]) == (
                "pending",
                1,
                1,
                True,
            )
            assert r["last_error"] == "boom" and r["due_in"].total_seconds() > 25
        # Recording them again (a duplicate outcome) writes nothing.
        assert await store.record(delivered(envs)) == set()
        assert await updates(store.pool, admin) == before + 20

        # The next claim takes the fresh rows after the chain's end, not the retries (not due).
        rest = await store.claim(D, 100)
        assert [e.id for e in rest] == ids[20:]
        assert {e.token for e in rest} == {-(await batches(admin))[1]["id"]}
        # Once due, the retries are claimed row by row: written running, a token of their own.
        await admin.execute(
            "UPDATE outbox SET run_after = now() - interval '1 second' WHERE id = ANY($1)",
            ids[15:20],
        )
        again = await store.claim(D, 100)
        assert sorted(e.id for e in again) == ids[15:20]
        assert {(e.token, e.attempts) for e in again} == {(2, 1)}
        rows = await state(admin, ids[15:20])
        assert {(r["status"], r["locked_by"]) for r in rows.values()} == {("running", "relay-a")}
        assert len(await batches(admin)) == 2  # no batch for them
        assert await store.record(delivered(again) + delivered(rest)) == pairs(again) | pairs(rest)
    rows = await state(admin, ids)
    assert {r["status"] for r in rows.values()} == {"delivered"}
    assert sorted(r["attempts"] for r in rows.values()) == [1] * 25 + [2] * 5


# --- 2. the batch fences its rows: another relay, an expired lease ---------------------------


async def test_only_the_batchs_relay_writes_its_rows_and_not_once_it_is_reaped(
    db_url: str, admin: asyncpg.Connection
) -> None:
    ids = await insert(admin, 10)
    async with opened(db_url, "relay-a") as a:
        b = batch_store(a.pool, "relay-b")  # another relay (on the same pool: the fence is SQL's)
        envs = await a.claim(D, 10)
        assert [e.id for e in envs] == ids
        held = [(e.id, e.token) for e in envs]
        written = await versions(admin, ids)
        (batch,) = await batches(admin)

        # relay-b holds no lease on them: it records, renews and releases nothing.
        assert await b.record(delivered(envs)) == set()
        assert await b.record(retry(envs, 0.0)) == set()
        assert await b.heartbeat(held) == set()
        await b.release(held)
        assert await versions(admin, ids) == written
        assert (await batches(admin))[0]["lease_left"] <= batch["lease_left"]

        # relay-a renews its lease: the one batch row, however many rows it holds.
        await admin.execute("UPDATE outbox_batches SET lease_until = now() + interval '5 s'")
        assert await a.heartbeat(held) == set(ids)
        assert (await batches(admin))[0]["lease_left"] > LEASE - 5
        assert await versions(admin, ids) == written

        # Its lease runs out unrenewed: any relay's reaper puts the rows back, an attempt
        # counted (each may have been sent), due at once, naming the relay.
        await expire(admin, "relay-a")
        reaped = await b.reap_batches(25, {})
        assert sorted(r["id"] for r in reaped) == ids
        assert {(r["status"], r["destination"]) for r in reaped} == {("pending", D)}
        rows = await state(admin, ids)
        for r in rows.values():
            # claims 1: out of the fresh lane whatever the clock says.
            assert (r["status"], r["attempts"], r["claims"], r["waiting"]) == (
                "pending",
                1,
                1,
                True,
            )
            assert r["last_error"] == LEASE_EXPIRED.format("relay-a")
            assert r["due_in"].total_seconds() <= 0
        (ended,) = await batches(admin)
        assert ended["relay"] is None
        assert await b.reap_batches(25, {}) == []  # nothing left of it

        # relay-a, late: nothing it writes under that batch lands.
        reaped_versions = await versions(admin, ids)
        assert await a.record(delivered(envs)) == set()
        assert await a.record(retry(envs, 0.0)) == set()
        assert await a.heartbeat(held) == set()
        await a.release(held)
        assert await versions(admin, ids) == reaped_versions

        # The rows are claimed again, row by row (the waiting lane), with tokens of their own;
        # relay-a's old tokens still write nothing.
        again = await b.claim(D, 10)
        assert sorted(e.id for e in again) == ids
        assert {(e.token, e.attempts) for e in again} == {(2, 1)}  # claims 1 when reaped
        assert await a.record(delivered(envs)) == set()
        assert {r["status"] for r in (await state(admin, ids)).values()} == {"running"}
        assert await b.record(delivered(again)) == pairs(again)
        assert len(await batches(admin)) == 1


async def test_the_reaper_fails_a_batchs_rows_whose_attempts_are_spent(
    db_url: str, admin: asyncpg.Connection
) -> None:
    """Per destination (its own max_attempts, or the default), and only the rows of the
    expired batch's destination and range: rows of another destination whose ids are in that
    range, and rows after it, are left as they are."""
    d_ids, e_ids = [], []
    for n in (0, 1, 2, 5):  # attempts made before (a retry that became fresh again by hand)
        d_ids += [
            await admin.fetchval(
                "INSERT INTO outbox (destination, payload, attempts) "
                "VALUES ('d', '\\x00', $1) RETURNING id",
                n,
            )
        ]
        e_ids += await insert(admin, 1, "e")
    async with opened(db_url, "relay-a") as a:
        envs = await a.claim(D, 10)
        assert [e.id for e in envs] == d_ids
        later = await insert(admin, 2)  # after the batch's range
        untouched = await versions(admin, e_ids + later)
        await expire(admin, "relay-a")
        reaped = await a.reap_batches(25, {"d": 3, "x": 1})
        assert sorted((r["id"], r["status"]) for r in reaped) == [
            (d_ids[0], "pending"),
            (d_ids[1], "pending"),
            (d_ids[2], "failed"),
            (d_ids[3], "failed"),
        ]
        rows = await state(admin, d_ids)
        assert [rows[i]["attempts"] for i in d_ids] == [1, 2, 3, 6]
        assert [rows[i]["finished_at"] for i in d_ids] == [False, False, True, True]
        assert all(r["last_error"] == LEASE_EXPIRED.format("relay-a") for r in rows.values())
        assert await versions(admin, e_ids + later) == untouched

        # Destination e has no limit of its own: the default one (2) applies.
        await admin.execute("UPDATE outbox SET attempts = 1 WHERE id = ANY($1)", e_ids[2:])
        e_envs = await a.claim("e", 10)
        assert [e.id for e in e_envs] == e_ids
        await expire(admin, "relay-a")
        reaped = await a.reap_batches(2, {"d": 3})
        assert sorted((r["id"], r["status"]) for r in reaped) == [
            (e_ids[0], "pending"),
            (e_ids[1], "pending"),
            (e_ids[2], "failed"),
            (e_ids[3], "failed"),
        ]
        assert await fresh(admin, later)
        # d's next claim: its two rows put back, by row, and the fresh rows after the range.
        claimed = {e.id: e.token for e in await a.claim(D, 10)}
        assert sorted(claimed) == sorted([*d_ids[:2], *later])
        # Put back with claims 1 (out of the fresh lane), claimed again: token 2.
        assert [claimed[i] for i in d_ids[:2]] == [2, 2] and claimed[later[0]] < 0


# --- 3. concurrent claims and inserts: every committed row taken once -----------------------


async def test_concurrent_claims_take_every_committed_row_exactly_once(db_url: str) -> None:
    """Four relays (two to a pool) claim in loops with batches of random sizes while three
    writers insert 20 rows per transaction, some transactions held open a while, some rolled
    back. Every committed row is taken in a batch exactly once and ends delivered; a fifth of
    them is retried once (recorded pending, then claimed by row, once); no rolled-back id is
    ever claimed; the chain's batches follow each other with neither gap nor overlap."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    dsn = to_asyncpg_dsn(db_url)
    writers, transactions = 3, 20
    committed: set[int] = set()
    rolled_back: set[int] = set()
    held_open = 0
    in_batch: Counter[int] = Counter()
    by_row: Counter[int] = Counter()
    tokens: dict[int, int] = {}
    retried: set[int] = set()
    writing = asyncio.Event()

    async def write() -> None:
        nonlocal held_open
        conn = await asyncpg.connect(dsn)
        try:
            for _ in range(transactions):
                tx = conn.transaction()
                await tx.start()
                try:
                    ids = [r[0] for r in await conn.fetch(INSERT, D, 20)]
                    if rng.random() < 0.3:  # rows committed meanwhile wait behind these
                        held_open += 1
                        await asyncio.sleep(rng.uniform(0.05, 0.3))
                except BaseException:
                    await tx.rollback()
                    raise
                if rng.random() < 0.2:
                    await tx.rollback()
                    rolled_back.update(ids)
                else:
                    await tx.commit()
                    committed.update(ids)
                await asyncio.sleep(rng.uniform(0, 0.02))
        finally:
            await conn.close()

    async def all_delivered(pool: asyncpg.Pool) -> bool:
        row = await pool.fetchrow(
            "SELECT count(*) FILTER (WHERE status <> 'delivered') AS left, count(*) FROM outbox"
        )
        return bool(row["left"] == 0 and row["count"] == len(committed))

    async def claim(store: Store) -> None:
        while True:
            envs = await store.claim(D, rng.randint(1, 60))
            if not envs:
                if not writing.is_set() and await all_delivered(store.pool):
                    return
                await asyncio.sleep(0.002)
                continue
            records = []
            for e in envs:
                if e.token < 0:
                    in_batch[e.id] += 1
                    tokens[e.id] = e.token
                    if rng.random() < 0.2:
                        retried.add(e.id)
                        records += retry([e], 0.0)
                        continue
                else:
                    by_row[e.id] += 1
                records += delivered([e])
            assert await store.record(records) == pairs(envs)

    pools = [await create_pool(dsn, f"relay-pool-{i}", 3) for i in range(2)]
    try:
        stores = [batch_store(pools[i % 2], f"relay-{i}") for i in range(4)]
        writing.set()
        claimers = [asyncio.create_task(claim(s)) for s in stores]

        async def run() -> None:
            await asyncio.gather(*(write() for _ in range(writers)))
            writing.clear()
            await asyncio.gather(*claimers)

        try:
            await asyncio.wait_for(run(), 20)
        except TimeoutError:
            never = sorted(committed - set(in_batch))
            raise AssertionError(
                f"seed {seed}: not all delivered within 20 s; committed, never claimed: "
                f"{len(never)} ({never[:10]})"
            ) from None
        finally:
            for t in claimers:
                t.cancel()
            await asyncio.gather(*claimers, return_exceptions=True)
        async with pools[0].acquire() as conn:
            chain = await batches(conn)
    finally:
        for p in pools:
            await p.close()

    why = f"seed {seed}"
    assert held_open and rolled_back and retried, why  # each case happened
    assert set(in_batch) == committed, why
    assert set(in_batch.values()) == {1}, why
    assert set(by_row) == retried and set(by_row.values()) == {1}, why
    assert not (set(in_batch) | set(by_row)) & rolled_back, why
    # The chain: from 0 to the last committed row, each batch where the one before ended,
    # each row taken in the batch whose range holds it.
    assert chain[0]["first_id"] == 0 and chain[-1]["last_id"] == max(committed), why
    for before, after in itertools.pairwise(chain):
        assert after["first_id"] == before["last_id"], why
    ranges = {-b["id"]: (b["first_id"], b["last_id"]) for b in chain}
    for row_id, token in tokens.items():
        first, last = ranges[token]
        assert first < row_id <= last, why


# --- 4. the chain: a claim that read an end since extended takes no fresh row ----------------


async def waits_on_a_lock(admin: asyncpg.Connection, relay: str) -> bool:
    return bool(
        await admin.fetchval(
            "SELECT count(*) = 1 FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = $1 AND wait_event_type = 'Lock'",
            f"outbox-relay:{relay}",
        )
    )


@pytest.mark.parametrize("first_claim", ["commits", "rolls back"])
async def test_a_claim_from_an_end_of_the_chain_another_claim_extended_takes_no_fresh_row(
    db_url: str, admin: asyncpg.Connection, first_claim: str
) -> None:
    """relay-1's claim is in a transaction still open; relay-2's claim reads the same end of
    the chain (0) and waits on the unique chain key. Once relay-1's commits, relay-2's adds no
    batch and takes no fresh row (it still claims the waiting lane's); had relay-1's rolled
    back, relay-2's takes the rows itself."""
    ids = await insert(admin, 10)
    first = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = first.transaction()
        await tx.start()
        taken = await first.fetch(
            queries.render_ops(queries.CLAIM_BATCH, "public"),
            D,
            5,
            "relay-1",
            LEASE,
            2**62,
            await filenode(admin),
        )
        assert [r["id"] for r in taken] == ids[:5]
        # Due again (an earlier attempt failed): the waiting lane, claimed by row.
        waiting = await admin.fetchval(
            "INSERT INTO outbox (destination, payload, claims, attempts, created_at, run_after)"
            " VALUES ('d', '\\x00', 1, 1, now() - interval '1 minute', now() - interval '1 s')"
            " RETURNING id"
        )
        async with opened(db_url, "relay-2") as second:
            claim = asyncio.create_task(second.claim(D, 5))
            await wait_until(
                lambda: waits_on_a_lock(admin, "relay-2"), timeout=10, what="relay-2 waits"
            )
            assert not claim.done()
            if first_claim == "commits":
                await tx.commit()
            else:
                await tx.rollback()
            got = await asyncio.wait_for(claim, 10)
            chain = await batches(admin)
            if first_claim == "commits":
                assert [(e.id, e.token) for e in got] == [(waiting, 2)]
                assert [(b["first_id"], b["last_id"], b["relay"]) for b in chain] == [
                    (0, ids[4], "relay-1")
                ]
                assert await fresh(admin, ids)  # relay-1's, and the five after them
                # relay-2's next claim begins where relay-1's batch ended.
                after = await second.claim(D, 10)
                assert [e.id for e in after] == ids[5:]
                assert [(b["first_id"], b["last_id"]) for b in await batches(admin)] == [
                    (0, ids[4]),
                    (ids[4], ids[9]),
                ]
            else:
                # Its waiting row first (run_after order), then the four lowest fresh rows.
                assert [e.id for e in got] == [waiting, *ids[:4]]
                assert [(b["first_id"], b["last_id"], b["relay"]) for b in chain] == [
                    (0, ids[3], "relay-2")
                ]
                assert {e.token for e in got[1:]} == {-chain[0]["id"]}
    finally:
        await first.close()


# --- 5. the fence: an open insert holds back rows committed after it --------------------------


@pytest.mark.parametrize("open_insert", ["commits", "rolls back"])
async def test_rows_committed_after_an_open_insert_wait_for_it(
    db_url: str, admin: asyncpg.Connection, open_insert: str
) -> None:
    before = await insert(admin, 3)
    writer = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = writer.transaction()
        await tx.start()
        held = await insert(writer, 3)
        after = await insert(admin, 4)  # committed, with higher ids than the open insert's
        assert max(before) < min(held) and max(held) < min(after)
        async with opened(db_url, "relay-a") as store:
            envs = await store.claim(D, 100)
            # Only the rows below the open insert: a batch taking `after` would end the chain
            # past `held`, which would never be taken once committed.
            assert [e.id for e in envs] == before
            assert [(b["first_id"], b["last_id"]) for b in await batches(admin)] == [
                (0, before[-1])
            ]
            assert await store.claim(D, 100) == []  # still held back
            assert await fresh(admin, after)
            if open_insert == "commits":
                await tx.commit()
            else:
                await tx.rollback()
            envs = await store.claim(D, 100)
            expected = held + after if open_insert == "commits" else after
            assert [e.id for e in envs] == expected
            assert [(b["first_id"], b["last_id"]) for b in await batches(admin)] == [
                (0, before[-1]),
                (before[-1], after[-1]),
            ]
            assert await store.claim(D, 100) == []
    finally:
        await writer.close()


# --- 6. a clean stop releases what was not attempted ------------------------------------------


async def test_released_rows_wait_in_their_lane_unattempted_and_are_claimed_again(
    db_url: str, admin: asyncpg.Connection
) -> None:
    ids = await insert(admin, 10)
    async with opened(db_url, "relay-a") as a:
        envs = await a.claim(D, 10)
        assert await a.record(delivered(envs[:4])) == pairs(envs[:4])
        recorded = await versions(admin, ids[:4])
        # On a clean stop the relay releases its claims' rows: those recorded are left alone.
        await a.release([(e.id, e.token) for e in envs])
        assert await versions(admin, ids[:4]) == recorded
        rows = await state(admin, ids[4:])
        for r in rows.values():
            # claims 1: out of the fresh lane whatever the clock says; no attempt counted.
            assert (r["status"], r["claims"], r["attempts"], r["last_error"], r["waiting"]) == (
                "pending",
                1,
                0,
                None,
                True,
            )
            assert r["due_in"].total_seconds() <= 0
        # Nothing left to record under the batch.
        assert await a.record(delivered(envs[4:])) == set()
        # Another relay claims them at once, row by row; nothing is counted as attempted.
        async with opened(db_url, "relay-b") as b:
            again = await b.claim(D, 10)
            assert sorted(e.id for e in again) == ids[4:]
            assert {(e.token, e.attempts) for e in again} == {(2, 0)}  # claims 1 when released
            assert await b.record(delivered(again)) == pairs(again)
        # The batch's lease ends with nothing of it left to put back.
        await expire(admin, "relay-a")
        assert await a.reap_batches(25, {}) == []
        assert [b["relay"] for b in await batches(admin)] == [None]
    rows = await state(admin, ids)
    assert {(r["status"], r["attempts"]) for r in rows.values()} == {("delivered", 1)}
