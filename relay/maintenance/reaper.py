"""The reaper: rows whose lease expired (their relay died or stalled) go back to pending,
an attempt counted, or to failed once their destination's attempts are spent; so do the rows
of batch leases that expired unrecorded (relay.claims = "batch"), and old ended batches are
forgotten. Other sources of leased rows (a sink's table) are reaped after the events, each by
its own statement, and woken when rows of theirs are claimable again."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import asyncpg
import structlog

from outbox.errors import describe
from outbox.status import Status
from relay.db.store import DB_ERRORS, UNAVAILABLE, Store
from relay.obs.metrics import Metrics
from relay.pipeline.leases import LOST_IDS_LOGGED

log = structlog.get_logger("relay")


class Reapable(Protocol):
    """A source of leased rows beside the events, as the reaper sees it (a
    relay.sinks.source.Source is one)."""

    @property
    def name(self) -> str: ...

    async def reap(
        self, max_attempts: int, limits: Mapping[str, int], within: float | None = None
    ) -> int: ...

    def wake(self) -> None: ...


# Rows the database refused to reap, even alone, are left out of reaping this long.
UNREAPABLE_FOR = 600.0

# A pass after a complete one looks only at leases that ended since it began, and this much
# before: a claim or a heartbeat that began before a pass and committed after it (invisible to
# it) set its lease to end at least a lease after it began, so only a statement slower than
# this margin can leave a lease behind a bounded pass; a full pass finds it.
MARGIN = 10.0
# Between full passes (every lease ever ended, a held snapshot's dead entries included).
FULL_EVERY = 600.0
REAP_LIMIT = 5000
# Ended batch leases are deleted this often, once older than BATCHES_KEPT (or four leases):
# far longer than any claim statement runs (the relay's command timeout is two leases, or a
# minute), so a claim on an older snapshot still meets the batch it would overlap.
FORGET_EVERY = 60.0
BATCHES_KEPT = 600.0


class Reaper:
    def __init__(
        self,
        store: Store,
        max_attempts: int,
        limits: dict[str, int],
        metrics: Metrics,
        reaped: Callable[[], None],
        extra: Sequence[Reapable] = (),
    ) -> None:
        self.store = store
        self.max_attempts = max_attempts  # of destinations no relay here knows
        self.limits = limits
        self.metrics = metrics
        self.reaped = reaped  # rows are claimable again: claim them
        self.extra = list(extra)  # reaped after the events, in this order
        self._unreapable: dict[int, float] = {}  # row id -> until when it is left alone
        self._unreapable_batches: dict[int, float] = {}  # the same for batch leases
        # When the last complete pass began (it took every lease expired then) and the last
        # full one (monotonic times; None: not yet).
        self._complete: float | None = None
        self._full: float | None = None
        self._forgot: float | None = None
        # The same for each other source, in the order of extra.
        self._source_complete: list[float | None] = [None] * len(self.extra)
        self._source_full: list[float | None] = [None] * len(self.extra)

    async def __call__(self) -> None:
        now = time.monotonic()
        self._unreapable = {i: t for i, t in self._unreapable.items() if t > now}
        never = list(self._unreapable)
        full = self._complete is None or self._full is None or now - self._full >= FULL_EVERY
        within = None if full or self._complete is None else now - self._complete + MARGIN
        try:
            rows = await self.store.reap(
                self.max_attempts, self.limits, REAP_LIMIT, never=never, within=within
            )
        except UNAVAILABLE:
            raise
        except DB_ERRORS as exc:
            rows = await self._one_by_one(never, exc)
        else:
            if len(rows) < REAP_LIMIT:
                self._complete = now
                if full:
                    self._full = now
        rows += await self._reap_batches(now, within)
        if self._forgot is None or now - self._forgot >= FORGET_EVERY:
            self._forgot = now
            await self.store.forget_batches(max(BATCHES_KEPT, 4 * self.store.lease))
        if rows:
            self.metrics.reaped.inc(len(rows))
            failed = [r["id"] for r in rows if r["status"] == Status.FAILED]
            log.warning(
                "relay.lease.expired",
                count=len(rows),
                first_id=min(r["id"] for r in rows),
                last_id=max(r["id"] for r in rows),
                failed=len(failed),
                destinations=sorted({r["destination"] for r in rows}),
            )
            self.reaped()
        for i, source in enumerate(self.extra):
            await self._reap_source(i, source)

    async def _reap_source(self, i: int, source: Reapable) -> None:
        """One other source's pass: its failure is its own, the next source's pass runs.
        Bounded as the events' passes are: after a complete pass, only the leases that ended
        since it began (and MARGIN before); every lease ever ended every FULL_EVERY."""
        now = time.monotonic()
        complete, last_full = self._source_complete[i], self._source_full[i]
        full = complete is None or last_full is None or now - last_full >= FULL_EVERY
        within = None if full or complete is None else now - complete + MARGIN
        try:
            count = await source.reap(self.max_attempts, self.limits, within=within)
        except DB_ERRORS as exc:
            log.warning("relay.reap.source_failed", source=source.name, error=describe(exc))
            return
        if count < REAP_LIMIT:
            self._source_complete[i] = now
            if full:
                self._source_full[i] = now
        if count:
            # An event of its own: relay.lease.expired names the events' rows (first_id,
            # last_id, destinations), and a source's ids are another table's.
            log.warning("relay.source.reaped", source=source.name, count=count)
            source.wake()

    async def _one_by_one(self, never: list[int], error: BaseException) -> list[asyncpg.Record]:
        """The database refused to reap the expired rows together: reap them one by one, and
        leave alone for a while those it refuses even alone (a trigger, a policy)."""
        reaped: list[asyncpg.Record] = []
        refused: list[int] = []
        for row_id in await self.store.expired(500, never):
            try:
                reaped += await self.store.reap(
                    self.max_attempts, self.limits, 1, only=[row_id], never=never
                )
            except UNAVAILABLE:
                raise
            except DB_ERRORS as exc:
                refused.append(row_id)
                error = exc
        if refused:
            self._unreapable.update(dict.fromkeys(refused, time.monotonic() + UNREAPABLE_FOR))
            log.error(
                "relay.reap.refused",
                count=len(refused),
                ids=refused[:LOST_IDS_LOGGED],
                error=describe(error),
                action="the database refuses to put these rows back to pending (a trigger or a "
                "policy?); they stay running until it accepts",
            )
        return reaped

    async def _reap_batches(self, now: float, within: float | None) -> list[asyncpg.Record]:
        """End the batch leases that expired (the same bound as reap's: a pass over every lease
        ever ended is a full one), and if the database refuses, batch by batch."""
        left_alone = self._unreapable_batches
        self._unreapable_batches = {i: t for i, t in left_alone.items() if t > now}
        never = list(self._unreapable_batches)
        leases = self.store.batch_leases
        try:
            return await leases.reap(self.max_attempts, self.limits, never=never, within=within)
        except UNAVAILABLE:
            raise
        except DB_ERRORS as exc:
            error: BaseException = exc
        reaped: list[asyncpg.Record] = []
        refused: list[int] = []
        for batch_id in await leases.expired(500, never):
            try:
                reaped += await leases.reap(
                    self.max_attempts, self.limits, 1, only=[batch_id], never=never
                )
            except UNAVAILABLE:
                raise
            except DB_ERRORS as exc:
                refused.append(batch_id)
                error = exc
        if refused:
            until = time.monotonic() + UNREAPABLE_FOR
            self._unreapable_batches.update(dict.fromkeys(refused, until))
            log.error(
                "relay.reap.batches_refused",
                count=len(refused),
                batches=refused[:LOST_IDS_LOGGED],
                error=describe(error),
                action="the database refuses to put back the rows of these expired batch "
                "leases (outbox_batches ids; a trigger or a policy?); their rows stay in flight "
                "until it accepts, the other batches are reaped",
            )
        return reaped
