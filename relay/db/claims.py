"""The claim of an unordered destination (see queries.CLAIM): where its claims stand in its
fresh rows, kept between them (the cursor, where the read of late commits begins, what the
last FENCE reading said), and the sweep that walks again from rows found behind the cursor."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

import asyncpg

from relay.db import queries
from relay.db.envelopes import envelopes
from relay.db.pool import Call
from relay.model import Envelope

# How long an unordered claim that follows a full batch may go on the FENCE reading made
# before it (see UnorderedClaims.claim): a drain reads it once in a few claims, not at every one.
FENCE_REUSE = 0.5
# How many times more a batch claim that lost the race for its chain's end claims again at once
# from the new end (see UnorderedClaims._take_batch).
LOST_TRIES = 3
# How long the fence of a destination claimed in batches may stand still, with rows visible
# past it, before they are claimed row by row (see queries.CLAIM_PAST_FENCE): an inserting
# transaction open that long is no request's but a bulk import's, or a session left idle in
# transaction, and the rows committed after it are not held back for as long as it stays open.
PAST_FENCE_AFTER = 0.25


@dataclass(frozen=True, slots=True)
class _Lane:
    """Where an unordered destination's claims stand in its fresh rows (see queries.CLAIM):
    the cursor, where the next claim's read of late commits begins, and what FENCE read before
    the last claim (the highest id then visible, the open inserts' keys)."""

    cursor: int = 0
    recheck: int = 0
    top: int = 0
    held: frozenset[str] = frozenset()  # "<virtual transaction id>/<key>"

    def recheck_from(self, held: Collection[str]) -> int:
        """Where the next claim's read of late commits begins, now that FENCE reads ``held``:
        inserting transactions open at the previous reading and ended since may have
        committed their rows behind the cursor."""
        ended = self.held.difference(held)
        if ended:
            return min(self.recheck, *(int(k.rsplit("/", 1)[1]) for k in ended))
        return self.recheck


class UnorderedClaims:
    """The unordered destinations' claims of one store: ``call`` runs a statement on its pool,
    ``statements`` counts them by name, ``new_epoch`` is told when the table's epoch changes."""

    def __init__(
        self,
        call: Call,
        statements: Counter[str],
        schema: str,
        relay_id: str,
        lease: float,
        new_epoch: Callable[[], None],
        *,
        batched: Collection[str] = (),
    ) -> None:
        self._call = call
        self.statements = statements
        self.relay_id = relay_id
        self.lease = lease
        self._on_new_epoch = new_epoch
        self.table = queries.qualified_table(schema)
        self.fence = queries.render_ops(queries.FENCE, schema)
        self.claim_late = queries.render_ops(queries.CLAIM, schema)
        self.claim_fresh = queries.render_ops(queries.CLAIM_FRESH, schema)
        self.claim_batch = queries.render_ops(queries.CLAIM_BATCH, schema)
        self.claim_past_fence = queries.render_ops(queries.CLAIM_PAST_FENCE, schema)
        # The destinations claimed under batch leases (see queries.CLAIM_BATCH).
        self.batched = frozenset(batched)
        self._fresh_below = queries.render_ops(queries.FRESH_BELOW, schema)
        self._sweep_batches = queries.render_ops(queries.SWEEP_BATCHES, schema)
        # The last FENCE reading an unordered claim made (monotonic time, row), of the epoch
        # the cursors hold for, and the destinations whose last claim filled its batch: their
        # next claim, at once, may go on that reading (see claim).
        self._reading: tuple[float, asyncpg.Record] | None = None
        self._draining: set[str] = set()
        # Per batched destination that drains, the last fresh id its last claim took (the
        # chain's end as this relay left it): see _claim_batch.
        self._chain_ends: dict[str, int] = {}
        # Per batched destination whose fence stands below rows visible past it: that fence,
        # since when (monotonic time), and where its next claim past the fence starts.
        self._stalls: dict[str, tuple[int, float, int]] = {}
        # Per batched destination, the error of a claim past the fence that followed a batch
        # claim which took rows: raised by its next claim (see _claim_batch).
        self._deferred: dict[str, Exception] = {}
        # Per unordered destination, where its next claim of fresh rows starts and up to where
        # every fresh row has been seen (see CLAIM), and the table's epoch they hold for.
        self.cursors: dict[str, _Lane] = {}
        self._rewinds: dict[str, int] = {}
        self._claiming: set[str] = set()
        self._epoch: tuple[object, ...] = ()
        # The epoch of the ids the batch claims' chains last read (FENCE's last column).
        self._ids_epoch: object = None

    async def claim(self, destination: str, limit: int) -> list[Envelope]:
        """Claim up to ``limit`` rows of an unordered ``destination`` (see queries.CLAIM), its
        fresh rows from where its previous claim ended."""
        if destination in self.batched:
            return await self._claim_batch(destination, limit)
        # Two statements, in this order: the claim's snapshot must be younger than the fence.
        state = self.cursors.get(destination, _Lane())
        reading = self._reading
        reuse = (
            reading is not None
            and destination in self._draining
            and state.cursor < reading[1][3]
            and time.monotonic() - reading[0] < FENCE_REUSE
        )
        # Cleared before anything is awaited: a claim that fails reads the fence afresh.
        self._draining.discard(destination)
        if reuse:
            assert reading is not None
            # A drain: the previous claim filled its batch, and rows visible at the last
            # reading are still ahead of the cursor. An older reading is as safe as a new one
            # (the claim's snapshot is younger still); what it would cost is a late range from
            # its highest id up to the cursor, empty while the cursor is below that id. FENCE
            # was about a twentieth of a drain's database time, most of it planning. Only a
            # reading of the current epoch is kept (below), and the unordered claims alone
            # share it.
            row = reading[1]
        else:
            self.statements["fence"] += 1
            row = await self._call("fetchrow", self.fence, self.table, state.top)
        _, *epoch, top, held, _ = row
        if tuple(epoch) != self._epoch:
            state = _Lane()
            row = await self._new_epoch(tuple(epoch))
            _, *epoch, top, held, _ = row
        if not reuse:
            self._reading = (time.monotonic(), row)
        state = self.cursors.get(destination, state)
        recheck = state.recheck_from(held)
        above = max(state.top, top)  # never lower: rows deleted since are no new ids
        self.statements["claim"] += 1
        until = time.monotonic() + self.lease  # before the statement: never later than its now()
        self._claiming.add(destination)
        args: tuple[object, ...] = (destination, limit, self.relay_id, self.lease, state.cursor)
        try:
            if recheck >= state.cursor:
                # Nothing between the two can have committed late: no late range to read.
                rows = await self._call("fetch", self.claim_fresh, *args, above)
            else:
                rows = await self._call("fetch", self.claim_late, *args, above, recheck)
        finally:
            self._claiming.discard(destination)
        self._advance(destination, rows, limit, above, held)
        return envelopes([r for r in rows if r[0] != -1], until)

    async def _claim_batch(self, destination: str, limit: int) -> list[Envelope]:
        """Claim up to ``limit`` rows of ``destination``, its fresh ones under a batch lease
        (see queries.CLAIM_BATCH): nothing is kept between claims but the last FENCE reading,
        since where the next claim begins is in the table."""
        deferred = self._deferred.pop(destination, None)
        if deferred is not None:
            raise deferred
        reading = self._reading
        # As in claim: a claim that follows a full batch at once may go on an older reading
        # (a lower fence is as safe; it may only take fewer rows), while rows it showed are
        # still ahead of the chain: once the chain has reached its fence, the claim would
        # take no fresh row, whatever committed since.
        reuse = (
            reading is not None
            and destination in self._draining
            and self._chain_ends.get(destination, 0) < reading[1][0]
            and time.monotonic() - reading[0] < FENCE_REUSE
        )
        self._draining.discard(destination)
        if reuse:
            assert reading is not None
            row = reading[1]
        else:
            self.statements["fence"] += 1
            top = reading[1][3] if reading is not None else 0
            row = await self._call("fetchrow", self.fence, self.table, top)
            restarted = self._ids_epoch is not None and row[5] != self._ids_epoch
            if tuple(row[1:3]) != self._epoch or restarted:
                # A new epoch of the table, or of its ids (the sequence restarted): the highest
                # id read before may not cap this one's ids.
                row = await self._new_epoch(tuple(row[1:3]))
            self._ids_epoch = row[5]
            self._reading = (time.monotonic(), row)
        # The chain's epoch is the ids' (FENCE's last column), not the table's file: a rewrite
        # of the table hands out no id again, and the chains go on across it.
        until = time.monotonic() + self.lease  # before the statements: never later than now()
        rows = await self._take_batch(destination, limit, row[0], row[5])
        if len(rows) >= limit:
            self._draining.add(destination)
            self._chain_ends[destination] = max((r[0] for r in rows if r[8] < 0), default=0)
        elif row[0] < row[3]:
            try:
                rows += await self._past_fence(destination, limit - len(rows), row)
            except Exception as exc:
                if not rows:
                    raise
                # The batch claim has committed: raised now, its rows would stay in flight
                # unknown to the relay until their lease ended, and the reaper counted an
                # attempt of each (failed unsent once attempts are spent). They are returned,
                # and the error raised by this destination's next claim, as the claimer
                # reports and backs off from any other.
                self._stalls.pop(destination, None)
                self._deferred[destination] = exc
        else:
            self._stalls.pop(destination, None)
        return envelopes(rows, until)

    async def _past_fence(
        self, destination: str, limit: int, reading: asyncpg.Record
    ) -> list[asyncpg.Record]:
        """Rows of ``destination`` visible past the fence of the FENCE ``reading``, claimed row
        by row once the fence has stood there for PAST_FENCE_AFTER (see
        queries.CLAIM_PAST_FENCE); none before."""
        fence = int(reading[0])
        now = time.monotonic()
        stall = self._stalls.get(destination)
        if stall is None or stall[0] != fence:
            self._stalls[destination] = (fence, now, fence)
            return []
        if now - stall[1] < PAST_FENCE_AFTER:
            return []
        self.statements["claim_past_fence"] += 1
        rows = await self._call(
            "fetch",
            self.claim_past_fence,
            self.table,
            destination,
            limit,
            self.relay_id,
            self.lease,
            fence,
            max(fence, stall[2]),
        )
        marker = rows[-1]
        if marker[4] == "t":
            cursor = min(int(marker[2]), _seen_up_to(reading))
            self._stalls[destination] = (fence, stall[1], cursor)
        else:  # the transaction below the fence ended: the batch claims take them
            self._stalls.pop(destination, None)
        return [r for r in rows if r[0] != -1]

    async def _take_batch(
        self, destination: str, limit: int, fence: int, ids_epoch: int
    ) -> list[asyncpg.Record]:
        """Run queries.CLAIM_BATCH up to ``fence`` in the epoch ``ids_epoch``; while it lost the
        race for the chain's end (another relay's claim added a batch from the end it read: its
        last row, id -1, says so), at once again, from the new end, at most LOST_TRIES times
        more, for what is left of ``limit``; the rows claimed by all of them."""
        rows: list[asyncpg.Record] = []
        for tries in range(1 + LOST_TRIES):
            if tries:
                self.statements["claim_lost"] += 1  # of the "claim" ones
            self.statements["claim"] += 1
            try:
                got = await self._call(
                    "fetch",
                    self.claim_batch,
                    destination,
                    limit - len(rows),
                    self.relay_id,
                    self.lease,
                    fence,
                    ids_epoch,
                )
            except Exception as exc:
                if not rows:
                    raise
                # What the tries before took has committed (see _claim_batch).
                self._deferred[destination] = exc
                break
            lost = any(r[0] == -1 for r in got)
            rows += [r for r in got if r[0] != -1] if lost else got
            if not lost or len(rows) >= limit:
                break
        return rows

    async def _new_epoch(self, epoch: tuple[object, ...]) -> asyncpg.Record:
        """A new table file (TRUNCATE), a new server (a restart, a failover) or, seen by the
        batch claims, a restarted sequence: ids may be handed out again below where the
        cursors stand, and the fence is read again from the
        start (the reading before capped its highest id with the old epoch's)."""
        self._reading = None
        self._epoch = epoch
        self.cursors.clear()
        self._stalls.clear()
        self._on_new_epoch()
        self.statements["fence"] += 1
        return await self._call("fetchrow", self.fence, self.table, 0)

    def _advance(
        self,
        destination: str,
        rows: Sequence[asyncpg.Record],
        limit: int,
        above: int,
        held: Collection[str],
    ) -> None:
        """Where ``destination``'s next claim starts, from the marker row of the claim that
        read ``rows``, and whether it drains (the claim filled its batch)."""
        # The marker row comes last (UNION ALL keeps its branches' order); found by its id.
        marker = rows[-1] if rows[-1][0] == -1 else next(r for r in rows if r[0] == -1)
        cursor, recheck = int(marker[2]), int(marker[4])
        rewind = self._rewinds.pop(destination, None)
        if rewind is not None:  # the sweep found rows below while this claim ran
            cursor, recheck = min(cursor, rewind), min(recheck, rewind)
        self.cursors[destination] = _Lane(cursor, recheck, above, frozenset(held))
        if len(rows) > limit:  # the marker and a full batch
            self._draining.add(destination)

    def fresh_cursor(self, destination: str) -> int:
        """Where the next claim of ``destination``'s fresh rows starts (0: no claim yet)."""
        return self.cursors.get(destination, _Lane()).cursor

    async def sweep(self) -> int:
        """Look below each destination's cursor for fresh rows its claims will not reach
        (ids handed out again: see queries.FRESH_BELOW) and walk from them again, and below
        each batched destination's chain for such rows (see queries.SWEEP_BATCHES), moved to
        the waiting lane; returns how many destinations had some. Under a held snapshot this
        reads every dead entry below the cursors and the chains' ends: the relay runs it
        every 30 minutes, off the claim's path."""
        found = 0
        for destination in sorted(self.batched):
            self.statements["sweep"] += 1
            if await self._call("fetch", self._sweep_batches, destination):
                found += 1
        for destination, lane in list(self.cursors.items()):
            self.statements["sweep"] += 1
            lowest = await self._call("fetchval", self._fresh_below, destination, lane.recheck)
            if lowest is not None:
                start = lowest - 1
                now = self.cursors.get(destination, lane)
                self.cursors[destination] = replace(
                    now, cursor=min(now.cursor, start), recheck=min(now.recheck, start)
                )
                if destination in self._claiming:
                    # The claim running now would write its own answer back over this.
                    self._rewinds[destination] = min(self._rewinds.get(destination, start), start)
                found += 1
        return found


def _seen_up_to(reading: asyncpg.Record) -> int:
    """Up to where a claim past the fence of the FENCE ``reading`` (made before its snapshot)
    has seen every row that will ever commit, but those of the transactions holding the fence
    (the batch claims' once they end): the claim's cursor may pass the ids of other inserts
    open at the reading, which commit out of id order all the time, and its next claims would
    never read them; they would wait for the transaction holding the fence (a bulk import: an
    hour; tests/test_batch_past_fence_review.py). Every row at or below this is visible: below
    the keys of the other inserts then open (a transaction's ids are above its key), and below
    the highest id then visible (an insert that began after the reading draws ids above it).
    When two transactions hold a key at the fence, either may end first and leave the fence
    where it is: the claims read from the fence."""
    fence, top = int(reading[0]), int(reading[3])
    keys = [k.rsplit("/", 1) for k in reading[4]]
    if len({vxid for vxid, key in keys if int(key) == fence}) > 1:
        return fence
    return min([top, *(int(key) for _, key in keys if int(key) > fence)])
