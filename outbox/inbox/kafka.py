"""Consuming from Kafka once per event: aiokafka, the inbox, and offsets committed last.

    consumer = AIOKafkaConsumer("shop.orders.v1", bootstrap_servers=..., group_id="billing",
                                enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    await outbox.inbox.kafka.process(consumer, engine, handle, name="billing")

For each record: read its event id (the ``outbox-id`` header the relay sets, else the
CloudEvents binary-mode ``ce_id``), open a database transaction, mark the id, run
``handler(record, tx)`` only if it was new, commit. After the database commits, the batch's
offsets are committed to Kafka. A crash anywhere in between redelivers records whose effect
may already be committed; their marks make them no-ops. So every effect is applied once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata

from outbox.errors import OutboxError, OutboxValidationError
from outbox.inbox._db import Database, check_database, ensure_committable, transaction
from outbox.inbox._store import Inbox, _default, check_consumer, check_event_id

log = logging.getLogger("outbox.inbox")

OUTBOX_ID = "outbox-id"  # set by the relay on every message
CE_ID = "ce_id"  # CloudEvents' Kafka binding, binary mode

# handler(record, tx): tx is what the database handle gives a transaction as (see _db).
Record: TypeAlias = ConsumerRecord[Any, Any]
Handler = Callable[[Record, Any], Awaitable[object]]
EventIdOf = Callable[[Record], str | int | None]
MissingIdPolicy = Literal["raise", "skip"]


class MissingEventId(OutboxError):
    """A record carries no event id, so it cannot be deduplicated (``on_missing_id="raise"``,
    the default). The records before it are applied and committed; the consumer is set back
    to it, so it stops there rather than pass over it."""


def read_event_id(record: Record) -> str | None:
    """The record's event id: its ``outbox-id`` header, else its ``ce_id`` header, as text;
    None when it has neither (or an empty or non-UTF-8 one)."""
    headers = dict(record.headers or ())
    for name in (OUTBOX_ID, CE_ID):
        raw = headers.get(name)
        if raw:
            try:
                return bytes(raw).decode("utf-8")
            except UnicodeDecodeError:
                return None
    return None


@dataclass
class Counts:
    applied: int = 0  # handler ran and its transaction committed
    duplicates: int = 0  # marked before: the handler did not run
    skipped: int = 0  # no event id, on_missing_id="skip"


class KafkaInbox:
    """Runs ``handler`` once per event for the records ``consumer`` reads.

    ``consumer``: a started ``AIOKafkaConsumer`` with a ``group_id`` (offsets are committed
    to it) and ``enable_auto_commit=False`` (auto-commit would commit offsets of records not
    yet applied). It may ``subscribe`` (a consumer group) or ``assign`` partitions.
    ``db``: an ``AsyncEngine``, ``async_sessionmaker``, asyncpg ``Pool`` or ``Connection``;
    the handler gets the transaction's ``AsyncConnection``, ``AsyncSession`` or asyncpg
    ``Connection`` and writes its effect with it. ``name``: the consumer's name in the inbox
    (ids are unique per outbox, so use one name per source of events).
    ``on_missing_id``: a record without an id stops the consumer (``"raise"``, the default:
    ``MissingEventId``), or is passed over, logged and committed (``"skip"``).
    ``event_id``: where the id is, for other producers (default: :func:`read_event_id`).

    A handler that raises rolls its transaction back (the mark too); the records applied
    before it are committed, the consumer is set back to the failed one, and ``poll`` or
    ``run`` raises the handler's exception. A handler that catches a database error and
    returns is treated the same (PostgreSQL would roll its COMMIT back): ``poll`` raises
    ``TransactionAborted``, logged as ``inbox.handler.aborted``.
    """

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        db: Database,
        handler: Handler,
        *,
        name: str,
        inbox: Inbox | None = None,
        on_missing_id: MissingIdPolicy = "raise",
        event_id: EventIdOf | None = None,
        max_records: int = 500,
        poll_timeout: float = 1.0,
    ) -> None:
        if getattr(consumer, "_enable_auto_commit", False):
            raise OutboxError(
                "the consumer commits offsets on its own (enable_auto_commit=True): it would "
                "commit records before their effect is; create it with enable_auto_commit=False"
            )
        if getattr(consumer, "_group_id", "") is None:
            raise OutboxError(
                "the consumer has no group_id: offsets are committed to a consumer group, "
                "so a restart resumes after what was applied; give it one"
            )
        check_database(db)
        if on_missing_id not in ("raise", "skip"):
            raise OutboxValidationError("on_missing_id", 'must be "raise" or "skip"')
        if not isinstance(max_records, int) or max_records < 1:
            raise OutboxValidationError("max_records", "must be a positive int")
        self.consumer = consumer
        self.db = db
        self.handler = handler
        self.name = check_consumer(name)
        self.inbox = inbox or _default
        self.on_missing_id = on_missing_id
        self._event_id = event_id or read_event_id
        self.max_records = max_records
        self.poll_timeout = poll_timeout
        self.counts = Counts()
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        """Let ``run`` return once the batch in hand is applied and committed."""
        self._stopping.set()

    async def run(self) -> None:
        """Poll, apply and commit until ``stop()``; raises what a handler raises."""
        while not self._stopping.is_set():
            await self.poll()

    async def poll(self) -> int:
        """Fetch one batch, apply each record once, commit the offsets; how many records
        were read."""
        batch = await self.consumer.getmany(
            timeout_ms=int(self.poll_timeout * 1000), max_records=self.max_records
        )
        done: dict[TopicPartition, int] = {}
        try:
            for tp, records in batch.items():
                for record in records:
                    await self._apply(record)
                    done[tp] = record.offset + 1
        except BaseException:
            # Read the unapplied records again on the next poll, whoever calls it; keep what
            # was applied (best effort: if this commit fails too, the marks absorb it).
            for tp, records in batch.items():
                if records and done.get(tp, -1) <= records[-1].offset:
                    with contextlib.suppress(Exception):
                        self.consumer.seek(tp, done.get(tp, records[0].offset))
            if done:
                with contextlib.suppress(Exception):
                    await self._commit(done)
            raise
        if done:
            await self._commit(done)
        return sum(len(r) for r in batch.values())

    async def _apply(self, record: Record) -> None:
        raw = self._event_id(record)
        problem = None
        if raw is not None:
            try:
                eid = check_event_id(raw)
            except OutboxValidationError as exc:
                # An id the inbox cannot hold is no more usable than none: the same policy,
                # or the record would stop the consumer on every poll, "skip" or not.
                problem = f"an unusable event id ({exc})"
        if raw is None or problem is not None:
            where = f"{record.topic}[{record.partition}] offset {record.offset}"
            what = problem or (
                f"no event id (no non-empty UTF-8 {OUTBOX_ID!r} or {CE_ID!r} header)"
            )
            if self.on_missing_id == "skip":
                self.counts.skipped += 1
                log.warning("inbox %s: %s has %s; skipped", self.name, where, what)
                return
            raise MissingEventId(
                f"{where} has {what}, so it cannot be deduplicated; use "
                'on_missing_id="skip" to pass over such records, or event_id= to say where '
                "the id is"
            )
        async with transaction(self.db) as tx:
            if not await self.inbox.mark(tx, consumer=self.name, event_id=eid):
                self.counts.duplicates += 1
                return
            await self.handler(record, tx)
            # A handler that caught a database error leaves a transaction whose COMMIT
            # PostgreSQL turns into a ROLLBACK, silently: that is a failure, not an event
            # applied, and its offset is not committed (raises TransactionAborted).
            await ensure_committable(
                tx,
                consumer=self.name,
                event_id=eid,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
            )
        self.counts.applied += 1

    async def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        # Partitions a rebalance took away meanwhile are not this consumer's to commit: their
        # new owner reads those records again and finds them marked.
        owned = self.consumer.assignment()
        mine = {tp: OffsetAndMetadata(o, "") for tp, o in offsets.items() if tp in owned}
        lost = len(offsets) - len(mine)
        if lost:
            log.warning("inbox %s: %d partition(s) reassigned; redelivered", self.name, lost)
        if not mine:
            return
        try:
            await self.consumer.commit(mine)
        except (CommitFailedError, IllegalStateError) as exc:
            # The group rebalanced (now, or between the check and the commit): as above.
            log.warning("inbox %s: offsets not committed (%s); redelivered", self.name, exc)


async def process(
    consumer: AIOKafkaConsumer,
    db: Database,
    handler: Handler,
    *,
    name: str,
    inbox: Inbox | None = None,
    on_missing_id: MissingIdPolicy = "raise",
    event_id: EventIdOf | None = None,
) -> None:
    """``KafkaInbox(...).run()``: apply each record once, until cancelled or a handler raises."""
    await KafkaInbox(
        consumer,
        db,
        handler,
        name=name,
        inbox=inbox,
        on_missing_id=on_missing_id,
        event_id=event_id,
    ).run()
