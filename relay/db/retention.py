"""Retention: batches deleting the delivered and skipped rows past their retention (never one
a delivery still needs), and the ended endpoint deliveries and the message log past theirs,
by one relay at a time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import structlog

from outbox.errors import describe
from outbox.status import Status
from relay.db import queries
from relay.db.errors import DB_ERRORS
from relay.db.pool import connection

log = structlog.get_logger("relay")

# Where a retention run's last batch of delivered rows stopped: (delivered_at, id).
RetentionCursor = tuple[Any, int]


@dataclass(slots=True)
class RetentionBatch:
    """What one retention batch did: rows deleted, whether more may be due, where it
    stopped in the delivered rows (for the next batch of the same run)."""

    deleted: int
    more: bool
    cursor: RetentionCursor | None


class Retention:
    """Retention's statements, rendered for ``schema``, run on ``pool``."""

    def __init__(self, pool: asyncpg.Pool, schema: str) -> None:
        self.pool = pool
        self.schema = schema

        def sql(statement: str) -> str:
            return queries.render_ops(statement, schema)

        self._retention_delivered = sql(queries.RETENTION_DELIVERED)
        self._delete_locked = sql(queries.DELETE_LOCKED)
        self._purge_finished = sql(queries.PURGE_FINISHED)
        # Retention of ended endpoint deliveries and of the message log (migration 0006).
        self._purge_deliveries = sql(queries.PURGE_DELIVERIES)
        self._purge_attempts = sql(queries.PURGE_ATTEMPTS)

    async def batch(
        self, retention: float, log_retention: float, batch_size: int, after: RetentionCursor | None
    ) -> RetentionBatch | None:
        """One batch of retention (see Store.delete_finished), the message log's retention
        given; None if another relay is running retention at this moment."""
        async with connection(self.pool) as conn, conn.transaction():
            if not await conn.fetchval(queries.TRY_JOB_LOCK, f"{self.schema}:retention"):
                return None
            at, last_id = after if after is not None else (None, None)
            row = await conn.fetchrow(self._retention_delivered, retention, batch_size, at, last_id)
            deleted = await self._delete_locked_rows(conn, row["ids"], Status.DELIVERED)
            more = row["examined"] >= batch_size
            cursor = (row["at"], row["id"]) if row["examined"] else after
            if not more:
                ids = [
                    r[0]
                    for r in await conn.fetch(
                        self._purge_finished, retention, None, batch_size, [Status.SKIPPED]
                    )
                ]
                deleted += await self._delete_locked_rows(conn, ids, Status.SKIPPED)
                more = len(ids) >= batch_size
        # The message log and ended deliveries have a retention of their own (counted apart:
        # the batch size bounds each), in a transaction of its own: holding the events' locks
        # above while locking deliveries would deadlock with a replay, which locks a delivery
        # and then its event.
        # (If another relay took the job meanwhile, it purges the log in its own batch.)
        try:
            async with connection(self.pool) as conn, conn.transaction():
                if await conn.fetchval(queries.TRY_JOB_LOCK, f"{self.schema}:retention"):
                    status = await conn.execute(self._purge_deliveries, log_retention, batch_size)
                    n = int(status.split()[-1])
                    deleted, more = deleted + n, more or n >= batch_size
                    # Fewer deleted than examined: attempts not yet old enough among the
                    # lowest ids (a clock set back), not the end of what is old enough.
                    row = await conn.fetchrow(self._purge_attempts, log_retention, batch_size)
                    deleted += row["deleted"]
                    more = more or (row["deleted"] > 0 and row["examined"] >= batch_size)
        except DB_ERRORS as exc:
            # The events' batch is committed: counted, and the log purged by the next run.
            log.warning("relay.retention.message_log_failed", error=describe(exc))
        return RetentionBatch(deleted, more, cursor)

    async def _delete_locked_rows(
        self, conn: asyncpg.Connection, ids: Sequence[int], status: Status
    ) -> int:
        """The second statement of a purge (queries.DELETE_LOCKED): how many it deleted."""
        if not ids:
            return 0
        done = await conn.execute(self._delete_locked, list(ids), [status])
        return int(done.split()[-1])
