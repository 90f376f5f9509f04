"""A hostile review of the claims past a fence that stands still (queries.CLAIM_PAST_FENCE),
against a real PostgreSQL: what lowers the fence below rows in flight in a batch, rows that
commit behind the claims' cursor while the fence stands, and a claim past the fence that
fails after the batch claim before it took rows."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from relay.db import claims
from tests.test_batch_claims import D, delivered, insert, opened, pairs, state
from tests.test_batch_past_fence import past_fence

AFTER = 0.2  # PAST_FENCE_AFTER in these tests
BASE = 4611686018427387904  # migrations/0004: the fence keys' base


@pytest.fixture(autouse=True)
def _after(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claims, "PAST_FENCE_AFTER", AFTER)


async def fence_pair(conn: asyncpg.Connection, value: int) -> None:
    """The pair of fence keys at ``value`` that the trigger of migrations/0004 takes for an
    insert into a table whose tag is the outbox's: another schema's outbox whose oid is the
    same modulo 16383 (its ids, and so its keys' values, are its own sequence's)."""
    tag = await conn.fetchval("SELECT 1 + mod('public.outbox'::regclass::oid::bigint, 16383)")
    await conn.execute(
        "SELECT pg_advisory_xact_lock_shared($1::bigint), pg_advisory_xact_lock_shared($2::bigint)",
        BASE + (tag << 48) + value,
        BASE + value,
    )


@pytest.mark.parametrize("lowered_by", ["another table's insert", "setval"])
async def test_no_row_in_flight_in_a_batch_is_claimed_again_past_a_lower_fence(
    db_url: str, admin: asyncpg.Connection, lowered_by: str
) -> None:
    """The gate trusts that an insert's key lies above every id visible when it was taken, so
    that no batch reached past it. A key of another table whose tag collides (its own
    sequence's value), or of this one after a setval, lies below a chain of batches: the rows
    in flight in them are still fresh, and were claimed again by row past the fence (the same
    event sent by two relays at once)."""
    rows = await insert(admin, 10)
    writer = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with opened(db_url, "relay-b") as b, opened(db_url, "relay-a") as a:
            in_flight = await b.claim(D, 100)
            assert [e.id for e in in_flight] == rows and all(e.token < 0 for e in in_flight)
            tx = writer.transaction()
            await tx.start()
            if lowered_by == "setval":
                # The first six delivered and deleted (retention = 0), and the sequence set
                # back over them: no id in use is handed out again.
                done = in_flight[:6]
                assert await b.record(delivered(done)) == pairs(done)
                await admin.execute("DELETE FROM outbox WHERE id <= $1", rows[5])
                await admin.execute("SELECT setval('outbox_id_seq', $1)", rows[0])
                await insert(writer, 1)
            else:
                await fence_pair(writer, rows[0])
            assert await a.claim(D, 100) == []
            await asyncio.sleep(AFTER + 0.05)
            taken = await a.claim(D, 100)
            assert [e.id for e in taken] == []
            await tx.rollback()
    finally:
        await writer.close()
    left = await state(admin, rows[6:])
    assert {(r["status"], r["claims"]) for r in left.values()} == {("pending", 0)}


async def test_rows_committed_behind_the_cursor_past_a_fence_are_claimed_while_it_stands(
    db_url: str, admin: asyncpg.Connection
) -> None:
    """Inserts commit out of id order all the time. A claim past the fence moved its cursor
    past the id of an insert still open (not yet visible), and the claims past that fence
    never read below the cursor again: its row waited for the transaction holding the fence
    (a bulk import: an hour) though it committed at once."""
    bulk = await asyncpg.connect(to_asyncpg_dsn(db_url))
    late = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        held = bulk.transaction()
        await held.start()
        await insert(bulk, 1)  # the transaction left open: the fence stands below it
        request = late.transaction()
        await request.start()
        slow = await insert(late, 1)  # a request's insert, committed after later ones
        after = await insert(admin, 3)
        assert min(after) > max(slow)
        async with opened(db_url, "relay-a") as a:
            assert await a.claim(D, 100) == []
            await asyncio.sleep(AFTER + 0.05)
            first = await a.claim(D, 100)
            assert [e.id for e in first] == after
            await request.commit()
            got: list[int] = []
            deadline = time.monotonic() + 1.0
            while not got and time.monotonic() < deadline:
                got = [e.id for e in await a.claim(D, 100)]
                await asyncio.sleep(0.05)
            assert got == slow
        await held.rollback()
    finally:
        await bulk.close()
        await late.close()


async def test_a_claim_past_the_fence_that_fails_loses_no_row_the_batch_claim_took(
    db_url: str, admin: asyncpg.Connection
) -> None:
    """The claim past the fence is a second statement after the batch claim, which has
    committed: when it fails (a timeout, a connection lost) the rows the first took must
    still reach the relay. Raised instead, they stayed in flight unknown to it, until their
    lease ended and the reaper counted an attempt (failed unsent once attempts are spent)."""
    writer = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = writer.transaction()
        await tx.start()
        await insert(writer, 1)
        await insert(admin, 2)  # past the fence
        async with opened(db_url, "relay-a") as a:
            unordered = a.unordered
            assert await a.claim(D, 100) == []
            await asyncio.sleep(AFTER + 0.05)
            # A row due again (retried): the batch claim takes it, row by row, in its
            # waiting lane, and commits; then the claim past the fence fails.
            retried = await admin.fetch(
                "INSERT INTO outbox (destination, payload, claims, attempts) "
                "VALUES ($1, '\\x00'::bytea, 1, 1) RETURNING id",
                D,
            )
            taken = [r["id"] for r in retried]
            call = unordered._call

            async def failing(method: str, sql: str, *args: Any) -> Any:
                if sql == unordered.claim_past_fence:
                    raise asyncpg.QueryCanceledError("canceling statement due to statement timeout")
                return await call(method, sql, *args)

            unordered._call = failing
            try:
                envs = [e.id for e in await a.claim(D, 100)]
            except asyncpg.QueryCanceledError:
                envs = []
            finally:
                unordered._call = call
            rows = await state(admin, taken)
            assert rows[taken[0]]["status"] == "running"
            assert envs == taken  # in the relay's hands, to be sent and recorded
            # The error is not lost: the next claim raises it, and the one after claims again.
            with pytest.raises(asyncpg.QueryCanceledError):
                await a.claim(D, 100)
            assert await a.claim(D, 100) == []
            await asyncio.sleep(AFTER + 0.05)
            assert len(await a.claim(D, 100)) == 2  # past the fence, as before
        await tx.rollback()
    finally:
        await writer.close()


async def test_a_claim_again_from_the_chains_new_end_that_fails_loses_no_row_taken_before(
    db_url: str, admin: asyncpg.Connection
) -> None:
    """The same for a batch claim that lost the race for the chain's end and claims again at
    once (UnorderedClaims._take_batch): what the first took has committed."""
    ids = await insert(admin, 3)
    async with opened(db_url, "relay-a") as a:
        unordered = a.unordered
        call = unordered._call
        tries = 0

        async def lost_then_failing(method: str, sql: str, *args: Any) -> Any:
            nonlocal tries
            if sql != unordered.claim_batch:
                return await call(method, sql, *args)
            tries += 1
            if tries > 1:
                raise asyncpg.QueryCanceledError("canceling statement due to statement timeout")
            # As if another claim had extended the chain meanwhile: the last row says so.
            return [*await call(method, sql, *args), (-1,) + (None,) * 9]

        unordered._call = lost_then_failing
        try:
            envs = [e.id for e in await a.claim(D, 100)]
        except asyncpg.QueryCanceledError:
            envs = []
        finally:
            unordered._call = call
        assert envs == ids
        with pytest.raises(asyncpg.QueryCanceledError):
            await a.claim(D, 100)
        assert await a.claim(D, 100) == []


async def test_the_gate_counts_no_key_whose_transaction_holds_no_lock_on_the_table(
    db_url: str, admin: asyncpg.Connection
) -> None:
    """A fence key pair of this table's tag held by a transaction that never touched the table
    (an insert into another schema's outbox whose tag collides): its value is another
    sequence's and says nothing of this table's fence readings, so the gate stays shut, even
    with no chain of batches below to bound the claim."""
    rows = await insert(admin, 3)
    holder = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with holder.transaction():
            await fence_pair(holder, 1)
            got, gate = await past_fence(admin, "relay-a", 1)
            assert (got, gate) == ([], "f")
            assert {r["claims"] for r in (await state(admin, rows)).values()} == {0}
    finally:
        await holder.close()


async def test_rows_are_not_held_back_by_an_open_insert_into_another_schemas_outbox(
    db_url: str, admin: asyncpg.Connection
) -> None:
    """An insert into another schema's outbox whose tag collides with this one's (1 in 16,383
    per pair of schemas: likely among a few hundred tenants' schemas), left open (a bulk
    import, a session idle in transaction): its key, at its own sequence's value, is this
    table's fence, and since de148bf the gate stays shut on it. Every row of a destination
    claimed in batches then waits for that transaction, in another schema: the stall that
    claims past the fence exist to end."""
    holder = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with holder.transaction():
            await fence_pair(holder, 0)
            rows = await insert(admin, 3)
            async with opened(db_url, "relay-a") as a:
                got: list[int] = []
                deadline = time.monotonic() + 1.0
                while len(got) < len(rows) and time.monotonic() < deadline:
                    got += [e.id for e in await a.claim(D, 100)]
                    await asyncio.sleep(0.05)
            assert sorted(got) == rows
    finally:
        await holder.close()
