"""The relay end to end: real PostgreSQL, real Kafka-protocol broker, in-process relays."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime

import asyncpg
import pytest
from structlog.testing import capture_logs

import outbox
from outbox.dburl import to_asyncpg_dsn
from relay.app import Relay, RelayStartupError
from relay.maintenance.reporter import Reporter
from relay.tools.localbroker import LocalBroker
from tests.support.kafka import consume
from tests.support.relays import running, settings, status_counts, wait_until
from tests.support.sinks import MemorySink


def topic() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


async def enqueue_n(db_url: str, n: int, destination: str = "orders", **kw: object) -> list[int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            return await outbox.enqueue_many(
                conn,
                [
                    {"destination": destination, "key": f"k{i % 10}", "payload": {"i": i}, **kw}  # type: ignore[typeddict-item]
                    for i in range(n)
                ],
            )
    finally:
        await conn.close()


async def fetch_rows(db_url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        return list(await conn.fetch("SELECT * FROM outbox ORDER BY id"))
    finally:
        await conn.close()


async def test_committed_events_arrive_with_key_headers_and_id(
    db_url: str, kafka_bootstrap: str
) -> None:
    t = topic()
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            kept = await outbox.enqueue(
                conn,
                destination="orders",
                key="order-1",
                payload={"type": "order.created"},
                headers={"event-type": "order.created", "outbox-id": "spoofed"},
            )
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                await outbox.enqueue(conn, destination="orders", payload={"rolled": "back"})
                raise RuntimeError
        async with conn.transaction():
            raw = await outbox.enqueue(conn, destination="orders", payload=b"\x00\xff")
    finally:
        await conn.close()
    async with running(settings(db_url, kafka_bootstrap, topic=t)):
        await wait_until(lambda: _all_delivered(db_url, 2), what="both rows delivered")
    records = await consume(kafka_bootstrap, t, count=2)
    assert len(records) == 2
    by_id = {int(dict(r.headers)["outbox-id"]): r for r in records}
    assert set(by_id) == {kept, raw}
    r = by_id[kept]
    assert r.key == b"order-1"
    assert json.loads(r.value) == {"type": "order.created"}
    headers = dict(r.headers)
    assert headers["event-type"] == b"order.created"
    assert headers["outbox-id"] == str(kept).encode()  # the row's header cannot spoof it
    assert headers["content-type"] == b"application/json"
    assert by_id[raw].value == b"\x00\xff" and by_id[raw].key is None
    rows = await fetch_rows(db_url)
    assert [(x["status"], x["attempts"]) for x in rows] == [("delivered", 1), ("delivered", 1)]
    assert all(x["delivered_at"] is not None and x["locked_by"] is None for x in rows)


async def _all_delivered(db_url: str, n: int) -> bool:
    return (await status_counts(db_url)).get("delivered", 0) == n


async def test_oversize_message_fails_alone(db_url: str, kafka_bootstrap: str) -> None:
    t = topic()
    ids = await enqueue_n(db_url, 5)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            big = await outbox.enqueue(conn, destination="orders", payload=b"x" * 20_000)
    finally:
        await conn.close()
    s = settings(db_url, kafka_bootstrap, topic=t, kafka={"max_request_size": 4096})
    async with running(s):
        await wait_until(lambda: _settled(db_url), what="all rows settled")
    rows = {r["id"]: r for r in await fetch_rows(db_url)}
    assert rows[big]["status"] == "failed"
    assert "MessageSizeTooLarge" in rows[big]["last_error"]
    assert rows[big]["attempts"] == 1  # not retried: retrying cannot help
    assert all(rows[i]["status"] == "delivered" for i in ids)
    records = await consume(kafka_bootstrap, t, count=5)
    assert sorted(int(dict(r.headers)["outbox-id"]) for r in records) == ids


async def _settled(db_url: str) -> bool:
    c = await status_counts(db_url)
    return not c.get("pending") and not c.get("running")


async def test_notify_wakes_an_idle_relay(db_url: str, kafka_bootstrap: str) -> None:
    t = topic()
    s = settings(db_url, kafka_bootstrap, topic=t, relay={"poll_interval": 60})
    async with running(s) as relay:
        assert relay._listener is not None
        await asyncio.wait_for(relay._listener.connected.wait(), 10)
        await asyncio.sleep(0.3)  # the relay has polled once and is now idle
        loop = asyncio.get_running_loop()
        started = loop.time()
        await enqueue_n(db_url, 1)
        await wait_until(lambda: _all_delivered(db_url, 1), timeout=10, interval=0.01)
        elapsed = loop.time() - started
    # Delivered long before the 60 s poll could have found it.
    assert elapsed < 5, elapsed


async def test_three_relays_deliver_each_event_exactly_once(
    db_url: str, kafka_bootstrap: str
) -> None:
    t = topic()
    ids = []
    for _ in range(4):
        ids += await enqueue_n(db_url, 5000)
    s = settings(db_url, kafka_bootstrap, topic=t, relay={"batch_size": 200})
    async with running(s) as a, running(s) as b, running(s) as c:
        await wait_until(lambda: _all_delivered(db_url, 20_000), timeout=90, what="20k delivered")
        claimed = [a.stats["claimed"], b.stats["claimed"], c.stats["claimed"]]
    records = await consume(kafka_bootstrap, t, count=20_000, timeout=60)
    seen = [int(dict(r.headers)["outbox-id"]) for r in records]
    assert len(seen) == 20_000 and sorted(seen) == sorted(ids)  # none missing, none twice
    assert sum(claimed) == 20_000  # no row claimed twice
    assert sum(1 for n in claimed if n > 0) >= 2  # the work really was shared


async def test_unknown_destination_waits_and_is_reported(db_url: str, kafka_bootstrap: str) -> None:
    t = topic()
    await enqueue_n(db_url, 3, destination="nowhere")
    known = await enqueue_n(db_url, 2)
    s = settings(db_url, kafka_bootstrap, topic=t, relay={"report_interval": 0.2})
    with capture_logs() as logs:
        async with running(s):
            await wait_until(lambda: _all_delivered(db_url, 2))
            await wait_until(
                lambda: any(e["event"] == "relay.destination.unknown" for e in logs),
                what="unknown destination reported",
            )
    event = next(e for e in logs if e["event"] == "relay.destination.unknown")
    assert event["destination"] == "nowhere" and event["rows"] == 3
    assert "add [destinations.nowhere]" in event["action"]
    rows = await fetch_rows(db_url)
    assert {r["id"] for r in rows if r["status"] == "delivered"} == set(known)
    assert [r["status"] for r in rows if r["destination"] == "nowhere"] == ["pending"] * 3
    assert all(r["attempts"] == 0 for r in rows if r["destination"] == "nowhere")


async def test_unknown_destination_fail_policy(db_url: str, kafka_bootstrap: str) -> None:
    await enqueue_n(db_url, 2, destination="nowhere")
    # A row some relay already tried is served, maybe by a relay that did not register (one
    # from before the registry, during an upgrade): never failed as unknown.
    (tried,) = await enqueue_n(db_url, 1, destination="elsewhere")
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute("UPDATE outbox SET attempts = 1 WHERE id = $1", tried)
    finally:
        await conn.close()
    s = settings(
        db_url,
        kafka_bootstrap,
        topic=topic(),
        relay={"report_interval": 0.2, "unknown_destinations": "fail", "unknown_grace": 1.0},
    )
    async with running(s):
        await wait_until(lambda: _failed(db_url, 2), what="unknown rows failed")
    rows = [r for r in await fetch_rows(db_url) if r["id"] != tried]
    assert all("unknown destination 'nowhere'" in r["last_error"] for r in rows)
    # Not before the grace period: a relay that serves them may still be starting.
    assert all((r["finished_at"] - r["created_at"]).total_seconds() >= 1.0 for r in rows)
    (spared,) = [r for r in await fetch_rows(db_url) if r["id"] == tried]
    assert spared["status"] == "pending"


async def _failed(db_url: str, n: int) -> bool:
    return (await status_counts(db_url)).get("failed", 0) == n


async def test_broker_outage_backs_off_and_recovers(db_url: str) -> None:
    """Stop the broker with rows in flight: they return to pending with backoff, the relay
    stays up, and everything is delivered once the broker is back."""
    broker = LocalBroker()
    broker.start()
    t = topic()
    s = settings(
        db_url,
        broker.bootstrap,
        topic=t,
        relay={"backoff": {"base": 0.5, "factor": 2, "max": 2, "jitter": 0}},
        kafka={"request_timeout_ms": 1500},
    )
    try:
        with capture_logs() as logs:
            async with running(s) as relay:
                await enqueue_n(db_url, 10)
                await wait_until(lambda: _all_delivered(db_url, 10), what="first 10")
                broker.stop()
                later = await enqueue_n(db_url, 20)
                await wait_until(
                    lambda: _retried(db_url, later), timeout=30, what="rows backing off"
                )
                during = await fetch_rows(db_url)
                broker.start()  # same port; memory storage: the old topic is gone
                await wait_until(
                    lambda: _all_delivered(db_url, 30), timeout=60, what="all 30 delivered"
                )
                assert relay.stats["delivered"] == 30
    finally:
        broker.stop()
    backing_off = [r for r in during if r["id"] in later and r["status"] == "pending"]
    assert backing_off, "no row was sent back to pending during the outage"
    for r in backing_off:
        assert r["attempts"] >= 1 and r["last_error"]
        assert r["run_after"] > r["created_at"]
    events = [e["event"] for e in logs]
    # The outage is logged as a state change, not once per row.
    assert 1 <= events.count("relay.sink.unavailable") <= 5
    assert "relay.sink.recovered" in events
    rows = await fetch_rows(db_url)
    assert all(r["status"] == "delivered" for r in rows)


async def _all_retried(db_url: str, ids: list[int]) -> bool:
    rows = [r for r in await fetch_rows(db_url) if r["id"] in ids]
    return len(rows) == len(ids) and all(
        r["attempts"] >= 1 and r["status"] == "pending" for r in rows
    )


async def _retried(db_url: str, ids: list[int]) -> bool:
    rows = await fetch_rows(db_url)
    return any(r["id"] in ids and r["attempts"] >= 1 and r["status"] == "pending" for r in rows)


async def test_unreachable_broker_spends_no_attempts(db_url: str) -> None:
    """While the producer cannot even connect, rows wait as pending with attempts intact:
    claimed when the circuit lets a probe through, deferred, never charged."""
    from tests.webhook_helpers import closed_port

    s = settings(
        db_url,
        # Held bound for the whole test: a port merely freed may be handed to the other
        # worker's next server, which would then answer.
        f"127.0.0.1:{closed_port()}",
        topic=topic(),
        relay={"max_attempts": 2, "backoff": {"base": 0.1, "jitter": 0}, "poll_interval": 0.1},
    )
    ids = await enqueue_n(db_url, 3)

    async def claimed_and_deferred() -> bool:
        rows = await fetch_rows(db_url)
        return all(r["claims"] >= 1 and r["status"] == "pending" for r in rows)

    # Nothing listens on that port. The circuit opens at start-up; after its cool-down (2 s)
    # the relay claims the rows to probe, and the sink defers them.
    async with running(s) as relay:
        await wait_until(claimed_and_deferred, timeout=15, what="rows claimed and deferred")
        assert relay.stats["deferred"] >= len(ids)
    rows = await fetch_rows(db_url)
    assert all(r["status"] == "pending" and r["attempts"] == 0 for r in rows), [
        (r["status"], r["attempts"]) for r in rows
    ]
    assert all("Kafka unavailable" in r["last_error"] for r in rows)


async def test_dead_side_task_stops_the_relay(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A side task that dies stops the relay (exit 1), and the rows it holds at that moment
    go back to pending, unattempted."""

    class Stuck(MemorySink):
        async def deliver(self, batch):  # type: ignore[no-untyped-def]
            await asyncio.Event().wait()  # never answers: the rows stay held

    ids = await enqueue_n(db_url, 3)
    s = settings(db_url, "127.0.0.1:1", relay={"report_interval": 0.1, "shutdown_timeout": 1})
    relay = Relay(s, sinks={"orders": Stuck()})

    async def broken(self: Reporter) -> None:
        if relay.in_flight:  # only once rows are held
            raise RuntimeError("reporter bug")

    monkeypatch.setattr(Reporter, "__call__", broken)
    with capture_logs() as logs:
        status = await asyncio.wait_for(relay.run(), 30)
    assert status == 1
    crashed = [e for e in logs if e["event"] == "relay.task.crashed"]
    assert crashed and crashed[0]["task"] == "reporter" and "reporter bug" in crashed[0]["error"]
    rows = await fetch_rows(db_url)
    assert [(r["id"], r["status"], r["attempts"], r["claims"]) for r in rows] == [
        (i, "pending", 0, 1) for i in ids
    ]
    released = [e for e in logs if e["event"] == "relay.released"]
    assert released and released[0]["count"] == 3


async def test_startup_without_table_says_migrate(pg_admin_url: str, empty_db_url: str) -> None:
    relay = Relay(settings(empty_db_url, "127.0.0.1:1"))
    with pytest.raises(RelayStartupError, match="outbox-relay migrate"):
        await relay.run()


async def test_startup_with_unreachable_database() -> None:
    s = settings("postgresql://root@127.0.0.1:1/x", "127.0.0.1:1", relay={"startup_timeout": 1})
    with pytest.raises(RelayStartupError, match="cannot reach the database"):
        await Relay(s).run()


async def test_expired_lease_is_reaped_and_redelivered(db_url: str, kafka_bootstrap: str) -> None:
    """Rows held by a relay that vanished go back to pending and are delivered by another."""
    t = topic()
    ids = await enqueue_n(db_url, 4)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(
            "UPDATE outbox SET status = 'running', locked_by = 'ghost', "
            "locked_until = now() - interval '1 second' WHERE id = ANY($1)",
            ids[:2],
        )
    finally:
        await conn.close()
    with capture_logs() as logs:
        async with running(settings(db_url, kafka_bootstrap, topic=t, relay={"lease": 2})):
            await wait_until(lambda: _all_delivered(db_url, 4), what="reaped rows delivered")
    rows = {r["id"]: r for r in await fetch_rows(db_url)}
    assert rows[ids[0]]["attempts"] == 2  # the lost attempt counts
    assert "lease expired: relay ghost" in rows[ids[0]]["last_error"]
    reaped = [e for e in logs if e["event"] == "relay.lease.expired"]
    assert reaped and reaped[0]["first_id"] == ids[0] and reaped[0]["last_id"] == ids[1]
    # Claimed once (the ghost's hold was set by hand), after the reap, by this relay.
    assert [rows[i]["claims"] for i in ids] == [1, 1, 1, 1]


class FlakySink(MemorySink):
    """In-memory sink for the relay's own bookkeeping: fails the first ``fail`` attempts."""

    def __init__(self, fail: int, retry_in: float | None = None) -> None:
        self.fail = fail
        self.retry_in = retry_in
        self.calls: dict[int, int] = {}

    async def deliver(self, batch):  # type: ignore[no-untyped-def]
        from relay.model import Outcome

        out = []
        for env in batch:
            n = self.calls[env.id] = self.calls.get(env.id, 0) + 1
            if n <= self.fail:
                out.append(Outcome.retry(env.id, f"boom {n}", self.retry_in))
            else:
                out.append(Outcome.delivered(env.id))
        return out


async def test_retries_with_backoff_then_fails_after_max_attempts(db_url: str) -> None:
    ids = await enqueue_n(db_url, 3)
    sink = FlakySink(fail=10)
    s = settings(
        db_url,
        "127.0.0.1:1",
        relay={
            "max_attempts": 3,
            "poll_interval": 0.05,
            "backoff": {"base": 0.3, "factor": 2, "jitter": 0},
        },
    )
    async with running(s, sinks={"orders": sink}):
        await wait_until(lambda: _failed(db_url, 3), what="rows failed after 3 attempts")
    rows = await fetch_rows(db_url)
    assert all(r["attempts"] == 3 for r in rows)
    assert all(r["last_error"] == "gave up after 3 attempts: boom 3" for r in rows)
    assert all(sink.calls[i] == 3 for i in ids)


async def test_backoff_and_retry_in_set_run_after(db_url: str) -> None:
    first = await enqueue_n(db_url, 2)
    s = settings(
        db_url,
        "127.0.0.1:1",
        relay={"backoff": {"base": 30, "jitter": 0}, "poll_interval": 0.05},
    )
    async with running(s, sinks={"orders": FlakySink(fail=1)}):
        await wait_until(lambda: _all_retried(db_url, first), what="first failures recorded")
    rows = await fetch_rows(db_url)
    for r in rows:
        assert r["status"] == "pending" and r["attempts"] == 1 and r["last_error"] == "boom 1"
        wait = (r["run_after"] - datetime.now(UTC)).total_seconds()
        assert 25 < wait <= 30, wait  # the backoff's first delay, not an immediate retry
    (later,) = await enqueue_n(db_url, 1)
    async with running(s, sinks={"orders": FlakySink(fail=1, retry_in=120)}):
        await wait_until(lambda: _all_retried(db_url, [later]), what="retry_in honoured")
    (r,) = [x for x in await fetch_rows(db_url) if x["id"] == later]
    assert 110 < (r["run_after"] - datetime.now(UTC)).total_seconds() <= 120


async def test_messages_larger_than_a_producer_batch_are_sent_alone(
    db_url: str, kafka_bootstrap: str
) -> None:
    t = topic()
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            ids = await outbox.enqueue_many(
                conn,
                [
                    {"destination": "orders", "key": "k", "payload": b"y" * size}
                    for size in (10, 5000, 20, 3000, 30)
                ],
            )
    finally:
        await conn.close()
    s = settings(db_url, kafka_bootstrap, topic=t, kafka={"max_batch_size": 1024})
    async with running(s):
        await wait_until(lambda: _all_delivered(db_url, 5), what="all delivered")
    records = await consume(kafka_bootstrap, t, count=5)
    got = {int(dict(r.headers)["outbox-id"]): len(r.value) for r in records}
    assert got == dict(zip(ids, (10, 5000, 20, 3000, 30), strict=True))
    # One key, one partition: the broker keeps them in enqueue order.
    assert [int(dict(r.headers)["outbox-id"]) for r in records] == ids


async def test_rows_with_unsendable_headers_fail_alone(db_url: str, kafka_bootstrap: str) -> None:
    """Rows written with plain SQL skip enqueue()'s checks: a bad one fails by itself, with
    the reason, and its batch neighbours are delivered."""
    t = topic()
    good = await enqueue_n(db_url, 3)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        number, listed = [
            await conn.fetchval(
                "INSERT INTO outbox (destination, payload, headers) "
                "VALUES ('orders', 'x', $1::jsonb) RETURNING id",
                h,
            )
            for h in ('{"n": 5}', "[1, 2]")
        ]
    finally:
        await conn.close()
    async with running(settings(db_url, kafka_bootstrap, topic=t)):
        await wait_until(lambda: _settled(db_url), what="all rows settled")
    rows = {r["id"]: r for r in await fetch_rows(db_url)}
    assert all(rows[i]["status"] == "delivered" for i in good)
    assert (
        rows[number]["status"] == "failed"
        and "header 'n' has a int value" in rows[number]["last_error"]
    )
    assert rows[listed]["status"] == "failed" and "JSON object" in rows[listed]["last_error"]
    records = await consume(kafka_bootstrap, t, count=3)
    assert sorted(int(dict(r.headers)["outbox-id"]) for r in records) == good


async def test_fail_policy_spares_destinations_another_relay_serves(db_url: str) -> None:
    """Relays that split the destinations between them, each with unknown_destinations =
    "fail": a relay fails only rows that no running relay serves, never the other's."""
    from relay.ops import admin

    a_ids = await enqueue_n(db_url, 3, destination="a")
    b_ids = await enqueue_n(db_url, 3, destination="b")
    lost = await enqueue_n(db_url, 2, destination="nowhere")
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        # b's rows wait (paused) while both reporters run, again and again.
        await admin.pause(conn, "public", "b", "test", "hold b")

        def relay_for(dest: str) -> object:
            return settings(
                db_url,
                "127.0.0.1:1",
                relay={
                    "report_interval": 0.2,
                    "unknown_destinations": "fail",
                    "unknown_grace": 1.5,  # both relays have registered by then
                },
                destinations={dest: {"kind": "kafka", "topic": dest}},
            )

        async with (
            running(relay_for("a"), sinks={"a": FlakySink(fail=0)}) as a,  # type: ignore[arg-type]
            running(relay_for("b"), sinks={"b": FlakySink(fail=0)}) as b,  # type: ignore[arg-type]
        ):
            await wait_until(lambda: _failed(db_url, 2), what="unserved rows failed")
            await asyncio.sleep(1.0)  # several more report rounds of both relays
            rows = {r["id"]: r for r in await fetch_rows(db_url)}
            assert all(rows[i]["status"] == "failed" for i in lost)
            assert "no running relay serves it" in rows[lost[0]]["last_error"]
            assert all(rows[i]["status"] == "delivered" for i in a_ids)
            assert all(rows[i]["status"] == "pending" and rows[i]["attempts"] == 0 for i in b_ids)
            await admin.resume(conn, "public", "b")
            await wait_until(lambda: _all_delivered(db_url, 6), what="b delivered after resume")
            status = await admin.status(conn, "public")
            serving = {r["relay_id"]: r["destinations"] for r in status["relays"]}
            assert serving == {a.id: ["a"], b.id: ["b"]}
            assert {r["state"] for r in status["relays"]} == {"running"}
        stopped = await admin.status(conn, "public")
        assert {r["state"] for r in stopped["relays"]} == {"stopped"}
    finally:
        await conn.close()


async def test_startup_survives_connections_killed_while_it_starts(db_url: str) -> None:
    """A database restarting while the relay starts (its connections killed during the table
    check, the paused-destination read or the registration) is waited out, not a crash."""
    s = settings(db_url, "127.0.0.1:1", relay={"relay_id": "starting", "startup_timeout": 30})
    admin = await asyncpg.connect(to_asyncpg_dsn(db_url))
    stop = asyncio.Event()

    async def storm() -> int:
        killed = 0
        while not stop.is_set():
            killed += await admin.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = 'outbox-relay:starting'"
            )
            await asyncio.sleep(0.001)
        return killed

    killing = asyncio.create_task(storm())
    try:
        with capture_logs() as logs:
            relay = Relay(s, sinks={"orders": FlakySink(fail=0)})
            task = asyncio.create_task(relay.run())
            await asyncio.sleep(1.5)
            stop.set()
            killed = await killing
            await asyncio.wait_for(relay.started.wait(), 30)
            relay.stop()
            assert await asyncio.wait_for(task, 30) == 0
    finally:
        stop.set()
        await admin.close()
    assert killed > 0
    assert any(e["event"] == "relay.database.unavailable" for e in logs)


async def test_a_statement_timeout_at_startup_is_named_for_what_it_is(db_url: str) -> None:
    blocker = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await blocker.execute(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET statement_timeout = 300', "
            "current_database()); END $$"
        )
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("LOCK TABLE outbox_paused IN ACCESS EXCLUSIVE MODE")
        s = settings(db_url, "127.0.0.1:1", relay={"startup_timeout": 5})
        with pytest.raises(RelayStartupError) as err:
            await Relay(s, sinks={"orders": FlakySink(fail=0)}).run()
        await tx.rollback()
    finally:
        await blocker.close()
    message = str(err.value)
    assert "statement_timeout" in message and "QueryCanceledError" in message
    assert "grant" not in message.lower() and "relay_role.sql" not in message


async def test_startup_waits_out_a_database_out_of_connections(db_url: str) -> None:
    """ "Too many connections" (or "the database system is starting up") at start-up is waited
    out for startup_timeout, like an unreachable database, not a reason to give up at once."""
    import psycopg

    from tests.test_relay_role import apply_role_sql, as_user

    role = f"relay_{uuid.uuid4().hex[:10]}"
    apply_role_sql(db_url, role)
    try:
        with psycopg.connect(db_url, autocommit=True) as c:
            c.execute(f'ALTER ROLE "{role}" CONNECTION LIMIT 0')
        s = settings(
            as_user(db_url, role, "s3cret"),
            "127.0.0.1:1",
            relay={"startup_timeout": 30, "pool_size": 2},
        )
        with capture_logs() as logs:
            relay = Relay(s, sinks={"orders": FlakySink(fail=0)})
            task = asyncio.create_task(relay.run())
            await wait_until(
                lambda: any(e["event"] == "relay.database.unavailable" for e in logs),
                what="refused for now",
            )
            assert not task.done()
            with psycopg.connect(db_url, autocommit=True) as c:
                c.execute(f'ALTER ROLE "{role}" CONNECTION LIMIT -1')
            await asyncio.wait_for(relay.started.wait(), 30)
            relay.stop()
            assert await asyncio.wait_for(task, 30) == 0
        refused = next(e for e in logs if e["event"] == "relay.database.unavailable")
        assert "TooManyConnectionsError" in refused["error"]
    finally:
        with psycopg.connect(db_url, autocommit=True) as c:
            c.execute(f'DROP OWNED BY "{role}"')
            c.execute(f'DROP ROLE IF EXISTS "{role}"')


async def test_startup_waits_out_a_read_only_database(db_url: str) -> None:
    """A failover makes the database read-only for a moment: a relay starting then waits
    (within startup_timeout) instead of exiting."""
    admin = await asyncpg.connect(to_asyncpg_dsn(db_url))

    async def read_only(on: bool) -> None:
        await admin.execute(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET default_transaction_read_only = "
            + ("on" if on else "off")
            + "', current_database()); END $$"
        )

    try:
        await read_only(True)
        s = settings(db_url, "127.0.0.1:1", relay={"startup_timeout": 30})
        with capture_logs() as logs:
            relay = Relay(s, sinks={"orders": FlakySink(fail=0)})
            task = asyncio.create_task(relay.run())
            await wait_until(
                lambda: any(e["event"] == "relay.database.unavailable" for e in logs),
                what="waiting",
            )
            assert not task.done()
            await read_only(False)
            await asyncio.wait_for(relay.started.wait(), 30)
            relay.stop()
            assert await asyncio.wait_for(task, 30) == 0
    finally:
        await read_only(False)
        await admin.close()
    waiting = next(e for e in logs if e["event"] == "relay.database.unavailable")
    assert "ReadOnlySQLTransactionError" in waiting["error"]
