"""Fencing tokens: a relay that stalled past its lease never sends a row another relay has
taken over, and never records an outcome over a newer claim of the row."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from structlog.testing import capture_logs

import outbox
from outbox.dburl import to_asyncpg_dsn
from relay.db.store import Record, Store, create_pool
from relay.pipeline.ordered import Mode, Ownership
from tests.support.proxy import StallProxy
from tests.support.receiver import Receiver
from tests.support.relays import running, settings, wait_until
from tests.webhook_helpers import new_secret

LEASE = 2.0


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[Store]:
    pool = await create_pool(to_asyncpg_dsn(db_url), "same", 4)
    try:
        yield Store(pool, "public", "same", LEASE)
    finally:
        await pool.close()


async def execute(db_url: str, sql: str, *args: Any) -> Any:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


async def add(db_url: str, n: int, key: str | None = None, destination: str = "hook") -> list[int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            return await outbox.enqueue_many(
                conn,
                [{"destination": destination, "key": key, "payload": {"n": i}} for i in range(n)],
            )
    finally:
        await conn.close()


async def test_outcome_heartbeat_and_release_apply_only_under_their_claim(
    db_url: str, store: Store
) -> None:
    """The same relay claims a row twice (its first lease expired and was reaped): what it
    writes for the first claim is refused, what it writes for the second applies."""
    (row,) = await add(db_url, 1)
    (first,) = await store.claim("hook", 10)
    await execute(db_url, "UPDATE outbox SET locked_until = now() - interval '1 s'")
    reaped = await store.reap(25, {})
    assert [r["id"] for r in reaped] == [row]
    (second,) = await store.claim("hook", 10)
    assert (first.id, first.token, second.token) == (row, 1, 2)

    assert await store.heartbeat([(row, first.token)]) == set()
    assert await store.heartbeat([(row, second.token)]) == {row}
    stale = Record(row, first.token, "pending", 1, 60.0, "stale retry", "hook")
    assert await store.record([stale]) == set()
    await store.release([(row, first.token)])
    (state,) = await execute(db_url, "SELECT status, claims, last_error FROM outbox")
    assert (state["status"], state["claims"]) == ("running", 2)  # the newer claim holds it
    fresh = Record(row, second.token, "delivered", 1, 0.0, None, "hook")
    assert await store.record([fresh]) == {(row, 2)}
    (state,) = await execute(db_url, "SELECT status, claims, finished_at FROM outbox")
    assert state["status"] == "delivered" and state["finished_at"] is not None


def hook(receiver: Receiver, **kw: Any) -> dict[str, Any]:
    return {
        "kind": "webhook",
        "url": receiver.url + "/in",
        "secrets": [new_secret()],
        "allow_private_networks": True,
        "max_concurrency": 4,
        **kw,
    }


def hook_settings(db_url: str, receiver: Receiver, relay_id: str, **kw: Any) -> Any:
    relay = {"lease": LEASE, "poll_interval": 0.1, "relay_id": relay_id, **kw.pop("relay", {})}
    return settings(db_url, "127.0.0.1:1", relay=relay, destinations={"hook": hook(receiver, **kw)})


def webhook_ids(receiver: Receiver) -> list[int]:
    return [int(r.headers["webhook-id"]) for r in receiver.requests]


async def test_stalled_relay_never_records_over_a_newer_claim(
    db_url: str, receiver: Receiver
) -> None:
    """Relay A sends a row, then its database connection hangs (all traffic stalled) for
    longer than the lease. A replacement under the same relay id (a pod restarted while the
    old one was frozen) reaps the row and sends it again. A's late "retry" outcome must not
    land on the replacement's claim: the row ends delivered, by the replacement's outcome."""
    proxy = await StallProxy.for_url(db_url).start()
    receiver.respond(500, delay=3.0, times=1)  # A's attempt: answered late, with an error
    receiver.respond(200, delay=4.0, times=1)  # the replacement's: answered after A's
    backoff = {"backoff": {"schedule": [600]}}  # a retry recorded by A would wait 10 minutes
    stalled = hook_settings(proxy.url(db_url), receiver, "pod-1", **backoff)
    replacement = hook_settings(db_url, receiver, "pod-1", **backoff)
    try:
        with capture_logs() as logs:
            async with running(stalled) as a:
                (row,) = await add(db_url, 1)
                await asyncio.to_thread(receiver.wait_for, 1)
                proxy.stall()
                try:
                    async with running(replacement):
                        await asyncio.to_thread(receiver.wait_for, 2, LEASE + 5)
                        # A's answer (500) comes while the replacement's attempt is in flight.
                        await asyncio.to_thread(
                            receiver.wait_until, lambda rs: rs[0].done is not None, 10
                        )
                        assert receiver.requests[1].done is None
                        proxy.resume()
                        await wait_until(lambda: _lost(a), timeout=10, what="A notices")
                        await wait_until(
                            lambda: _delivered(db_url, row), timeout=15, what="delivered"
                        )
                finally:
                    proxy.resume()  # whatever happened, A can stop
    finally:
        await proxy.close()
    (state,) = await execute(db_url, "SELECT status, attempts, claims, last_error FROM outbox")
    assert state["status"] == "delivered" and state["claims"] == 2
    assert webhook_ids(receiver) == [row, row]
    lost = [e for e in logs if e["event"] == "relay.lease.lost"]
    assert lost and all(row in e["ids"] for e in lost)


def _lost(relay: Any) -> bool:
    return bool(relay.stats["lease_lost"])


async def _delivered(db_url: str, row: int) -> bool:
    rows = await execute(db_url, "SELECT status FROM outbox WHERE id = $1", row)
    return bool(rows) and rows[0]["status"] == "delivered"


@pytest.mark.parametrize("claim", ["walk", "owner"])
async def test_stalled_ordered_claim_never_sends_a_late_copy(
    db_url: str, receiver: Receiver, claim: str
) -> None:
    """Relay A's claim of event N commits, but the answer reaches A only after its lease
    expired (the connection hung after the commit). Meanwhile B reaps N and delivers N and
    N+1. A must not send its late copy of N after N+1.

    walk: B is a relay of an earlier release (it walks the keys whoever owns the
    destination), and A, its owner, walks them too. owner: A owns the destination, and B
    takes it over once A's connection that holds it ends (a server that ends a session it
    found dead)."""
    if claim == "walk":
        await execute(
            db_url,
            "INSERT INTO outbox_relays (relay_id, destinations) VALUES ('before', '{hook}')",
        )
    ordered = {"ordering": "key"}
    a_settings = hook_settings(db_url, receiver, "relay-a", **ordered)
    b_settings = hook_settings(db_url, receiver, "relay-b", **ordered)
    with capture_logs() as logs:
        async with running(a_settings) as a:
            gate, stalled = asyncio.Event(), asyncio.Event()
            name = "claim_ordered" if claim == "walk" else "claim_owned"
            real = getattr(a.store, name)

            async def hanging_answer(*args: Any) -> Any:
                rows, more = await real(*args)
                if rows and not gate.is_set():
                    stalled.set()
                    await gate.wait()  # the claim committed; its answer is late
                return rows, more

            setattr(a.store, name, hanging_answer)
            n, n1 = await add(db_url, 2, key="k")
            await asyncio.wait_for(stalled.wait(), 10)
            if claim == "owner":
                owner_pid = a.store.owner.conn.get_server_pid()
                await execute(db_url, "SELECT pg_terminate_backend($1)", owner_pid)
            async with running(b_settings) as b:
                if claim == "walk":

                    async def earlier_release(destination: str) -> Ownership:
                        return Ownership(mode=Mode.WALK)

                    b.claimer._ownership = earlier_release
                await asyncio.to_thread(receiver.wait_for, 2, LEASE + 10)
                await wait_until(lambda: _delivered(db_url, n1), timeout=10, what="B done")
            gate.set()
            await wait_until(lambda: _lost(a), timeout=5, what="A notices")
            await asyncio.sleep(1.0)  # room for a late copy to arrive
    assert webhook_ids(receiver) == [n, n1]
    lost = [e for e in logs if e["event"] == "relay.lease.lost"]
    assert lost and n in lost[0]["ids"]
    states = await execute(db_url, "SELECT id, status, claims FROM outbox ORDER BY id")
    assert [(r["status"], r["claims"]) for r in states] == [("delivered", 2), ("delivered", 1)]
    bodies = [json.loads(r.body) for r in receiver.requests]
    assert bodies == [{"n": 0}, {"n": 1}]


async def test_the_fault_suites_witness_counts_outcomes_over_another_claim(
    db_url: str, store: Store
) -> None:
    """The audit trigger the fault suite counts overwrites with (tests/support/faults.py)
    sees them, and does not mistake legitimate changes for them."""
    from tests.support.faults import fetchval, install_audit

    await install_audit(db_url)
    await add(db_url, 4)
    held = await store.claim("hook", 10)
    a, b, c, d = held
    assert await store.record([Record(a.id, a.token, "delivered", 1, 0.0, None, "hook")])
    await store.release([(b.id, b.token)])

    async def count() -> int:
        return int(await fetchval(db_url, "SELECT count(*) FROM outbox_overwrites"))

    assert await count() == 0  # the holder's own outcome and release
    intruder = await asyncpg.connect(
        to_asyncpg_dsn(db_url), server_settings={"application_name": "outbox-relay:intruder"}
    )
    try:
        # Another relay writes an outcome over a live claim: counted.
        await intruder.execute(
            "UPDATE outbox SET status = 'delivered', locked_by = NULL WHERE id = $1", c.id
        )
        assert await count() == 1
        # An outcome carrying an older claim's token: counted.
        await execute(
            db_url,
            "UPDATE outbox SET status = 'pending', claims = claims - 1, locked_by = NULL "
            "WHERE id = $1",
            d.id,
        )
        assert await count() == 2
        # Another relay reaping an expired lease: legitimate.
        e, *_ = await store.claim("hook", 10)
        await execute(db_url, "UPDATE outbox SET locked_until = now() - interval '1 s'")
        await intruder.execute(
            "UPDATE outbox SET status = 'pending', locked_by = NULL WHERE id = $1", e.id
        )
        assert await count() == 2
    finally:
        await intruder.close()


async def test_the_fault_suites_witness_sees_deliveries_too(db_url: str, store: Store) -> None:
    """The same witness on outbox_deliveries, whose outcomes leave `claims` alone: the
    holder's own outcome (DELIVERY_RECORD) is legitimate, another relay's over a live claim is
    counted; a reap of an expired lease (DELIVERY_REAP) is legitimate, and kept as an expiry."""
    from relay.sinks.endpoints.store import DeliveryRecord, DeliveryStore
    from tests.support.faults import fetchval, install_audit

    await install_audit(db_url)
    deliveries = DeliveryStore(store)
    # Three deliveries as DELIVERY_CLAIM leaves them, held by this relay ("same").
    rows = await execute(
        db_url,
        "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, status, locked_by, "
        "locked_until, claims) SELECT g, 1, 'hook', 'running', 'same', "
        "now() + interval '1 minute', 1 FROM generate_series(1, 3) AS g RETURNING id",
    )
    a, b, c = sorted(r["id"] for r in rows)

    async def count(table: str) -> int:
        return int(await fetchval(db_url, f"SELECT count(*) FROM {table}"))

    done = DeliveryRecord(
        id=a,
        token=1,
        status="delivered",
        counted=1,
        delay=0.0,
        error=None,
        http_status=200,
        event_id=1,
        endpoint_id=1,
        duration_ms=5.0,
    )
    assert await deliveries.record([done]) == {(a, 1)}
    assert await count("outbox_overwrites") == 0
    intruder = await asyncpg.connect(
        to_asyncpg_dsn(db_url), server_settings={"application_name": "outbox-relay:intruder"}
    )
    try:
        await intruder.execute(
            "UPDATE outbox_deliveries SET status = 'delivered', locked_by = NULL WHERE id = $1",
            b,
        )
        (over,) = await execute(db_url, "SELECT tbl, id, written_by FROM outbox_overwrites")
        assert dict(over) == {
            "tbl": "outbox_deliveries",
            "id": b,
            "written_by": "outbox-relay:intruder",
        }
    finally:
        await intruder.close()
    assert await count("outbox_expiries") == 0
    await execute(db_url, "UPDATE outbox_deliveries SET locked_until = now() - interval '1 s'")
    assert await deliveries.reap(25, {}) == 1
    assert await count("outbox_overwrites") == 1
    (expiry,) = await execute(db_url, "SELECT tbl, id, new_status FROM outbox_expiries")
    assert dict(expiry) == {"tbl": "outbox_deliveries", "id": c, "new_status": "pending"}


async def test_the_kafka_sink_does_not_send_a_row_whose_lease_ran_out(
    kafka_bootstrap: str,
) -> None:
    import time
    import uuid

    from relay.model import Envelope, Lease, Result
    from relay.sinks.kafka.config import KafkaDestination, KafkaSettings
    from relay.sinks.kafka.sink import KafkaSink
    from tests.support.kafka import consume, outbox_id

    topic = f"lease-{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(
        KafkaSettings(bootstrap_servers=kafka_bootstrap, enable_idempotence=False),
        {"orders": KafkaDestination(kind="kafka", topic=topic)},
    )
    await sink.start()

    def env(i: int, until: float) -> Envelope:
        return Envelope(i, "orders", None, b"{}", "x", {}, 0, time.time(), 1, Lease(until))

    try:
        outcomes = {
            o.id: o.result
            for o in await sink.deliver(
                [env(1, time.monotonic() + 60), env(2, time.monotonic() - 1)]
            )
        }
    finally:
        await sink.close()
    assert outcomes == {1: Result.DELIVERED, 2: Result.DEFER}
    sent = await consume(kafka_bootstrap, topic, count=2, timeout=3)
    assert [outbox_id(r) for r in sent] == [1]


async def test_outcomes_that_delete_apply_only_under_their_claim(db_url: str) -> None:
    """retention = 0: a delivered outcome deletes its row, and only under its claim's token;
    the fault suite's witness sees a delete by any other session."""
    from tests.support.faults import fetchval, install_audit

    await install_audit(db_url)
    pool = await create_pool(to_asyncpg_dsn(db_url), "same", 2)
    try:
        store = Store(pool, "public", "same", LEASE, delete_delivered=True)
        (row,) = await add(db_url, 1)
        (first,) = await store.claim("hook", 10)
        await execute(db_url, "UPDATE outbox SET locked_until = now() - interval '1 s'")
        await store.reap(25, {})
        (second,) = await store.claim("hook", 10)
        stale = Record(row, first.token, "delivered", 1, 0.0, None, "hook")
        assert await store.record([stale]) == set()
        assert await execute(db_url, "SELECT status FROM outbox") != []  # not deleted
        fresh = Record(row, second.token, "delivered", 1, 0.0, None, "hook")
        assert await store.record([fresh]) == {(row, 2)}
        assert await execute(db_url, "SELECT status FROM outbox") == []
        assert await fetchval(db_url, "SELECT count(*) FROM outbox_overwrites") == 0
        (other,) = await add(db_url, 1)
        await store.claim("hook", 10)
        await execute(db_url, "DELETE FROM outbox WHERE id = $1", other)  # not the holder
        assert await fetchval(db_url, "SELECT count(*) FROM outbox_overwrites") == 1
    finally:
        await pool.close()


@pytest.mark.parametrize("delete_delivered", [False, True])
async def test_a_batch_of_plain_deliveries_is_recorded_as_any_other(
    db_url: str, delete_delivered: bool
) -> None:
    """Store.record writes a batch of plain deliveries with a statement of its own (only the
    ids and tokens travel): the rows end exactly as the general statement leaves them, and a
    stale token is refused the same way."""
    from relay.db import queries

    pool = await create_pool(to_asyncpg_dsn(db_url), "same", 2)
    try:
        store = Store(pool, "public", "same", LEASE, delete_delivered=delete_delivered)
        await add(db_url, 3, destination="fast")
        await add(db_url, 3, destination="general")
        await execute(db_url, "UPDATE outbox SET last_error = 'earlier', attempts = 2")
        fast = await store.claim("fast", 10)
        general = await store.claim("general", 10)

        def plain(envs: list[Any], stale: bool = False) -> list[Record]:
            return [
                Record(e.id, e.token + (1 if stale and i == 0 else 0), "delivered", 1, 0.0, None)
                for i, e in enumerate(envs)
            ]

        written = await store.record(plain(fast, stale=True))
        assert store.statements["record"] == store.statements["record_delivered"] == 1
        assert written == {(e.id, e.token) for e in fast[1:]}
        sql = queries.RECORD_DELETING if delete_delivered else queries.RECORD
        recs = plain(general, stale=True)
        args: list[Any] = [
            [r.id for r in recs],
            [r.token for r in recs],
            [str(r.status) for r in recs],
            [r.counted for r in recs],
            [r.delay for r in recs],
            [r.error for r in recs],
            "same",
        ]
        if delete_delivered:
            args += [[r.id for r in recs], [r.token for r in recs]]
        got = await execute(db_url, queries.render_ops(sql, "public"), *args)
        assert {(r[0], r[1]) for r in got} == {(e.id, e.token) for e in general[1:]}

        rows = await execute(
            db_url,
            "SELECT destination, status, attempts, last_error, delivered_at IS NOT NULL, "
            "finished_at IS NOT NULL, locked_by, locked_until IS NULL, claims, "
            "run_after = created_at FROM outbox ORDER BY id",
        )
        by_dest: dict[str, list[tuple[Any, ...]]] = {"fast": [], "general": []}
        for r in rows:
            by_dest[r[0]].append(tuple(r)[1:])
        assert by_dest["fast"] == by_dest["general"]
        # The stale one is still running under its claim; the others delivered or deleted.
        assert by_dest["fast"][0][0] == "running"
        kept = 1 if delete_delivered else 3
        assert len(by_dest["fast"]) == kept
        if not delete_delivered:
            assert by_dest["fast"][1] == (
                "delivered",
                3,
                "earlier",
                True,
                True,
                None,
                True,
                1,
                True,
            )
    finally:
        await pool.close()


async def test_an_empty_error_text_is_written_as_given(db_url: str) -> None:
    """Only outcomes without any error text take the short statement for plain deliveries
    (which leaves last_error as it was); an empty text is written as the general one does."""
    pool = await create_pool(to_asyncpg_dsn(db_url), "same", 2)
    try:
        store = Store(pool, "public", "same", LEASE)
        (row,) = await add(db_url, 1)
        await execute(db_url, "UPDATE outbox SET last_error = 'earlier'")
        (env,) = await store.claim("hook", 10)
        assert await store.record([Record(row, env.token, "delivered", 1, 0.0, "")]) == {(row, 1)}
        assert store.statements["record_delivered"] == 0
        [got] = await execute(db_url, "SELECT status, last_error FROM outbox")
        assert tuple(got) == ("delivered", "")
    finally:
        await pool.close()
