"""The pending gauges: rows and the oldest one's age per destination (see
queries.PENDING_BY_DESTINATION), counted by one relay at a time from where the last count
found each destination's fresh rows begin."""

from __future__ import annotations

import asyncpg

from relay.db import queries
from relay.db.pool import connection


class PendingGauges:
    """The pending gauges' statements for ``schema``, run on ``pool``, and what the last count
    left for the next one."""

    def __init__(self, pool: asyncpg.Pool, schema: str) -> None:
        self.pool = pool
        self.schema = schema
        self._table = queries.qualified_table(schema)
        self._fence = queries.render_ops(queries.FENCE, schema)
        self._pending = queries.render_ops(queries.PENDING_BY_DESTINATION, schema)
        self.epoch: tuple[object, ...] = ()
        self.top = 0
        # Per destination, below which the pending gauges need not count (see
        # PENDING_BY_DESTINATION).
        self.floors: dict[str, int] = {}

    def forget(self) -> None:
        """Count every destination from the start again (the table's epoch changed)."""
        self.floors.clear()

    async def pending_stats(self) -> dict[str, tuple[int, float]] | None:
        """Pending rows and oldest pending age per destination; None if another relay is
        computing them at this moment."""
        async with connection(self.pool) as conn, conn.transaction():
            if not await conn.fetchval(queries.TRY_JOB_LOCK, f"{self.schema}:stats"):
                return None
            # Two statements, in this order: the count's snapshot must be younger than the fence.
            safe_id, *epoch, self.top, _, _ = await conn.fetchrow(
                self._fence, self._table, self.top
            )
            if tuple(epoch) != self.epoch:  # see UnorderedClaims.claim
                self.epoch = tuple(epoch)
                self.floors.clear()
                safe_id, *_, self.top, _, _ = await conn.fetchrow(self._fence, self._table, 0)
            floors = self.floors
            rows = await conn.fetch(self._pending, list(floors), list(floors.values()), safe_id)
        self.floors = {r["destination"]: r["floor"] for r in rows}
        return {r["destination"]: (r["rows"], r["oldest_age"]) for r in rows if r["rows"]}
