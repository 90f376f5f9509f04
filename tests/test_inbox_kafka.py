"""Kafka consumers with the inbox (outbox.inbox.kafka), against the Tansu broker and a real
database: every event delivered three times, in shuffled order, with crashes between the
business write and the offset commit, is applied exactly once.

Restarts resume from the offsets committed to a consumer group. Most tests join no group
(``assign()`` with a ``group_id``: commits and committed offsets work at once); one test
``subscribe``s for real and pays the broker's group joins (about 9 s in all, bounded at 60 s).
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from sqlalchemy import text
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

import outbox
from outbox import OutboxError
from outbox.dburl import to_asyncpg_dsn, to_sqlalchemy_async_url
from outbox.inbox.kafka import KafkaInbox, MissingEventId, read_event_id
from tests.support.relays import running, settings, status_counts, wait_until

PARTITIONS = 4


class Crash(Exception):
    """The process dies here."""


class Crashing:
    """A consumer whose ``at``-th offset commit dies instead: a process killed after the
    database committed and before Kafka recorded the offsets."""

    def __init__(self, consumer: AIOKafkaConsumer, at: int | None) -> None:
        self._consumer = consumer
        self._at = at
        self.commits = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)

    async def commit(self, offsets: Any = None) -> None:
        self.commits += 1
        if self.commits == self._at:
            raise Crash(f"killed before offset commit {self.commits}")
        await self._consumer.commit(offsets)


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    e = create_async_engine(to_sqlalchemy_async_url(db_url))
    async with e.begin() as c:
        await c.execute(text("CREATE TABLE effects (event_id text NOT NULL, amount int NOT NULL)"))
        await c.execute(text("CREATE TABLE balance (total int NOT NULL)"))
        await c.execute(text("INSERT INTO balance VALUES (0)"))
    yield e
    await e.dispose()


async def produce(
    bootstrap: str, topic: str, records: list[tuple[int, list[tuple[str, bytes]], bytes]]
) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=False)
    await producer.start()
    try:
        for partition, headers, value in records:
            await producer.send_and_wait(topic, value, headers=headers, partition=partition)
    finally:
        await producer.stop()


def consumer(bootstrap: str, group: str) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )


async def effects(engine: AsyncEngine) -> tuple[list[tuple[str, int]], int]:
    async with engine.connect() as c:
        rows = (await c.execute(text("SELECT event_id, amount FROM effects ORDER BY 1"))).all()
        total = (await c.execute(text("SELECT total FROM balance"))).scalar_one()
    return [(r[0], r[1]) for r in rows], total


async def committed(bootstrap: str, group: str, tps: list[TopicPartition]) -> dict[int, int]:
    c = consumer(bootstrap, group)
    await c.start()
    try:
        return {tp.partition: await c.committed(tp) for tp in tps}
    finally:
        await c.stop()


async def ends(bootstrap: str, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await c.start()
    try:
        return dict(await c.end_offsets(tps))
    finally:
        await c.stop()


async def test_each_event_thrice_shuffled_with_crashes_is_applied_once(
    kafka_bootstrap: str, engine: AsyncEngine
) -> None:
    topic, group = f"inbox-{uuid.uuid4().hex[:8]}", f"billing-{uuid.uuid4().hex[:8]}"
    events = {str(1000 + i): i + 1 for i in range(40)}
    copies = [eid for eid in events for _ in range(3)]
    rng = random.Random(18)
    rng.shuffle(copies)
    await produce(
        kafka_bootstrap,
        topic,
        [
            (
                rng.randrange(PARTITIONS),
                [("outbox-id", eid.encode())],
                json.dumps({"amount": events[eid]}).encode(),
            )
            for eid in copies
        ],
    )
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
    end = await ends(kafka_bootstrap, tps)
    assert sum(end.values()) == 120

    calls = 0
    crash_in_handler_at: int | None = None
    crashed: Any = None

    async def handle(record: Any, tx: Any) -> None:
        nonlocal calls, crashed
        amount = json.loads(record.value)["amount"]
        await tx.execute(
            text("INSERT INTO effects VALUES (:e, :a)"), {"e": read_event_id(record), "a": amount}
        )
        await tx.execute(text("UPDATE balance SET total = total + :a"), {"a": amount})
        calls += 1
        if calls == crash_in_handler_at:
            crashed = record
            raise Crash("killed after the business write, before the database commit")

    async def life(crash_commit_at: int | None) -> tuple[str, KafkaInbox]:
        """One run of the consumer process, from the group's committed offsets."""
        c = consumer(kafka_bootstrap, group)
        await c.start()
        inbox = KafkaInbox(
            Crashing(c, crash_commit_at), engine, handle, name="billing", max_records=7
        )  # type: ignore[arg-type]
        try:
            c.assign(tps)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                await inbox.poll()
                if all([await c.position(tp) == end[tp] for tp in tps]):
                    return "done", inbox
            raise TimeoutError("the consumer did not reach the end of the topic")
        except Crash as exc:
            return str(exc), inbox
        finally:
            await c.stop()

    crash_in_handler_at = 5
    outcome, first = await life(None)
    assert outcome.startswith("killed after the business write"), outcome
    assert first.counts.applied == 4
    # Not committed past the record whose transaction rolled back: it is read again.
    offsets = await committed(kafka_bootstrap, group, tps)
    assert (offsets[crashed.partition] or 0) <= crashed.offset, (offsets, crashed.offset)
    crash_in_handler_at = None
    outcomes = [await life(crash_commit_at=at) for at in (2, 1, None)]
    assert [o for o, _ in outcomes] == [
        "killed before offset commit 2",
        "killed before offset commit 1",
        "done",
    ]
    lives = [first, *(i for _, i in outcomes)]

    got, total = await effects(engine)
    assert got == sorted(events.items())  # each event's effect exactly once
    assert total == sum(events.values())
    assert sum(i.counts.applied for i in lives) == 40
    # 80 copies were duplicates anyway; the crashes made records be read again on top.
    duplicates = sum(i.counts.duplicates for i in lives)
    assert duplicates > 80, duplicates
    assert await committed(kafka_bootstrap, group, tps) == {tp.partition: end[tp] for tp in tps}


@pytest.mark.timeout(60)
async def test_a_consumer_group_resumes_from_its_committed_offsets(
    kafka_bootstrap: str, engine: AsyncEngine
) -> None:
    """With ``subscribe`` and real group joins: about 2 s, then 7 s for the rejoin after the
    crashed member, on the test broker (bounded at 60 s)."""
    topic, group = f"inbox-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    records = [
        (i % PARTITIONS, [("outbox-id", str(i % 10).encode())], b'{"amount": 1}') for i in range(20)
    ]
    await produce(kafka_bootstrap, topic, records)
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
    end = await ends(kafka_bootstrap, tps)

    async def handle(record: Any, tx: Any) -> None:
        await tx.execute(text("INSERT INTO effects VALUES (:e, 1)"), {"e": read_event_id(record)})

    async def life(crash_commit_at: int | None) -> str:
        c = AIOKafkaConsumer(
            topic,
            bootstrap_servers=kafka_bootstrap,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            # The test broker's join waits on the session timeout (about half of it for a
            # first join; a rejoin after a member left, nearly twice it): 3 s, not 10.
            session_timeout_ms=3000,
            heartbeat_interval_ms=1000,
        )
        await c.start()
        inbox = KafkaInbox(Crashing(c, crash_commit_at), engine, handle, name="g")  # type: ignore[arg-type]
        try:
            deadline = time.monotonic() + 25
            while time.monotonic() < deadline:
                await inbox.poll()
                mine = c.assignment()
                if mine and all([await c.position(tp) == end[tp] for tp in mine]):
                    return "done"
            raise TimeoutError("the group consumer did not reach the end of the topic")
        except Crash as exc:
            return str(exc)
        finally:
            await c.stop()

    assert await life(crash_commit_at=1) == "killed before offset commit 1"
    assert await life(None) == "done"
    got, _ = await effects(engine)
    assert got == [(str(i), 1) for i in range(10)]
    assert await committed(kafka_bootstrap, group, tps) == {tp.partition: end[tp] for tp in tps}


async def test_events_relayed_twice_by_the_relay_are_applied_once(
    kafka_bootstrap: str, db_url: str
) -> None:
    """Real events through the relay, every one delivered twice (put back to pending after
    delivery, as a relay that died before recording would), consumed with an asyncpg pool."""
    topic, group = f"inbox-relay-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute("CREATE TABLE effects (event_id text NOT NULL, amount int NOT NULL)")
        async with conn.transaction():
            ids = await outbox.enqueue_many(
                conn, [{"destination": "orders", "payload": {"amount": i}} for i in range(20)]
            )
        s = settings(db_url, kafka_bootstrap, topic=topic)
        async with running(s):
            await wait_until(lambda: _delivered(db_url, 20), what="delivered once")
            await conn.execute("UPDATE outbox SET status = 'pending', run_after = now()")
            await wait_until(lambda: _delivered(db_url, 20), what="delivered again")

        pool = await asyncpg.create_pool(to_asyncpg_dsn(db_url), min_size=1, max_size=2)

        async def handle(record: Any, tx: asyncpg.Connection) -> None:
            await tx.execute(
                "INSERT INTO effects VALUES ($1, $2)",
                read_event_id(record),
                json.loads(record.value)["amount"],
            )

        c = consumer(kafka_bootstrap, group)
        await c.start()
        try:
            inbox = KafkaInbox(c, pool, handle, name="billing")
            c.assign(await partitions(c, topic))

            async def read_all() -> bool:
                # Counted, not compared with end_offsets: the test broker's "latest offset"
                # counts record batches, and the relay sends many records per batch.
                await inbox.poll()
                return inbox.counts.applied + inbox.counts.duplicates >= 40

            await wait_until(read_all, what="all 40 copies read")
        finally:
            await c.stop()
            await pool.close()
        rows = await conn.fetch("SELECT event_id, amount FROM effects ORDER BY event_id::bigint")
    finally:
        await conn.close()
    assert [(r[0], r[1]) for r in rows] == [(str(i), n) for n, i in enumerate(ids)]
    assert (inbox.counts.applied, inbox.counts.duplicates) == (20, 20)


async def partitions(c: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    async def known() -> set[int] | None:
        await c.topics()  # refreshes the metadata
        return c.partitions_for_topic(topic)

    found = await wait_until(known, what=f"partitions of {topic}")
    return [TopicPartition(topic, p) for p in sorted(found)]


async def _delivered(db_url: str, n: int) -> bool:
    return (await status_counts(db_url)).get("delivered", 0) == n


async def test_a_record_without_an_id_stops_the_consumer_or_is_skipped(
    kafka_bootstrap: str, engine: AsyncEngine
) -> None:
    """``ce_id`` (CloudEvents binary mode) counts as an id; a record with neither stops the
    consumer at that record by default, with what came before it applied and committed."""
    topic, group = f"inbox-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    await produce(
        kafka_bootstrap,
        topic,
        [
            (0, [("outbox-id", b"1")], b"a"),
            (0, [("other", b"x")], b"no id"),
            (0, [("ce_id", b"ce-1")], b"b"),
            (0, [("outbox-id", b"1")], b"a again"),
            (0, [("ce_id", b"ce-1"), ("ce_source", b"/orders")], b"b again"),
        ],
    )
    tp = TopicPartition(topic, 0)
    sessions = async_sessionmaker(engine)
    seen: list[bytes] = []

    async def handle(record: Any, session: AsyncSession) -> None:
        assert isinstance(session, AsyncSession) and session.in_transaction()
        seen.append(record.value)
        await session.execute(
            text("INSERT INTO effects VALUES (:e, 1)"), {"e": read_event_id(record)}
        )

    c = consumer(kafka_bootstrap, group)
    await c.start()
    try:
        c.assign([tp])
        strict = KafkaInbox(c, sessions, handle, name="n")
        for _ in range(2):  # and again: it does not pass over the record
            with pytest.raises(MissingEventId, match=r"offset 1 has no event id .*'outbox-id'"):
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    await strict.poll()
            assert await c.position(tp) == 1
        assert await c.committed(tp) == 1
        lenient = KafkaInbox(c, sessions, handle, name="n", on_missing_id="skip")
        deadline = time.monotonic() + 10
        while await c.position(tp) < 5 and time.monotonic() < deadline:
            await lenient.poll()
        assert await c.committed(tp) == 5
    finally:
        await c.stop()
    assert seen == [b"a", b"b"]
    assert (lenient.counts.applied, lenient.counts.duplicates, lenient.counts.skipped) == (1, 2, 1)
    got, _ = await effects(engine)
    assert got == [("1", 1), ("ce-1", 1)]


async def test_a_consumer_that_could_lose_events_is_refused(
    kafka_bootstrap: str, engine: AsyncEngine
) -> None:
    async def handle(record: Any, tx: Any) -> None:
        pass

    auto = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id="g")  # auto-commit on
    groupless = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
    ok = consumer(kafka_bootstrap, "g")
    try:
        with pytest.raises(OutboxError, match="enable_auto_commit=False"):
            KafkaInbox(auto, engine, handle, name="n")
        with pytest.raises(OutboxError, match="no group_id"):
            KafkaInbox(groupless, engine, handle, name="n")
        with pytest.raises(TypeError, match="AsyncEngine or async_sessionmaker"):
            KafkaInbox(ok, "postgresql://x", handle, name="n")
        with pytest.raises(OutboxError, match="consumer"):
            KafkaInbox(ok, engine, handle, name="")
    finally:
        for c in (auto, groupless, ok):
            await c.stop()


# --- from the hostile review: each failed before its fix -------------------------------


async def test_an_unusable_id_is_skipped_like_a_missing_one(
    kafka_bootstrap: str, engine: AsyncEngine
) -> None:
    topic, group = f"inbox-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    await produce(
        kafka_bootstrap,
        topic,
        [
            (0, [("ce_id", b"x" * 2000)], b"too long an id"),
            (0, [("outbox-id", b"   ")], b"blank id"),
            (0, [("outbox-id", b"9")], b"fine"),
        ],
    )
    tp = TopicPartition(topic, 0)
    seen: list[bytes] = []

    async def handle(record: Any, session: AsyncSession) -> None:
        seen.append(record.value)

    c = consumer(kafka_bootstrap, group)
    await c.start()
    try:
        c.assign([tp])
        inbox = KafkaInbox(c, async_sessionmaker(engine), handle, name="n", on_missing_id="skip")
        deadline = time.monotonic() + 10
        while await c.position(tp) < 3 and time.monotonic() < deadline:
            await inbox.poll()
        assert await c.committed(tp) == 3
    finally:
        await c.stop()
    assert seen == [b"fine"] and inbox.counts.skipped == 2


async def test_offsets_of_partitions_a_rebalance_took_away_are_not_committed(
    kafka_bootstrap: str, engine: AsyncEngine
) -> None:
    """After a rebalance, aiokafka refuses to commit a partition no longer assigned
    (IllegalStateError): the inbox commits what it still owns and carries on."""
    topic, group = f"inbox-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    await produce(kafka_bootstrap, topic, [(0, [("outbox-id", b"1")], b"a")])
    mine, gone = TopicPartition(topic, 0), TopicPartition(topic, 1)

    async def handle(record: Any, session: AsyncSession) -> None:
        return None

    c = consumer(kafka_bootstrap, group)
    await c.start()
    try:
        c.assign([mine])
        inbox = KafkaInbox(c, async_sessionmaker(engine), handle, name="n")
        await inbox._commit({mine: 1, gone: 5})
        assert await c.committed(mine) == 1
    finally:
        await c.stop()
