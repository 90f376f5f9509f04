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
import signal
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import outbox
from outbox.dburl import to_asyncpg_dsn
from outbox.status import Status
from relay.db import claims, queries
from relay.db.store import Record, Store, create_pool
from relay.model import Envelope
from relay.runtime.startup import batched
from relay.settings import load_settings
from tests.support.faults import fleet
from tests.support.receiver import Receiver
from tests.support.relays import wait_until
from tests.webhook_helpers import SECRET, verify

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
    """The batch chains' epoch: the file of the id column's sequence (FENCE's last column)."""
    return int(
        await conn.fetchval(
            "SELECT pg_relation_filenode(pg_get_serial_sequence('outbox', 'id')::regclass)::bigint"
        )
    )


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
        # Rows of both kinds renewed and recorded together: each by its own statement.
        assert await store.heartbeat(sorted(pairs(again) | pairs(rest))) == set(ids[15:])
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


@pytest.mark.parametrize("past_fence_after", [3600.0, 0.05])
async def test_concurrent_claims_take_every_committed_row_exactly_once(
    db_url: str, past_fence_after: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four relays (two to a pool) claim in loops with batches of random sizes while three
    writers insert 20 rows per transaction, some transactions held open a while, some rolled
    back. Every committed row is taken exactly once, in a batch or, where a transaction held
    open stopped the fence for longer than ``past_fence_after``, by row past it
    (queries.CLAIM_PAST_FENCE), and ends delivered; a fifth of the batches' rows is retried
    once (recorded pending, then claimed by row, once); no rolled-back id is ever claimed; the
    chain's batches follow each other with neither gap nor overlap."""
    monkeypatch.setattr(claims, "PAST_FENCE_AFTER", past_fence_after)
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
    past = set(by_row) - retried  # claimed by row past the fence
    assert bool(past) == (past_fence_after < 1), why
    assert not past & set(in_batch), why
    assert set(in_batch) | past == committed, why
    assert set(in_batch.values()) == {1}, why
    assert retried <= set(in_batch) and set(by_row.values()) == {1}, why
    assert not (set(in_batch) | set(by_row)) & rolled_back, why
    # The chain: from 0 to the last row taken in a batch, each batch where the one before
    # ended, each row taken in the batch whose range holds it.
    assert chain[0]["first_id"] == 0 and chain[-1]["last_id"] == max(in_batch), why
    for before, after in itertools.pairwise(chain):
        assert after["first_id"] == before["last_id"], why
    ranges = {-b["id"]: (b["first_id"], b["last_id"]) for b in chain}
    for row_id, token in tokens.items():
        first, last = ranges[token]
        assert first < row_id <= last, why


async def test_racing_claims_that_lose_the_chain_try_again_from_its_new_end(
    db_url: str, admin: asyncpg.Connection
) -> None:
    """Four relays, each on a pool of its own, claim one destination at once, round after
    round, with rows enough for every claim. A claim that read the end of the chain another
    relay's claim extends meets its unique key: it took no fresh row (a review measured 104 of
    144 claims empty with 4 relays). It now tries again from the new end, a few times: hardly
    a claim comes back empty, every row is taken exactly once, and the chain has neither gap
    nor overlap."""
    relays, rounds, size = 4, 15, 20
    ids = await insert(admin, relays * rounds * size)
    taken: Counter[int] = Counter()
    tokens: dict[int, int] = {}
    empty = 0
    async with contextlib.AsyncExitStack() as stack:
        stores = [await stack.enter_async_context(opened(db_url, f"relay-{i}")) for i in range(4)]
        for _ in range(rounds):
            results = await asyncio.gather(*(s.claim(D, size) for s in stores))
            empty += sum(1 for envs in results if not envs)
            for envs in results:
                taken.update(e.id for e in envs)
                tokens.update((e.id, e.token) for e in envs)
    chain = await batches(admin)
    assert set(taken.values()) == {1} and set(taken) <= set(ids)
    assert all(t < 0 for t in tokens.values())
    assert empty <= relays * rounds // 10, f"{empty} of {relays * rounds} claims empty"
    assert chain[0]["first_id"] == 0 and chain[-1]["last_id"] == max(taken)
    for before, after in itertools.pairwise(chain):
        assert after["first_id"] == before["last_id"]
    ranges = {-b["id"]: (b["first_id"], b["last_id"]) for b in chain}
    for row_id, token in tokens.items():
        first, last = ranges[token]
        assert first < row_id <= last
    # Every row up to the chain's end was taken: no batch passed over one.
    assert sorted(taken) == [i for i in ids if i <= chain[-1]["last_id"]]


# --- 4. the chain: a claim that read an end since extended claims again from the new end ----


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
    the chain (0) and waits on the unique chain key. Once relay-1's commits, relay-2's
    statement adds no batch and takes no fresh row (it still claims the waiting lane's), and
    says so: relay-2 claims again at once, from the end relay-1's batch left; had relay-1's
    rolled back, relay-2's first statement takes the rows itself."""
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
                assert [(e.id, e.token) for e in got[:1]] == [(waiting, 2)]
                # The claim again: the four lowest fresh rows after relay-1's batch.
                assert [e.id for e in got[1:]] == ids[5:9]
                assert second.statements["claim_lost"] == 1
                assert [(b["first_id"], b["last_id"], b["relay"]) for b in chain] == [
                    (0, ids[4], "relay-1"),
                    (ids[4], ids[8], "relay-2"),
                ]
                assert {e.token for e in got[1:]} == {-chain[1]["id"]}
                assert await fresh(admin, ids)  # in flight in their batches: as written
                # relay-2's next claim begins where its batch ended.
                after = await second.claim(D, 10)
                assert [e.id for e in after] == ids[9:]
                assert [(b["first_id"], b["last_id"]) for b in await batches(admin)] == [
                    (0, ids[4]),
                    (ids[4], ids[8]),
                    (ids[8], ids[9]),
                ]
            else:
                assert second.statements["claim_lost"] == 0
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
    db_url: str, admin: asyncpg.Connection, open_insert: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # For a while: then they are claimed row by row (tests/test_batch_past_fence.py).
    monkeypatch.setattr(claims, "PAST_FENCE_AFTER", 3600.0)
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


# --- 7. forgetting ended batches; a TRUNCATE starts a new chain -------------------------------


async def test_forget_batches_keeps_each_chains_last_and_the_recent_ones(
    db_url: str, admin: asyncpg.Connection
) -> None:
    d_ids = await insert(admin, 10)
    e_ids = await insert(admin, 4, "e")
    async with opened(db_url, "relay-a") as a:
        for _ in range(5):
            assert await a.record(delivered(await a.claim(D, 2))) != set()
        for _ in range(2):
            assert await a.record(delivered(await a.claim("e", 2))) != set()
        chain = await batches(admin)
        d_chain = [b["id"] for b in chain if b["destination"] == D]
        e_chain = [b["id"] for b in chain if b["destination"] == "e"]
        assert (len(d_chain), len(e_chain)) == (5, 2)
        # All ended but d's third (its lease still running), all an hour old but d's second.
        await admin.execute(
            "UPDATE outbox_batches SET relay = NULL, created_at = now() - interval '1 hour' "
            "WHERE id <> $1",
            d_chain[2],
        )
        await admin.execute(
            "UPDATE outbox_batches SET created_at = now() - interval '1 minute' WHERE id = $1",
            d_chain[1],
        )
        assert await a.forget_batches(600) == 3
        kept = {b["id"] for b in await batches(admin)}
        assert kept == {d_chain[1], d_chain[2], d_chain[4], e_chain[1]}
        assert await a.forget_batches(30) == 1  # d's second, now older than that
        assert await a.forget_batches(30) == 0  # each chain's last stays: claims begin there
        # The chains go on from where they ended, for any relay (where a claim begins is in
        # the table): new rows only, none of the old again.
        more = await insert(admin, 3)
        b = batch_store(a.pool, "relay-b")
        assert [e.id for e in await b.claim(D, 10)] == more
        assert await b.claim("e", 10) == []
    assert {r["status"] for r in (await state(admin, d_ids + e_ids)).values()} == {"delivered"}


async def test_a_truncate_starts_a_new_chain_from_the_first_id(
    db_url: str, admin: asyncpg.Connection
) -> None:
    async with opened(db_url, "relay-a") as a:
        await insert(admin, 10)
        assert await a.record(delivered(await a.claim(D, 100))) != set()
        old = await filenode(admin)
        await admin.execute("TRUNCATE outbox RESTART IDENTITY")
        new = await filenode(admin)
        assert new != old
        ids = await insert(admin, 5)
        assert ids == [1, 2, 3, 4, 5]  # below where the old chain ended (10)
        envs = await a.claim(D, 100)
        assert [e.id for e in envs] == ids
        chain = await batches(admin)
        assert [(b["epoch"], b["first_id"], b["last_id"]) for b in chain] == [
            (old, 0, 10),
            (new, 0, 5),
        ]
        assert {e.token for e in envs} == {-chain[1]["id"]}
        assert await a.record(delivered(envs)) == pairs(envs)
        assert {r["status"] for r in (await state(admin, ids)).values()} == {"delivered"}
        # The old epoch's chain is forgotten once ended, but for its last batch.
        await admin.execute("UPDATE outbox_batches SET relay = NULL")
        assert await a.forget_batches(0) == 0
        assert len(await batches(admin)) == 2


@pytest.mark.parametrize("late", ["record", "reap"])
async def test_a_batch_from_before_a_truncate_writes_nothing_to_the_rows_after_it(
    db_url: str, admin: asyncpg.Connection, late: str
) -> None:
    """A batch in flight when the table is truncated with RESTART IDENTITY names ids that new
    rows are given again. Its relay's outcomes (it sent the old rows) and the reaper (its
    relay stopped) must leave the new rows alone: as row claims' tokens do, since a new row
    is not running under that claim."""
    async with opened(db_url, "relay-a") as a:
        await insert(admin, 5)
        envs = await a.claim(D, 10)
        await admin.execute("TRUNCATE outbox RESTART IDENTITY")
        ids = await insert(admin, 5)
        assert ids == [e.id for e in envs]  # the same ids, other events
        written = await versions(admin, ids)
        if late == "record":
            assert await a.record(delivered(envs)) == set()
            assert await a.record(retry(envs, 0.0)) == set()
            await a.release([(e.id, e.token) for e in envs])
        else:
            await expire(admin, "relay-a")
            assert await a.reap_batches(1, {}) == []
        assert await versions(admin, ids) == written
        assert await fresh(admin, ids)
        # The new rows are claimed, each once, under the new epoch's chain.
        again = await a.claim(D, 10)
        assert [e.id for e in again] == ids
        assert await a.record(delivered(again)) == pairs(again)


async def test_a_drain_on_a_reading_from_before_a_truncate_takes_no_row_twice(
    db_url: str, admin: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim that follows a full batch goes on the FENCE reading made before it (within
    FENCE_REUSE: made long here, so that a slow machine takes the same path). When the table
    was truncated with RESTART IDENTITY in between, that reading names the old epoch: its
    chain and its fence must not take the new rows (the new epoch's chain takes them too)."""
    monkeypatch.setattr("relay.db.claims.FENCE_REUSE", 3600.0)
    async with opened(db_url, "relay-a") as a:
        await insert(admin, 20)
        first = await a.claim(D, 10)
        assert len(first) == 10  # a full batch: the next claim goes on its reading
        await admin.execute("TRUNCATE outbox RESTART IDENTITY")
        ids = await insert(admin, 20)
        # Claimed while the claims before are in flight, as the relay claims.
        envs = [e for _ in range(6) for e in await a.claim(D, 10)]
        assert Counter(e.id for e in envs) == Counter(ids)
        assert await a.record(delivered(envs)) == pairs(envs)
        epochs = {b["epoch"] for b in await batches(admin) if b["last_id"] > 10}
        assert epochs == {await filenode(admin)}


async def test_a_drain_reads_the_fence_again_once_its_batches_reach_the_last_reading(
    db_url: str, admin: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim that follows a full batch may go on the FENCE reading made before it, while
    rows that reading showed are still ahead of the chain. Once the chain has reached that
    reading's fence, an older reading can only make the claim come back empty while rows
    committed since wait: the relay then sleeps until a wake-up or its poll interval, though
    their NOTIFY may already have been taken."""
    monkeypatch.setattr("relay.db.claims.FENCE_REUSE", 3600.0)  # however slow the machine
    async with opened(db_url, "relay-a") as a:
        ids = await insert(admin, 30)
        envs = await a.claim(D, 10)
        read = a.statements["fence"]
        envs += [e for _ in range(2) for e in await a.claim(D, 10)]
        assert [e.id for e in envs] == ids
        assert a.statements["fence"] == read  # the first reading served all three batches
        more = await insert(admin, 5)
        assert [e.id for e in await a.claim(D, 10)] == more
        assert a.statements["fence"] == read + 1


# --- retention = 0: the outcome deletes the delivered rows, fenced alike -----------------------


async def test_with_retention_0_a_batchs_outcome_deletes_its_delivered_rows_only(
    db_url: str, admin: asyncpg.Connection
) -> None:
    ids = await insert(admin, 13)
    pool = await create_pool(to_asyncpg_dsn(db_url), "relay-a", 2)
    try:
        a, b = (
            Store(pool, "public", relay, LEASE, delete_delivered=True, batched={D})
            for relay in ("relay-a", "relay-b")
        )
        envs = await a.claim(D, 10)
        # Neither statement of another relay deletes or writes a row.
        assert await b.record(delivered(envs)) == set()
        assert await b.record(delivered(envs[:5]) + retry(envs[5:], 0.0)) == set()
        assert await fresh(admin, ids)
        # Its own: the delivered deleted, the retries in the waiting lane.
        done = await a.record(delivered(envs[:5]) + retry(envs[5:], 30.0))
        assert done == pairs(envs)
        rows = await state(admin, ids)
        assert sorted(rows) == ids[5:]
        assert {
            (rows[i]["status"], rows[i]["attempts"], rows[i]["waiting"]) for i in ids[5:10]
        } == {("pending", 1, True)}
        assert await fresh(admin, ids[10:])
        # A batch of plain deliveries (its own statement), then the same outcomes again.
        rest = await a.claim(D, 10)
        assert [e.id for e in rest] == ids[10:]
        assert await b.record(delivered(rest)) == set()
        assert await a.record(delivered(rest)) == pairs(rest)
        assert await a.record(delivered(rest)) == set()
        assert sorted(await state(admin, ids)) == ids[5:10]
    finally:
        await pool.close()


def test_batch_leases_are_for_unordered_destinations_but_endpoints() -> None:
    destinations = {
        "plain": {"kind": "kafka", "topic": "t"},
        "keyed": {"kind": "kafka", "topic": "t", "ordering": "key"},
        "hook": {"kind": "webhook", "url": "https://example.com/in", "secrets": [SECRET]},
        "fan-out": {"kind": "endpoints"},
    }

    def settings(**relay: Any) -> Any:
        return load_settings(
            None, database_url="postgresql://x@127.0.0.1/y", relay=relay, destinations=destinations
        )

    # claims = "auto" by default: batch leases, unless relays running claim by row (then
    # open_store settles on row: tests/test_batch_registry.py).
    assert settings().relay.claims == "auto"
    assert batched(settings()) == {"plain", "hook"}
    assert batched(settings(claims="auto")) == {"plain", "hook"}
    assert batched(settings(claims="row")) == frozenset()
    assert batched(settings(claims="batch")) == {"plain", "hook"}


# --- 8. end to end: outbox-relay run with claims = "batch", and a relay killed mid-drain -----


def hook_relay(db_url: str, url: str, name: str, **hook: Any) -> dict[str, Any]:
    """A relay.toml: batch leases of 2 s for one webhook destination on the loopback
    receiver."""
    return {
        "database_url": db_url,
        "log_format": "json",
        "http": {"host": "127.0.0.1", "port": 0},
        "relay": {
            "relay_id": name,
            "claims": "batch",
            "lease": 2,
            "poll_interval": 0.1,
            "shutdown_timeout": 5,
            "batch_size": 50,
            "max_in_flight": 100,
        },
        "destinations": {
            "hooks": {
                "kind": "webhook",
                "url": url,
                "secrets": [SECRET],
                "allow_private_networks": True,  # the receiver is on loopback
                "timeout": 5,
                "max_concurrency": 4,
                **hook,
            }
        },
    }


async def enqueue(db_url: str, n: int, per_transaction: int = 50) -> list[int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    ids: list[int] = []
    try:
        for start in range(0, n, per_transaction):
            events = [
                {"destination": "hooks", "payload": {"n": i}}
                for i in range(start, min(n, start + per_transaction))
            ]
            async with conn.transaction():
                ids += await outbox.enqueue_many(conn, events)  # type: ignore[arg-type]
    finally:
        await conn.close()
    return ids


async def counts(admin: asyncpg.Connection) -> dict[str, int]:
    rows = await admin.fetch("SELECT status, count(*) FROM outbox GROUP BY status")
    return {r[0]: r[1] for r in rows}


def ids_sent(requests: Sequence[Any], ok: bool = False) -> Counter[int]:
    """How many requests each event's id had (``ok``: answered 2xx only)."""
    return Counter(
        int(r.headers["webhook-id"])
        for r in requests
        if not ok or (r.status is not None and 200 <= r.status < 300)
    )


async def test_the_relay_delivers_each_event_once_under_batch_leases(
    db_url: str, admin: asyncpg.Connection, receiver: Receiver, tmp_path: Path
) -> None:
    ids = await enqueue(db_url, 200)
    with fleet(tmp_path) as relays:
        relay = relays.start(hook_relay(db_url, receiver.url + "/in", "relay-e2e"), "relay-e2e")
        ids += await enqueue(db_url, 100)  # while it runs: woken by NOTIFY

        async def all_delivered() -> bool:
            assert relays.alive(), relay.output()[-3000:]
            return (await counts(admin)).get("delivered", 0) == len(ids)

        await wait_until(all_delivered, timeout=30, interval=0.1, what="all delivered")
        relay.signal(signal.SIGTERM)
        assert await asyncio.to_thread(relay.wait, 15) == 0, relay.output()[-3000:]
    assert await counts(admin) == {"delivered": len(ids)}
    requests = list(receiver.requests)
    assert ids_sent(requests) == Counter(ids)  # each exactly once
    assert ids_sent(requests, ok=True) == Counter(ids)
    for r in requests[:20]:
        verify(SECRET, r.body, r.headers)
    rows = await admin.fetch("SELECT DISTINCT attempts, claims FROM outbox")
    assert [tuple(r) for r in rows] == [(1, 1)]
    # Claimed under batch leases: one chain over every id, each batch after the one before.
    chain = await batches(admin)
    assert chain and {b["destination"] for b in chain} == {"hooks"}
    assert chain[0]["first_id"] == 0 and chain[-1]["last_id"] == max(ids)
    for before, after in itertools.pairwise(chain):
        assert after["first_id"] == before["last_id"]
    assert {b["relay"] for b in chain} <= {"relay-e2e", None}


async def test_a_relay_killed_mid_drain_leaves_no_row_stranded(
    db_url: str, admin: asyncpg.Connection, receiver: Receiver, tmp_path: Path
) -> None:
    """SIGKILL while batches are in flight. Their rows stay as they were written (fresh)
    behind the chain's end, where no claim reads: the reaper puts them back once the lease
    (2 s) has run out, and a second relay delivers them. Every event arrives, and only those
    rows may arrive twice (sent by the killed relay, not recorded)."""
    receiver.respond(200, delay=0.02)  # a slow endpoint: the drain takes seconds
    ids = await enqueue(db_url, 600)
    with fleet(tmp_path) as relays:
        victim = relays.start(
            hook_relay(db_url, receiver.url, "victim", max_concurrency=2), "victim"
        )

        async def mid_drain() -> bool:
            assert relays.alive(), victim.output()[-3000:]
            return bool(
                (await counts(admin)).get("delivered", 0) >= 60
                and await admin.fetchval(
                    "SELECT count(*) > 0 FROM outbox_batches AS b JOIN outbox AS o "
                    "ON o.destination = b.destination AND o.id > b.first_id "
                    "AND o.id <= b.last_id WHERE b.relay = 'victim' AND o.status = 'pending' "
                    "AND o.claims = 0"
                )
            )

        await wait_until(mid_drain, timeout=30, interval=0.02, what="victim mid-drain")
        victim.signal(signal.SIGKILL)
        await asyncio.to_thread(victim.wait, 10)
        # What it left: its batches' ranges, and their rows it had not recorded.
        ranges = [
            (b["first_id"], b["last_id"]) for b in await batches(admin) if b["relay"] == "victim"
        ]
        unrecorded = {
            r[0]
            for r in await admin.fetch(
                "SELECT id FROM outbox WHERE status = 'pending' AND claims = 0"
            )
            if any(first < r[0] <= last for first, last in ranges)
        }
        assert unrecorded
        end = max(last for _, last in ranges)
        receiver.respond(200)
        relays.start(hook_relay(db_url, receiver.url, "survivor", max_concurrency=8), "survivor")

        async def all_delivered() -> bool:
            assert len(relays.alive()) == 1, relays.logs()[-3000:]
            return (await counts(admin)).get("delivered", 0) == len(ids)

        await wait_until(all_delivered, timeout=40, interval=0.1, what="all delivered")
    assert await counts(admin) == {"delivered": len(ids)}
    # None was left behind: the rows below the victim's chain end went back by the reaper.
    reaped = {
        r[0]
        for r in await admin.fetch(
            "SELECT id FROM outbox WHERE last_error = $1", LEASE_EXPIRED.format("victim")
        )
    }
    assert reaped == unrecorded and all(i <= end for i in reaped)
    attempts = {r[0]: r[1] for r in await admin.fetch("SELECT id, attempts FROM outbox")}
    assert {attempts[i] for i in reaped} == {2}  # the reaper's, then the survivor's
    assert {a for i, a in attempts.items() if i not in reaped} == {1}
    # At least once: every event answered 2xx; twice only where the victim had sent an
    # event and not recorded it.
    ok = ids_sent(receiver.requests, ok=True)
    assert set(ok) == set(ids) and sum(ok.values()) >= len(ids)
    sent = ids_sent(receiver.requests)
    twice = {i for i, n in sent.items() if n > 1}
    assert twice <= reaped
    assert max(sent.values()) <= 2
