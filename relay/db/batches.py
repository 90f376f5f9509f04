"""The statements of batch leases (relay.claims = "batch", see queries.CLAIM_BATCH) for one
schema: what the store runs for rows whose token is a batch's, the reaper's, and the check that
no relay claims a destination another way beside them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import asyncpg

from relay.db import queries
from relay.db.pool import Call


@dataclass(frozen=True, slots=True)
class BatchStatements:
    record: str
    record_delivered: str
    heartbeat: str
    release: str
    reap: str
    expired: str
    forget: str
    mixed: str

    @classmethod
    def of(cls, schema: str, delete_delivered: bool) -> BatchStatements:
        """For ``schema``; ``delete_delivered`` (retention = 0): records delete what they
        deliver."""

        def sql(statement: str) -> str:
            return queries.render_ops(statement, schema)

        deleting = delete_delivered
        return cls(
            record=sql(queries.RECORD_BATCH_DELETING if deleting else queries.RECORD_BATCH),
            record_delivered=sql(
                queries.RECORD_BATCH_DELIVERED_DELETING
                if deleting
                else queries.RECORD_BATCH_DELIVERED
            ),
            heartbeat=sql(queries.HEARTBEAT_BATCHES),
            release=sql(queries.RELEASE_BATCH),
            reap=sql(queries.REAP_BATCHES),
            expired=sql(queries.EXPIRED_BATCHES),
            forget=sql(queries.FORGET_BATCHES),
            mixed=sql(queries.MIXED_CLAIMS),
        )


@dataclass(frozen=True, slots=True)
class BatchLeases:
    """The reaper's statements for batch leases that ended, and the registry's check of how
    other relays claim, run through ``call`` (a store's), counted by name in ``statements``."""

    call: Call
    statements: Counter[str]
    sql: BatchStatements

    async def reap(
        self,
        max_attempts: int,
        per_destination: dict[str, int],
        limit: int = 5000,
        *,
        only: Sequence[int] | None = None,
        never: Sequence[int] = (),
        within: float | None = None,
    ) -> list[asyncpg.Record]:
        """End batch leases that expired (see queries.REAP_BATCHES): their rows not recorded go
        back to pending (or failed), as reap puts back a row; ``only``: only these batches
        (None: any), ``never``: never these; ``within``: only those whose lease ended in the
        last so many seconds (None: whenever)."""
        self.statements["reap_batches"] += 1
        limits = (list(per_destination), list(per_destination.values()))
        only_ = list(only) if only is not None else None
        args = (max_attempts, limit, *limits, only_, list(never), within)
        return list(await self.call("fetch", self.sql.reap, *args))

    async def expired(self, limit: int, never: Sequence[int]) -> list[int]:
        """The ids of up to ``limit`` batches whose lease expired, but ``never``'s."""
        return [r[0] for r in await self.call("fetch", self.sql.expired, limit, list(never))]

    async def forget(self, keep: float) -> int:
        """Delete ended batch leases older than ``keep`` seconds (see queries.FORGET_BATCHES)."""
        status = await self.call("execute", self.sql.forget, keep)
        return int(status.split()[-1])

    async def mixed_claims(
        self, relay: str, destinations: Collection[str], batch: bool, seen_within: float
    ) -> list[asyncpg.Record]:
        """The other relays running (seen in the last ``seen_within`` seconds) that serve one
        of ``destinations`` the other way (see queries.MIXED_CLAIMS): under batch leases if
        ``batch`` is false, by row if it is true; each with those destinations."""
        args = (relay, sorted(destinations), batch, seen_within)
        return list(await self.call("fetch", self.sql.mixed, *args))
