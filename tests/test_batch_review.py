"""Found by a review of batch leases (relay.claims = "batch"): each test states a guarantee
the design promises (at-least-once, one claimant at a time, outcomes fenced) and a way it was
broken. Each failed on the code reviewed; those marked xfail (strict) still do, and are the
known gaps docs/deploying.md lists."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from structlog.testing import capture_logs

from outbox.status import Status
from relay.db.store import Record, Store
from relay.maintenance import reaper as reaper_module
from relay.model import Envelope
from relay.obs.metrics import Metrics

GAP = 'known gap of relay.claims = "batch" (docs/deploying.md): '

LEASE = 60.0


def batch_store(pool: asyncpg.Pool, relay: str) -> Store:
    return Store(pool, "public", relay, LEASE, batched={"d"})


async def insert(pool: asyncpg.Pool, n: int, extra: str = "") -> list[int]:
    rows = await pool.fetch(
        f"INSERT INTO outbox (destination, payload{', ' + extra.split('=')[0] if extra else ''}) "
        f"SELECT 'd', '\\x00'::bytea{', ' + extra.split('=', 1)[1] if extra else ''} "
        "FROM generate_series(1, $1) RETURNING id",
        n,
    )
    return [r[0] for r in rows]


async def expire_batches(pool: asyncpg.Pool) -> None:
    await pool.execute("UPDATE outbox_batches SET lease_until = now() - interval '1 s'")


async def fresh_ids(pool: asyncpg.Pool) -> list[int]:
    rows = await pool.fetch(
        "SELECT id FROM outbox WHERE status = 'pending' AND claims = 0 "
        "AND run_after <= created_at ORDER BY id"
    )
    return [r[0] for r in rows]


# --- 1. The epoch is the ids', not the table's file --------------------------------------------


@pytest.mark.parametrize("rewrite", ["VACUUM FULL outbox", "CLUSTER outbox USING outbox_pkey"])
async def test_a_table_rewrite_does_not_hand_a_batchs_rows_to_a_second_relay(
    pool: asyncpg.Pool, rewrite: str
) -> None:
    """VACUUM FULL / CLUSTER (and pg_repack, ALTER TABLE SET TABLESPACE) give the outbox a new
    filenode without handing out any id again. The batch claim took that for a new epoch and
    started a new chain at 0: rows in flight in relay A's open batch were taken again by B.
    The epoch is now the ids' (the file of the id column's sequence): the chain goes on, and
    A's batch is still A's."""
    ids = await insert(pool, 50)
    a_store = batch_store(pool, "relay-a")
    a = await a_store.claim("d", 20)
    assert len(a) == 20
    await pool.execute(rewrite)
    b = await batch_store(pool, "relay-b").claim("d", 50)
    twice = sorted({e.id for e in a} & {e.id for e in b})
    assert not twice, f"rows claimed by two relays at once: {twice}"
    assert sorted(e.id for e in b) == ids[20:]
    written = await a_store.record(
        [Record(e.id, e.token, Status.DELIVERED, 1, 0.0, None) for e in a]
    )
    assert len(written) == 20, "A's outcomes refused after a rewrite"


async def test_a_truncate_without_restart_identity_goes_on_with_the_chain(
    pool: asyncpg.Pool,
) -> None:
    """A plain TRUNCATE gives the table a new file but hands out no id again: the chain goes
    on from its end (one epoch), and the new rows are claimed once."""
    await insert(pool, 10)
    a = batch_store(pool, "relay-a")
    assert len(await a.claim("d", 10)) == 10
    await pool.execute("TRUNCATE outbox")
    again = await insert(pool, 5)
    assert again == [11, 12, 13, 14, 15]
    got = await batch_store(pool, "relay-b").claim("d", 10)
    assert sorted(e.id for e in got) == again
    chain = await pool.fetch("SELECT epoch, first_id, last_id FROM outbox_batches ORDER BY id")
    assert len({r[0] for r in chain}) == 1 and [(r[1], r[2]) for r in chain] == [(0, 10), (10, 15)]


@pytest.mark.parametrize(
    "restart",
    ["ALTER SEQUENCE outbox_id_seq RESTART", "ALTER TABLE outbox ALTER COLUMN id RESTART"],
)
async def test_a_restarted_sequence_starts_a_new_chain(pool: asyncpg.Pool, restart: str) -> None:
    """Ids handed out again from the start without a TRUNCATE (the rows deleted, the sequence
    restarted): a new epoch of the ids. A's batch in flight, of the old epoch, records nothing
    on the new events that have its rows' ids; the new chain takes them from the start."""
    await insert(pool, 10)
    a = batch_store(pool, "relay-a")
    envs = await a.claim("d", 10)
    assert len(envs) == 10
    await pool.execute("DELETE FROM outbox")
    await pool.execute(restart)
    new = await insert(pool, 10)
    assert new == [e.id for e in envs]  # the same ids, other events
    written = await a.record([Record(e.id, e.token, Status.DELIVERED, 1, 0.0, None) for e in envs])
    assert not written and await fresh_ids(pool) == new
    b = batch_store(pool, "relay-b")
    got = await b.claim("d", 10)
    assert sorted(e.id for e in got) == new
    done = await b.record([Record(e.id, e.token, Status.DELIVERED, 1, 0.0, None) for e in got])
    assert len(done) == 10
    # A's next claims (on its old reading, then a new one) take none of them again.
    assert [e for _ in range(2) for e in await a.claim("d", 10)] == []


# --- 2. The outcome fence does not tie a row to its batch (range, epoch) ------------------


async def test_a_stale_batchs_outcome_cannot_mark_a_new_event_delivered(pool: asyncpg.Pool) -> None:
    """TRUNCATE ... RESTART IDENTITY while relay A holds a batch (the epoch is there for
    TRUNCATE). New events get ids 1..10 again. A's outcomes for the old events (token -batch)
    pass the fence: the new rows are fresh and A's batch is still A's. The new events are
    marked delivered without ever being sent. (Row mode refuses: token 1 vs claims 0.)"""
    await insert(pool, 10)
    store = batch_store(pool, "relay-a")
    envs = await store.claim("d", 10)
    assert len(envs) == 10
    await pool.execute("TRUNCATE outbox RESTART IDENTITY")
    new = await insert(pool, 10)
    assert new == [e.id for e in envs]  # the same ids, other events
    written = await store.record(
        [Record(e.id, e.token, Status.DELIVERED, 1, 0.0, None) for e in envs]
    )
    statuses = [r[0] for r in await pool.fetch("SELECT status FROM outbox ORDER BY id")]
    assert not written and statuses == ["pending"] * 10, statuses


async def test_reaping_a_stale_batch_leaves_new_events_alone(pool: asyncpg.Pool) -> None:
    """Same start; A dies. reap_batches puts back 'rows of A's batch' by id range only, in
    whatever epoch: the new events (never claimed, max attempts 1) are failed as 'lease
    expired: relay relay-a ...' without a single attempt."""
    await insert(pool, 10)
    store = batch_store(pool, "relay-a")
    assert len(await store.claim("d", 10)) == 10
    await pool.execute("TRUNCATE outbox RESTART IDENTITY")
    await insert(pool, 10)
    await expire_batches(pool)
    reaped = await store.reap_batches(1, {"d": 1})
    rows = await pool.fetch("SELECT status, attempts FROM outbox ORDER BY id")
    assert not reaped and all((r[0], r[1]) == ("pending", 0) for r in rows), [
        tuple(r) for r in rows
    ]


async def test_a_dead_relays_batch_from_before_a_rewrite_is_put_back_once(
    pool: asyncpg.Pool,
) -> None:
    """Relay A dies holding a batch; the table is rewritten (VACUUM FULL). Once A's
    batch and relay B's covered the same rows (test 1), and the reaper put them back under B's
    feet. Now B takes none of A's rows until the reaper has put them back, then each once
    (the waiting lane), and its outcomes are recorded."""
    ids = await insert(pool, 20)
    a = batch_store(pool, "relay-a")
    assert len(await a.claim("d", 20)) == 20
    await pool.execute("VACUUM FULL outbox")
    b = batch_store(pool, "relay-b")
    assert await b.claim("d", 20) == []
    await pool.execute(
        "UPDATE outbox_batches SET lease_until = now() - interval '1 s' WHERE relay = 'relay-a'"
    )
    assert sorted(r[0] for r in await a.reap_batches(5, {"d": 5})) == ids
    benvs = await b.claim("d", 20)
    assert sorted(e.id for e in benvs) == ids
    written = await b.record([Record(e.id, e.token, Status.DELIVERED, 1, 0.0, None) for e in benvs])
    assert len(written) == len(benvs), "B held a live lease and its outcomes were dropped"


# --- 3. No sweep for batched destinations --------------------------------------------------


async def test_ids_handed_out_again_below_the_chains_end_are_claimed(pool: asyncpg.Pool) -> None:
    """A sequence set back by hand (row mode: queries.FRESH_BELOW and the sweep find such rows
    and walk back to them). Batch claims never look below the chain's end, and the sweep only
    walks row-mode cursors: the rows stay pending for ever."""
    store = batch_store(pool, "relay-a")
    await insert(pool, 30)
    envs = await store.claim("d", 30)
    await store.record([Record(e.id, e.token, Status.DELIVERED, 1, 0.0, None) for e in envs])
    await pool.execute("DELETE FROM outbox WHERE id > 10")  # retention, say
    await pool.execute("SELECT setval(pg_get_serial_sequence('outbox', 'id'), 10)")
    again = await insert(pool, 5)
    assert again == [11, 12, 13, 14, 15]
    await store.sweep()
    got = await batch_store(pool, "relay-b").claim("d", 30)
    assert sorted(e.id for e in got) == again


def outcomes(envs: list[Envelope], kinds: str) -> list[Record]:
    """Each envelope delivered ("delivered": record_batch_delivered's), or every other one
    retried ("mixed": record_batch's, and with retention 0 both parts of its _deleting)."""
    return [
        Record(e.id, e.token, Status.PENDING, 1, 1.0, "no")
        if kinds == "mixed" and i % 2
        else Record(e.id, e.token, Status.DELIVERED, 1, 0.0, None)
        for i, e in enumerate(envs)
    ]


@pytest.mark.parametrize("kinds", ["delivered", "mixed"])
@pytest.mark.parametrize("retention", [None, 0])
async def test_a_setval_over_rows_in_flight_does_not_record_them_on_new_events(
    pool: asyncpg.Pool, kinds: str, retention: int | None
) -> None:
    """Found while closing the rewrite gap: setval gives the sequence no new file, so the ids'
    epoch stays. Rows in flight under A's batch deleted by hand, the sequence set back, new
    events get their ids: A's outcomes passed the fence (fresh, in range, batch still A's) and
    marked the new events delivered, never sent. (Row mode refuses: token 1 vs claims 0.)
    Now the batch keeps the xmax of its claim's snapshot (migration 0016): the new events were
    written by later transactions, at a later time, and the outcomes are refused."""
    await insert(pool, 10)
    a = Store(pool, "public", "relay-a", LEASE, batched={"d"}, delete_delivered=retention == 0)
    envs = await a.claim("d", 10)
    await pool.execute("DELETE FROM outbox")
    await pool.execute("SELECT setval(pg_get_serial_sequence('outbox', 'id'), 1, false)")
    assert await insert(pool, 10) == [e.id for e in envs]
    written = await a.record(outcomes(envs, kinds))
    assert not written
    assert await fresh_ids(pool) == [e.id for e in envs]  # untouched, left to be claimed
    # A's batch ends with its lease; the reaper puts the new events back, and they are sent.
    await expire_batches(pool)
    assert len(await a.reap_batches(5, {"d": 5})) == 10
    got = await batch_store(pool, "relay-b").claim("d", 10)
    assert sorted(e.id for e in got) == [e.id for e in envs]


@pytest.mark.xfail(
    strict=True,
    reason=GAP + "ids handed out again to rows whose insert gives a created_at before the claim",
)
async def test_a_setval_over_rows_in_flight_with_an_earlier_created_at(
    pool: asyncpg.Pool,
) -> None:
    """What is left of the gap above: the new events' insert gives them a created_at (and a
    run_after, or they are no fresh rows) no later than the claim's (an import of older
    events by hand: the outbox's enqueue gives neither), or the clock stood behind. Or their
    transaction already had its id when the claim read its snapshot. The fence leaves
    a row to its batch if either its xmin or its created_at says it is older than the claim
    (its xmin alone does not say when it was written: a rewrite in flight gives it a new one),
    and the created_at says so."""
    await insert(pool, 10)
    a = batch_store(pool, "relay-a")
    envs = await a.claim("d", 10)
    await pool.execute("DELETE FROM outbox")
    await pool.execute("SELECT setval(pg_get_serial_sequence('outbox', 'id'), 1, false)")
    again = await pool.fetch(
        "INSERT INTO outbox (destination, payload, created_at, run_after) "
        "SELECT 'd', '\\x00', now() - interval '1 hour', now() - interval '1 hour' "
        "FROM generate_series(1, 10) RETURNING id"
    )
    assert [r[0] for r in again] == [e.id for e in envs]
    assert await fresh_ids(pool) == [e.id for e in envs]
    written = await a.record(outcomes(envs, "delivered"))
    assert not written


async def test_an_insert_that_began_after_the_claims_transaction_is_recorded(
    pool: asyncpg.Pool,
) -> None:
    """The race of an insert and a claim: an inserting transaction that began a moment after
    the claim's did (its created_at later than the batch's) but committed before the claim's
    statement read its snapshot (so the claim took its rows: the visibility fence) is the
    batch's. Its created_at is later than the claim's, here by a second, and its xmin is
    older than the claim's snapshot's xmax: the outcomes are recorded."""
    ids = await insert(pool, 10, "created_at=now() + interval '1 s'")
    a = batch_store(pool, "relay-a")
    envs = await a.claim("d", 10)
    assert sorted(e.id for e in envs) == ids
    later = await pool.fetchval(
        "SELECT bool_and(o.created_at > b.created_at) FROM outbox AS o, outbox_batches AS b"
    )
    assert later
    assert len(await a.record(outcomes(envs, "mixed"))) == 10


async def test_an_insert_committed_just_before_the_claim_is_recorded(pool: asyncpg.Pool) -> None:
    """Rows of a transaction that had its id while the claim read its snapshot were not
    taken (the visibility fence); once committed, the next claim takes them, and their
    outcomes are recorded."""
    await insert(pool, 3)
    a = batch_store(pool, "relay-a")
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        late = [
            r[0]
            for r in await conn.fetch(
                "INSERT INTO outbox (destination, payload) "
                "SELECT 'd', '\\x00'::bytea FROM generate_series(1, 3) RETURNING id"
            )
        ]
        first = await a.claim("d", 10)
        await tx.commit()
    assert not {e.id for e in first} & set(late)
    second = await a.claim("d", 10)
    assert sorted(e.id for e in second) == late
    assert len(await a.record(outcomes(first + second, "delivered"))) == len(first) + 3


async def test_a_batch_claimed_before_migration_0016_is_fenced_as_before(
    pool: asyncpg.Pool,
) -> None:
    """A batch with no snapshot_xmax (claimed before migration 0016, or by a relay of an
    earlier release): its outcomes are recorded as they were."""
    await insert(pool, 10)
    a = batch_store(pool, "relay-a")
    envs = await a.claim("d", 10)
    await pool.execute("UPDATE outbox_batches SET snapshot_xmax = NULL")
    assert len(await a.record(outcomes(envs, "mixed"))) == 10


async def test_a_relay_refuses_a_schema_without_migration_0016(pool: asyncpg.Pool) -> None:
    """Its batch claims and outcomes read the column: without it a relay does not start."""
    store = batch_store(pool, "relay-a")
    assert await store.missing_tables() == []
    await pool.execute("ALTER TABLE outbox_batches DROP COLUMN snapshot_xmax")
    assert await store.missing_tables() == [
        '"public"."outbox_batches".snapshot_xmax (migration 0016)'
    ]


# --- 4. "Fresh" as a state a row can return to -------------------------------------------


async def test_a_reaped_row_is_never_left_fresh_below_the_chain(pool: asyncpg.Pool) -> None:
    """The DB clock stepped back (NTP, a VM resumed): a row's created_at is later than now().
    reap_batches puts it back with run_after = now() (<= created_at) and claims 0: still
    'fresh', in no open batch, below the chain's end: never claimed again. (Row mode: the
    claim made claims 1, the reaped row is in the waiting lane.)"""
    # created_at an hour ahead of the clock: the clock was stepped back by an hour.
    row = await pool.fetchval(
        "INSERT INTO outbox (destination, payload, created_at, run_after) "
        "VALUES ('d', '\\x00', now() + interval '1 hour', now() - interval '1 s') RETURNING id"
    )
    await insert(pool, 3)
    store = batch_store(pool, "relay-a")
    assert row in {e.id for e in await store.claim("d", 10)}
    await expire_batches(pool)  # relay-a died
    reaped = await store.reap_batches(5, {"d": 5})
    assert row in {r[0] for r in reaped}
    got = await batch_store(pool, "relay-b").claim("d", 10)
    assert row in {e.id for e in got}, "reaped row stranded: pending, claims 0, never claimed"


async def test_a_released_row_is_never_left_fresh_below_the_chain(pool: asyncpg.Pool) -> None:
    """The same with release_batch (clean stop): run_after = now() <= created_at."""
    row = await pool.fetchval(
        "INSERT INTO outbox (destination, payload, created_at, run_after) "
        "VALUES ('d', '\\x00', now() + interval '1 hour', now() - interval '1 s') RETURNING id"
    )
    store = batch_store(pool, "relay-a")
    envs = await store.claim("d", 10)
    assert [e.id for e in envs] == [row]
    await store.release([(e.id, e.token) for e in envs])
    got = await batch_store(pool, "relay-b").claim("d", 10)
    assert [e.id for e in got] == [row], "released row stranded"


async def test_a_fresh_row_not_yet_due_is_not_passed_over(pool: asyncpg.Pool) -> None:
    """The clock stepped back by 2 s after row 1 was written: its run_after (= created_at) is
    2 s ahead of now(). The claim's fresh lane skips it (run_after <= now()) but takes row 2,
    and the chain's end passes row 1; once due, it is fresh below the chain: never claimed.
    (Row mode's cursor stops below the first fresh row it did not take.)"""
    first = await pool.fetchval(
        "INSERT INTO outbox (destination, payload, created_at, run_after) "
        "VALUES ('d', '\\x00', now() + interval '2 s', now() + interval '2 s') RETURNING id"
    )
    (second,) = await insert(pool, 1)
    store = batch_store(pool, "relay-a")
    # A fresh row was due when written: the claim takes it, whatever the clock says now.
    assert sorted(e.id for e in await store.claim("d", 10)) == [first, second]
    got = await batch_store(pool, "relay-b").claim("d", 10)
    assert got == [], "claimed twice"


# --- 5. The reaper's batch pass had no fallback for a refused row -------------------------

REFUSE = """
CREATE FUNCTION refuse_reap() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id = {id} AND NEW.last_error LIKE 'lease expired%' THEN
        RAISE EXCEPTION 'refused for row {id}';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_reap BEFORE UPDATE ON outbox FOR EACH ROW EXECUTE FUNCTION refuse_reap();
"""


async def test_a_row_the_database_refuses_to_reap_does_not_keep_every_batch(
    pool: asyncpg.Pool,
) -> None:
    """Row mode reaps one by one when the database refuses one row (reaper._one_by_one,
    tests/test_no_stranded_rows.py). reap_batches was one statement for every expired batch:
    one refused row failed it at every pass, and no batch of any dead relay was ever put
    back (nor were old batches forgotten: forget_batches runs after it). Now the reaper
    reaps batch by batch then, and leaves the refused batch alone, named in its log."""
    await insert(pool, 10)
    a = batch_store(pool, "relay-a")
    first = await a.claim("d", 5)
    second = await a.claim("d", 5)
    assert len(first) == len(second) == 5
    await pool.execute(REFUSE.replace("{id}", str(first[0].id)))
    await expire_batches(pool)
    refused_batch = -first[0].token
    reaper = reaper_module.Reaper(a, 5, {"d": 5}, Metrics(), lambda: None)
    with capture_logs() as logs:
        for _ in range(2):
            await reaper()
    left = await fresh_ids(pool)
    assert not set(left) & {e.id for e in second}, "the other batch's rows were never put back"
    assert set(left) == {e.id for e in first}  # the refused batch's rows stay in flight
    refused = [e for e in logs if e["event"] == "relay.reap.batches_refused"]
    assert len(refused) == 1 and refused[0]["batches"] == [refused_batch]  # then left alone
    ended = await pool.fetch("SELECT id FROM outbox_batches WHERE relay IS NULL ORDER BY id")
    assert [r[0] for r in ended] == [-second[0].token]


# --- 6. Two claims racing ------------------------------------------------------------------


async def test_racing_claims_never_take_a_row_twice(pool: asyncpg.Pool) -> None:
    """Control (passes): claims of 8 relays racing on one destination."""
    await insert(pool, 2000)
    stores = [batch_store(pool, f"relay-{i}") for i in range(4)]
    seen: dict[int, int] = {}
    for _ in range(20):
        results = await asyncio.gather(*(s.claim("d", 50) for s in stores))
        for envs in results:
            for e in envs:
                seen[e.id] = seen.get(e.id, 0) + 1
    assert all(n == 1 for n in seen.values())
