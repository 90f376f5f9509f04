"""The endpoints sink's statements (relay/db/queries/), over the relay's pool."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import asyncpg
import structlog

from outbox.errors import describe
from relay.db import queries
from relay.db.pool import transaction
from relay.db.store import DB_ERRORS, Store, in_id_order
from relay.sinks.endpoints.fairness import UNCAPPED
from relay.sinks.endpoints.lanes import FOUND_CHUNK, Floors
from relay.sinks.endpoints.rows import (
    Claimed,
    DeliveryRecord,
    RowLease,
    claimed_row,
    takes,
)

log = structlog.get_logger("relay.endpoints")

# How many leases after its lease ended a delivery this relay held is forgotten, if nothing
# recorded, released or lost it before.
FORGET_AFTER = 10
# How long the reaper's settle waits for a fan-out under way (FanOuts' statements take
# milliseconds, but one may wait long for the fan-outs' lock behind an open replay).
SETTLE_WAIT = 1.0


class DeliveryStore:
    def __init__(self, store: Store) -> None:
        self.store = store
        # Whether the last claim swept for deliveries of deleted or moved endpoints (it was
        # asked to, and its walk was not stopped early by a full batch).
        self.swept = False
        # The claim's fresh lane: one claim at a time reads and moves its floors.
        self.lanes = Floors()
        # Whether the last claim's read of fresh deliveries stopped short of the highest id.
        self.behind = False
        self._claiming = asyncio.Lock()
        self._at_once = asyncio.Lock()  # a fan-out that claims (fan_out_claiming), or settle
        self._serial = queries.serial_key(store.schema)
        # What this relay holds (DELIVERY_CLAIM's :held): each delivery it claimed, by id, with
        # its endpoint and the end of its lease (monotonic), until it is recorded, released or
        # lost at a heartbeat, or its lease ends.
        self._held: dict[int, tuple[int, int, float]] = {}  # id: endpoint, token, until
        # The events of fan-outs whose answer was lost, while what they claimed is not put
        # back (settle); and what settle calls once it put some back (the source's wake).
        self._unsettled: list[list[int]] = []
        self.on_put_back: Callable[[], None] = lambda: None

    @property
    def relay_id(self) -> str:
        return self.store.relay_id

    async def fan_out(self, events: Sequence[tuple[int, int]], no_match: str) -> dict[int, int]:
        """Deliveries for the matching endpoints of events this relay holds ((id, token)
        pairs), and the events recorded as delivered, in one statement (see FAN_OUT); the
        endpoints matched per event recorded. An event missing from the answer was no longer
        this relay's: nothing was written for it."""
        return (await self.fan_out_claiming(events, no_match, None))[0]

    async def fan_out_claiming(
        self,
        events: Sequence[tuple[int, int]],
        no_match: str,
        room: Mapping[int, int] | Callable[[], Mapping[int, int]] | None,
    ) -> tuple[dict[int, int], list[asyncpg.Record], float, float]:
        """:meth:`fan_out`, claiming as they are written each ``room`` endpoint's first
        ``room[id]`` deliveries, where none of its deliveries waits and no other relay holds
        one (``room`` may be a function, called once the fan-outs before this one are done:
        each then sees what the others claimed). Returns the endpoints matched per event
        recorded; the deliveries claimed (FAN_OUT's rows of endpoints -1); the end of their
        lease and the time just before the statement (monotonic)."""
        self.store.statements["fan_out"] += 1
        # In id order (see in_id_order): FAN_OUT records the events, beside their heartbeat.
        events = sorted(events)
        given: Mapping[int, int] = {}
        try:
            # One at a time, and never beside settle(): the rows it claims are held here
            # (below) before settle can look for rows held by nothing.
            async with self._at_once:
                given = (room() if callable(room) else room) or {}
                floors = self.lanes.floors
                if floors is None:
                    given = {}  # the floors say where a backlog waits: none sent before them
                args = (
                    [i for i, _ in events],
                    [t for _, t in events],
                    self.relay_id,
                    no_match,
                    self._serial,
                    list(given),
                    list(given.values()),
                    [(floors or {}).get(e, self.lanes.seen) for e in given],
                    self.store.lease,
                )
                if given:
                    lock = queries.FAN_OUT_LOCK
                    rows, started = await self._after(lock, "fetch", queries.FAN_OUT, *args)
                else:
                    started = time.monotonic()
                    rows = await self.store.call("fetch", queries.FAN_OUT, *args)
                # Once the lock was held: not later than the statement's own time.
                until = started + self.store.lease
                sent = [r for r in rows if r[1] == -1]
                for r in sent:
                    self._held[r[0]] = (r[4], 1, until)
        except DB_ERRORS:
            if given:
                # Committed, perhaps: what it claimed is held by nothing here.
                self._unsettled.append([i for i, _ in events])
                await self.settle()
            raise
        except asyncio.CancelledError:
            if given:
                # As above, but nothing more may be awaited here: settled at the reaper's
                # next pass (DeliverySource.reap). A relay stopping leaves them to the lease.
                self._unsettled.append([i for i, _ in events])
            raise
        return {r[0]: r[1] for r in rows if r[1] != -1}, sent, until, started

    async def enabled(
        self, destinations: Sequence[str]
    ) -> tuple[dict[str, dict[int, bool]], dict[int, tuple[str | None, tuple[str, ...]]]]:
        """The enabled endpoints of ``destinations`` (ENDPOINTS_ENABLED): per destination, each
        endpoint's id and whether it is rate-limited; and per endpoint, the tenant and the
        event types it takes."""
        self.store.statements["endpoints_enabled"] += 1
        rows = await self.store.call("fetch", queries.ENDPOINTS_ENABLED, list(destinations))
        out: dict[str, dict[int, bool]] = {d: {} for d in destinations}
        takes: dict[int, tuple[str | None, tuple[str, ...]]] = {}
        for r in rows:
            out[r[1]][r[0]] = r[2]
            takes[r[0]] = (r[3], tuple(r[4] or ()))
        return out, takes

    async def ahead(self, destination: str, after: int, n: int) -> set[int] | None:
        """The endpoints that ``destination``'s waiting events would reach, the fresh ones
        after ``after`` (ENDPOINTS_AHEAD); None if more than ``n`` wait in a lane (not every
        one was read)."""
        self.store.statements["endpoints_ahead"] += 1
        row = await self.store.call("fetchrow", queries.ENDPOINTS_AHEAD, destination, after, n)
        if row[0] >= n or row[1] >= n:
            return None
        return set(row[2])

    async def settle(self, wait: bool = True) -> None:
        """Put back what fan-outs whose answer was lost claimed (FAN_OUT_SETTLE), if any is
        left to settle: at once, and at each reaper's pass until it is done (before the
        lease ends, the reaper would count an attempt never made). Without ``wait`` (the
        reaper's pass), after the fan-out under way, if any, but not for longer than
        SETTLE_WAIT (it may wait long for the fan-outs' lock, behind an application's open
        replay): at the next pass then. Never raises."""
        while self._unsettled:
            # No claim or fan-out of this relay's is half-way: every row it claimed so far is
            # in _held. The fan-outs' lock first: waiting for it, no claim waits. Waited for
            # (fan-outs back to back, as in a drain, never leave it free at a given moment).
            try:
                async with asyncio.timeout(None if wait else SETTLE_WAIT):
                    await self._at_once.acquire()
            except TimeoutError:
                return
            try:
                events = self._unsettled[0]
                async with self._claiming:
                    held = list(self._held)
                    rows = await self.store.call(
                        "fetch", queries.FAN_OUT_SETTLE, events, self.relay_id, held
                    )
            except DB_ERRORS as exc:
                log.warning(
                    "relay.endpoints.fan_out_unsettled", events=len(events), error=describe(exc)
                )
                return
            finally:
                self._at_once.release()
            self._unsettled.pop(0)
            if rows:
                log.info("relay.endpoints.fan_out_settled", deliveries=len(rows))
                # Put back claimed once: the looks for fresh deliveries do not see them.
                self.on_put_back()

    async def _after(self, lock: str, method: str, sql: str, *args: Any) -> tuple[Any, float]:
        """``sql`` in a transaction that takes ``lock`` (the in-flight lock: FAN_OUT_LOCK or
        DELIVERY_CLAIM_LOCK) first, alone: its snapshot is taken once the lock is held. Its
        answer, and when the lock was held (monotonic: before the statement's own time, from
        which it writes leases)."""
        schema = self.store.schema
        begin = queries.begin_locked(queries.render_ops(lock, schema), self._serial)
        async with transaction(self.store.pool, begin) as conn:
            locked = time.monotonic()
            return await getattr(conn, method)(queries.render_ops(sql, schema), *args), locked

    def holding(self) -> int:
        """How many deliveries this relay holds (claimed, not yet recorded or released)."""
        return len(self._held)

    async def claim(
        self,
        destinations: Sequence[str],
        max_concurrency: Sequence[int],
        start: Sequence[int],
        limit: int,
        skip: Sequence[int],
        scan: int,
        cursor: int | None,
        caps: Mapping[int, int],
        skip_tenants: Sequence[str] = (),
        ahead: int = 1,
        ahead_room: int | None = None,
        sweep: bool = True,
    ) -> tuple[list[Claimed], int | None, int]:
        """Due deliveries (see DELIVERY_CLAIM: ``caps`` are the known endpoints' caps on
        requests in flight, ``start`` each destination's cap for the others, ``skip`` and
        ``skip_tenants`` endpoints and tenants that take nothing now, ``ahead`` how many times
        its room an endpoint known to be fast, and held by no other relay, is claimed for, and
        ``ahead_room`` how many rows it may claim in all when it takes rows ahead);
        the cursor for the next claim; and how many deliveries of deleted or moved endpoints
        were cancelled on the way (looked for with ``sweep`` only)."""
        async with self._claiming:
            if self.lanes.floors is None:
                await self._read_floors()
            given = (dict(self.lanes.floors or {}), self.lanes.epoch)
            self.store.statements["delivery_claim"] += 1
            limits = {str(k): v for k, v in caps.items()}
            limits.update((str(k), 0) for k in skip)
            lease = self.store.lease
            rows, started = await self._claim(
                destinations, max_concurrency, start, limit, scan, cursor, limits,
                skip_tenants, ahead, ahead_room, sweep, given[0],
            )  # fmt: skip
            until = started + lease  # before the statement: never later than its lease
            marker = rows[-1]
            for r in rows:
                if r[0] >= 0:
                    self._held[r[0]] = (r[2], r[5], until)
            next_floors = ((r[2], r[1]) for r in rows if r[0] == -2)
            self._read_on(next_floors, marker[9], marker[10], given)
        claimed = [claimed_row(r, until, started) for r in rows if r[0] >= 0]
        self.swept = bool(marker[7])
        return claimed, marker[2], marker[1]

    async def look(self) -> bool:
        """Whether a claim would find fresh deliveries pending that no floor of this relay's
        tells of (another relay's fan-out wrote them: DELIVERY_LOOK). Finding none, ``seen``
        moves on as the claim's would; True also while the floors are not read, or when the
        look read a chunk short of the highest id (the claim reads on)."""
        async with self._claiming:
            if self.lanes.floors is None:
                return True
            given = (dict(self.lanes.floors), self.lanes.epoch)
            self.store.statements["delivery_look"] += 1
            rows = await self.store.call(
                "fetch", queries.DELIVERY_LOOK, self.lanes.seen, FOUND_CHUNK
            )
            if len(rows) > 1:
                return True  # some found: the claim reads them (from the same :seen)
            return not self._read_on((), rows[0][1], rows[0][2], given) or self.behind

    def _read_on(
        self,
        floors: Iterable[tuple[int, int | None]],
        seen_top: str,
        epoch: str,
        given: tuple[dict[int, int], str | None],
    ) -> bool:
        """After a claim or a look: the floors it gave, how far it read (``seen_top``,
        "seen:top") and the ids' epoch kept (Floors.claimed). False when the floors are to be
        read again (ids handed out again)."""
        seen, top = (int(x) for x in seen_top.split(":"))
        self.behind = seen < top
        if self.lanes.claimed(floors, seen, epoch, given):
            return True
        log.warning(
            "relay.endpoints.floors_reset",
            reason="the deliveries' ids were handed out again (a TRUNCATE … RESTART "
            "IDENTITY, a restore, a failover, a restart), or the newest deliveries "
            "were deleted: the claim's floors are read again",
        )
        return False

    async def check_floors(self) -> None:
        """The floors checked whole (DELIVERY_FLOORS) when CHECK_EVERY has passed since the
        last time: the reaper's pass runs it, beside the claims (under a held snapshot it
        reads every dead entry of the fresh lane, and must not hold them up)."""
        now = time.monotonic()
        if self.lanes.floors is not None and self.lanes.due(now):
            # Checked again after CHECK_EVERY, even if this one fails (a timeout under a
            # held snapshot would otherwise be tried at every pass).
            self.lanes.checked_at = now
            await self._read_floors((dict(self.lanes.floors), self.lanes.seen))

    async def _read_floors(self, before: tuple[dict[int, int], int] | None = None) -> None:
        """Every endpoint's first fresh delivery pending and the highest id (DELIVERY_FLOORS),
        taken as the lane's floors or checked against them."""
        self.store.statements["delivery_floors"] += 1
        rows = await self.store.call("fetch", queries.DELIVERY_FLOORS)
        [(_, top, epoch)] = [r for r in rows if r[0] == -1]
        firsts = [(r[0], r[1]) for r in rows if r[0] != -1]
        if before is None:
            self.lanes.checked_at = time.monotonic()
        missed = self.lanes.read(firsts, top, epoch, before)
        if missed:
            log.warning(
                "relay.endpoints.deliveries_below_floor",
                endpoints=missed,
                reason="fresh deliveries were written below where the claim had read (a "
                "transaction writing deliveries by hand committed late, or ids were handed "
                "out again): claimed from now on",
            )

    async def _claim(
        self,
        destinations: Sequence[str],
        max_concurrency: Sequence[int],
        start: Sequence[int],
        limit: int,
        scan: int,
        cursor: int | None,
        limits: Mapping[str, int],
        skip_tenants: Sequence[str],
        ahead: int,
        ahead_room: int | None,
        sweep: bool,
        floors: Mapping[int, int],
    ) -> tuple[list[asyncpg.Record], float]:
        """DELIVERY_CLAIM's rows: those claimed, each next floor (-2), the marker (-1); and
        when its lock was held (monotonic)."""
        # After the in-flight lock, shared: every fan-out that sent deliveries at once
        # committed before this claim's snapshot, or waits for this claim (FAN_OUT_LOCK).
        answer: tuple[list[asyncpg.Record], float] = await self._after(
            queries.DELIVERY_CLAIM_LOCK,
            "fetch",
            queries.DELIVERY_CLAIM,
            list(destinations),
            list(max_concurrency),
            limit,
            self.relay_id,
            json.dumps(limits, separators=(",", ":")),
            scan,
            cursor,
            self.store.lease,
            list(skip_tenants),
            list(start),
            ahead,
            UNCAPPED,
            limit if ahead_room is None else ahead_room,
            sweep,
            json.dumps({str(k): v for k, v in floors.items()}, separators=(",", ":")),
            self.lanes.seen,
            FOUND_CHUNK,
            self._holding(),
        )
        return answer

    def _holding(self) -> str:
        """How many deliveries this relay holds of each endpoint under a live lease, as
        DELIVERY_CLAIM takes them (:held); those whose lease ended long ago are forgotten."""
        now = time.monotonic()
        counts: dict[str, int] = {}
        for row_id, (endpoint, _, until) in list(self._held.items()):
            if until > now:
                counts[str(endpoint)] = counts.get(str(endpoint), 0) + 1
            elif until <= now - FORGET_AFTER * self.store.lease:
                # Kept a while after its lease ended: a heartbeat that comes late (the relay
                # stalled) may still renew it, and it counts again.
                del self._held[row_id]
        return json.dumps(counts, separators=(",", ":"))

    async def record(self, records: Sequence[DeliveryRecord]) -> set[tuple[int, int]]:
        """Write outcomes and log attempts; the (id, token) pairs recorded (the others were no
        longer this relay's under their claim)."""
        records = in_id_order(records)
        self.store.statements["delivery_record"] += 1
        rows = await self.store.call(
            "fetch",
            queries.DELIVERY_RECORD,
            [r.id for r in records],
            [r.token for r in records],
            [r.status for r in records],
            [r.counted for r in records],
            [r.delay for r in records],
            [r.error for r in records],
            [r.http_status for r in records],
            [r.event_id for r in records],
            [r.endpoint_id for r in records],
            [r.duration_ms for r in records],
            [r.response for r in records],
            [r.replay for r in records],
            self.relay_id,
        )
        for r in records:
            self._forget(r.id, r.token)
        return {(r[0], r[1]) for r in rows}

    async def heartbeat(self, held: Sequence[tuple[int, int]]) -> set[int]:
        """Extend the leases of (id, token) pairs; the ids still held."""
        held = sorted(held)  # in id order: see in_id_order
        self.store.statements["delivery_heartbeat"] += 1
        until = time.monotonic() + self.store.lease  # before the statement, as a claim's
        rows = await self.store.call(
            "fetch",
            queries.DELIVERY_HEARTBEAT,
            [i for i, _ in held],
            [t for _, t in held],
            self.relay_id,
            self.store.lease,
        )
        kept = {r[0] for r in rows}
        for row_id, token in held:
            mine = self._held.get(row_id)
            if row_id not in kept:
                self._forget(row_id, token)
            elif mine is not None and mine[1] == token:
                self._held[row_id] = (mine[0], token, until)
        return kept

    def _forget(self, row_id: int, token: int) -> None:
        """A delivery of this relay's claim ``token`` no longer held: a later claim of the
        same row (its lease ran out, it was put back and claimed again) stays counted."""
        mine = self._held.get(row_id)
        if mine is not None and mine[1] == token:
            del self._held[row_id]

    async def release(self, held: Sequence[tuple[int, int]]) -> None:
        """Put (id, token) pairs back to pending, unattempted."""
        held = sorted(held)  # in id order: see in_id_order
        self.store.statements["delivery_release"] += 1
        await self.store.call(
            "execute",
            queries.DELIVERY_RELEASE,
            self.relay_id,
            [i for i, _ in held],
            [t for _, t in held],
        )
        for row_id, token in held:
            self._forget(row_id, token)

    async def reap(
        self,
        default_max: int,
        limits: Mapping[str, int],
        limit: int = 5000,  # the reaper's REAP_LIMIT: fewer reaped, the pass was complete
        within: float | None = None,
    ) -> int:
        """Deliveries whose lease expired put back (DELIVERY_REAP), at most ``limit``; with
        ``within``, only leases that ended in the last ``within`` seconds. How many."""
        self.store.statements["delivery_reap"] += 1
        rows = await self.store.call(
            "fetch",
            queries.DELIVERY_REAP,
            default_max,
            limit,
            list(limits),
            list(limits.values()),
            within,
        )
        return len(rows)

    async def health(self, changes: Mapping[int, bool]) -> dict[int, float | None]:
        """Write endpoints' health; seconds each has been failing (None: it is not)."""
        self.store.statements["endpoint_health"] += 1
        rows = await self.store.call(
            "fetch", queries.ENDPOINT_HEALTH, list(changes), list(changes.values())
        )
        return {r[0]: r[1] for r in rows}

    async def circuits(self, changes: Mapping[int, float | None]) -> None:
        """Write circuits that opened (seconds until their probe) or closed (None)."""
        self.store.statements["endpoint_circuit"] += 1
        await self.store.call(
            "execute",
            queries.ENDPOINT_CIRCUIT,
            list(changes),
            [v is not None for v in changes.values()],
            [v or 0.0 for v in changes.values()],
        )

    async def disable(self, endpoint_id: int, reason: str, failing_for: float | None) -> bool:
        self.store.statements["endpoint_disable"] += 1
        row = await self.store.call(
            "fetchval", queries.ENDPOINT_DISABLE, endpoint_id, reason, failing_for
        )
        return row is not None


__all__ = ["Claimed", "DeliveryRecord", "DeliveryStore", "RowLease", "takes"]
