"""Batch leases past a fence that stands still (queries.CLAIM_PAST_FENCE), against a real
PostgreSQL: an inserting transaction left open holds back the batch claims' fence, and once it
has stood there a while the rows committed after it are claimed row by row, each by one relay
only, while batch claims of other relays run; the rows of the open transaction are taken by a
batch once it commits."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import asyncpg
import pytest

import outbox
from outbox.dburl import to_asyncpg_dsn
from relay.db import claims, queries
from tests.support.faults import fleet
from tests.support.receiver import Receiver
from tests.support.relays import wait_until
from tests.test_batch_claims import (
    D,
    batches,
    counts,
    delivered,
    enqueue,
    hook_relay,
    ids_sent,
    insert,
    opened,
    pairs,
    state,
)

AFTER = 0.2  # PAST_FENCE_AFTER in these tests


@pytest.fixture(autouse=True)
def _after(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claims, "PAST_FENCE_AFTER", AFTER)


async def fence(conn: asyncpg.Connection) -> int:
    """What FENCE reads now: every id up to it belongs to a transaction that has ended."""
    sql = queries.render_ops(queries.FENCE, "public")
    return int((await conn.fetchrow(sql, queries.qualified_table("public"), 0))[0])


async def past_fence(
    conn: asyncpg.Connection, relay: str, at: int, cursor: int | None = None
) -> tuple[list[int], str]:
    """Run CLAIM_PAST_FENCE for D with fence ``at``: the ids claimed, and the gate's answer."""
    rows = await conn.fetch(
        queries.render_ops(queries.CLAIM_PAST_FENCE, "public"),
        queries.qualified_table("public"),
        D,
        100,
        relay,
        60.0,
        at,
        at if cursor is None else cursor,
    )
    return sorted(r[0] for r in rows if r[0] != -1), rows[-1][4]


@pytest.mark.parametrize("open_insert", ["commits", "rolls back"])
async def test_rows_past_a_fence_that_stands_still_are_claimed_row_by_row(
    db_url: str, admin: asyncpg.Connection, open_insert: str
) -> None:
    before = await insert(admin, 3)
    writer = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = writer.transaction()
        await tx.start()
        held = await insert(writer, 3)
        after = await insert(admin, 4)
        async with opened(db_url, "relay-a") as store:
            first = await store.claim(D, 100)
            assert [e.id for e in first] == before
            # The fence stands below `after`: not at once, but once it has stood there a while.
            assert await store.claim(D, 100) == []
            await asyncio.sleep(AFTER + 0.05)
            envs = await store.claim(D, 100)
            assert [e.id for e in envs] == after
            assert {e.token for e in envs} == {1}  # by row: their own token, not a batch's
            rows = await state(admin, after)
            assert {(r["status"], r["locked_by"]) for r in rows.values()} == {
                ("running", "relay-a")
            }
            assert len(await batches(admin)) == 1  # no batch for them
            assert await store.claim(D, 100) == []  # each once
            # Rows committed while the fence still stands: claimed at once, from where the
            # last claim past it ended.
            more = await insert(admin, 2)
            again = await store.claim(D, 100)
            assert [e.id for e in again] == more
            done = first + envs + again
            assert await store.record(delivered(done)) == pairs(done)
            assert await fresh_ids(admin) == []  # held: not yet visible
            if open_insert == "commits":
                await tx.commit()
            else:
                await tx.rollback()
            last = await store.claim(D, 100)
            expected = held if open_insert == "commits" else []
            assert [e.id for e in last] == expected
            assert all(e.token < 0 for e in last)  # in a batch, as the fence passes them
            assert await store.record(delivered(last)) == pairs(last)
            assert await store.claim(D, 100) == []
            await asyncio.sleep(AFTER + 0.05)
            assert await store.claim(D, 100) == []
    finally:
        await writer.close()
    rows = await admin.fetch("SELECT status, attempts, claims FROM outbox")
    assert {tuple(r) for r in rows} == {("delivered", 1, 1)}
    assert len(rows) == len(before) + len(after) + len(more) + (
        len(held) if open_insert == "commits" else 0
    )


async def fresh_ids(conn: asyncpg.Connection) -> list[int]:
    rows = await conn.fetch(
        "SELECT id FROM outbox WHERE status = 'pending' AND claims = 0 ORDER BY id"
    )
    return [r[0] for r in rows]


async def test_nothing_is_claimed_past_a_fence_whose_insert_has_ended(
    db_url: str, admin: asyncpg.Connection
) -> None:
    """The gate: rows are claimed past :fence only while another transaction holds a fence key
    at or below it, as FENCE read it; once that one has ended, the batch claims take them."""
    low = await insert(admin, 2)
    writer = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = writer.transaction()
        await tx.start()
        await insert(writer, 1)
        rows = await insert(admin, 3)
        at = await fence(admin)
        assert at < min(rows)
        # Open: the writer's key is held (nothing past the cursor to claim).
        got, gate = await past_fence(admin, "relay-a", at, cursor=max(rows))
        assert (got, gate) == ([], "t")
        await tx.rollback()
        # Shut: no key but the one this statement takes itself.
        got, gate = await past_fence(admin, "relay-a", at)
        assert (got, gate) == ([], "f")
        assert await fresh_ids(admin) == low + rows
    finally:
        await writer.close()


async def test_a_claim_past_the_fence_holds_the_fence_there_until_it_commits(
    db_url: str, admin: asyncpg.Connection
) -> None:
    """The race the gate closes: the insert below the fence commits while a claim past it is
    still open. A batch claim that reads the fence meanwhile must not read past the rows that
    claim took (its snapshot does not see them taken: both would send them)."""
    writer = await asyncpg.connect(to_asyncpg_dsn(db_url))
    claimer = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = writer.transaction()
        await tx.start()
        held = await insert(writer, 2)
        after = await insert(admin, 3)
        at = await fence(admin)
        async with claimer.transaction():
            got, gate = await past_fence(claimer, "relay-a", at)
            assert (got, gate) == (after, "t")
            await tx.commit()
            assert await fence(admin) == at  # still, while the claim is open
            # But its key is no insert's: another relay's claim past that fence is refused
            # (its gate would pass on a key that says nothing of the fence readings since).
            assert await past_fence(admin, "relay-c", at) == ([], "f")
            async with opened(db_url, "relay-b") as other:
                assert await other.claim(D, 100) == []
        # Committed: the next batch claim takes what the insert wrote, and nothing else.
        async with opened(db_url, "relay-b") as other:
            envs = await other.claim(D, 100)
            assert [e.id for e in envs] == held and all(e.token < 0 for e in envs)
        rows = await state(admin, after)
        assert {(r["status"], r["locked_by"], r["claims"]) for r in rows.values()} == {
            ("running", "relay-a", 1)
        }
    finally:
        await writer.close()
        await claimer.close()


async def test_the_relay_delivers_what_commits_behind_an_open_insert_while_it_stays_open(
    db_url: str, admin: asyncpg.Connection, receiver: Receiver, tmp_path: Path
) -> None:
    """outbox-relay run with claims = "batch": a session that enqueued and stays idle in
    transaction does not hold back the events committed after it; its own are delivered once
    it commits. Each event arrives once."""
    writer = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        with fleet(tmp_path) as relays:
            relay = relays.start(hook_relay(db_url, receiver.url + "/in", "relay-pf"), "relay-pf")
            first = await enqueue(db_url, 20)

            async def delivered_count(n: int) -> bool:
                assert relays.alive(), relay.output()[-3000:]
                return (await counts(admin)).get("delivered", 0) >= n

            await wait_until(lambda: delivered_count(20), timeout=30, what="first delivered")
            tx = writer.transaction()
            await tx.start()
            events = [{"destination": "hooks", "payload": {"held": i}} for i in range(5)]
            held = list(await outbox.enqueue_many(writer, events))  # type: ignore[arg-type]
            started = time.monotonic()
            later = await enqueue(db_url, 30)
            await wait_until(
                lambda: delivered_count(50), timeout=10, interval=0.05, what="later delivered"
            )
            waited = time.monotonic() - started
            assert waited < 5, waited  # not held back for as long as the insert stays open
            await tx.commit()
            await wait_until(lambda: delivered_count(55), timeout=30, what="held delivered")
    finally:
        await writer.close()
    assert ids_sent(receiver.requests) == {i: 1 for i in first + later + held}
