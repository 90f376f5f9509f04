"""The endpoints sink's statements (relay/db/queries/), over the relay's pool."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import structlog

from relay.db import queries
from relay.db.pool import connection
from relay.db.store import Record, Store, read_headers
from relay.model import Envelope, Lease
from relay.sinks.endpoints.fairness import UNCAPPED
from relay.sinks.endpoints.lanes import FOUND_CHUNK, Floors

log = structlog.get_logger("relay.endpoints")

# How many leases after its lease ended a delivery this relay held is forgotten, if nothing
# recorded, released or lost it before.
FORGET_AFTER = 10


class RowLease(Lease):
    """The hold of one delivery's claim: each delivery has a Lease of its own, so any loss
    noted in it is this row's. The pipeline notes a loss under the delivery's id
    (Leases.lose) while the request checks the event's (Envelope.held: a delivery is sent
    as its event): either way, a lost delivery is not sent."""

    __slots__ = ()

    def held(self, row_id: int) -> bool:
        return not self.lost and time.monotonic() < self.until


@dataclass(slots=True, eq=False)
class Claimed:
    """One delivery (an event for one endpoint) this relay claimed, with what sending needs.
    It is a :class:`relay.db.leasing.Held` (deliveries have no ordered keys)."""

    id: int
    event_id: int
    endpoint_id: int
    destination: str
    attempts: int
    token: int
    replay: bool
    found: bool  # False: the event was deleted (purged) before it could be sent
    payload: bytes
    content_type: str
    headers: object
    created_at: float
    url: str
    secret: str
    previous_secret: str | None
    rate_limit: int | None
    lease: Lease
    lease_started: float = 0.0  # monotonic time just before the claim statement
    sending: bool = False  # its request started (a stop cuts it short: counted)
    event_type: str | None = None  # the event's (None: it has none, or was deleted)
    tenant: str | None = None  # the endpoint's (None: it takes every tenant)
    event_types: tuple[str, ...] = ()  # the endpoint's (none: every type)
    event_tenant: str | None = None  # the event's
    key: str | None = None  # no ordered keys among deliveries


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see relay/model.py
class DeliveryRecord(Record):
    """One delivery's outcome as DELIVERY_RECORD takes it, with its attempt for the log: a
    Record (the pipeline's Completer and Leases write and settle it as one), whose status may
    also be ``cancelled``, and whose ``counted`` may be 2 (NOT_SENT: tried, nothing sent,
    logged but not counted among its attempts)."""

    http_status: int | None = None
    event_id: int = 0
    endpoint_id: int = 0
    duration_ms: float | None = None
    response: str | None = None
    replay: bool = False


def takes(
    tenant: str | None,
    event_types: Sequence[str],
    event_tenant: str | None,
    event_type: str | None,
) -> bool:
    """Whether an endpoint of ``tenant`` and ``event_types`` takes an event of
    ``event_tenant`` and ``event_type``: the rule of the fan-out (FAN_OUT)."""
    if tenant is not None and tenant != event_tenant:
        return False
    return not event_types or event_type in event_types


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
        self._serial = queries.serial_key(store.schema)
        # What this relay holds (DELIVERY_CLAIM's :held): each delivery it claimed, by id, with
        # its endpoint and the end of its lease (monotonic), until it is recorded, released or
        # lost at a heartbeat, or its lease ends.
        self._held: dict[int, tuple[int, int, float]] = {}  # id: endpoint, token, until

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
        room: Mapping[int, int] | None,
    ) -> tuple[dict[int, int], list[asyncpg.Record], float, float]:
        """:meth:`fan_out`, claiming as they are written each ``room`` endpoint's first
        ``room[id]`` deliveries, where none of its deliveries waits and no other relay holds
        one. Returns the endpoints matched per event recorded; the deliveries claimed
        (FAN_OUT's rows of endpoints -1); the end of their lease and the time just before
        the statement (monotonic)."""
        self.store.statements["fan_out"] += 1
        floors = self.lanes.floors
        if floors is None or room is None:
            room = {}  # the floors say where a backlog waits: none sent at once before them
        args = (
            [i for i, _ in events],
            [t for _, t in events],
            self.relay_id,
            no_match,
            self._serial,
            list(room),
            list(room.values()),
            [(floors or {}).get(e, self.lanes.seen) for e in room],
            self.store.lease,
        )
        started = time.monotonic()
        until = started + self.store.lease  # before the statement: never later than its now()
        if room:
            rows = await self._after(queries.FAN_OUT_LOCK, "fetch", queries.FAN_OUT, *args)
        else:
            rows = await self.store.call("fetch", queries.FAN_OUT, *args)
        sent = [r for r in rows if r[1] == -1]
        for r in sent:
            self._held[r[0]] = (r[4], 1, until)
        return {r[0]: r[1] for r in rows if r[1] != -1}, sent, until, started

    async def _after(self, lock: str, method: str, sql: str, *args: Any) -> Any:
        """``sql`` in a transaction that takes ``lock`` (the in-flight lock: FAN_OUT_LOCK or
        DELIVERY_CLAIM_LOCK) first, alone: its snapshot is taken once the lock is held."""
        schema = self.store.schema
        async with connection(self.store.pool) as conn, conn.transaction():
            await conn.execute(queries.render_ops(lock, schema), self._serial)
            return await getattr(conn, method)(queries.render_ops(sql, schema), *args)

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
            started = time.monotonic()
            until = started + lease  # before the statement: never later than its now()
            rows = await self._claim(
                destinations, max_concurrency, start, limit, scan, cursor, limits,
                skip_tenants, ahead, ahead_room, sweep, given[0],
            )  # fmt: skip
            marker = rows[-1]
            for r in rows:
                if r[0] >= 0:
                    self._held[r[0]] = (r[2], r[5], until)
            next_floors = ((r[2], r[1]) for r in rows if r[0] == -2)
            seen, top = (int(x) for x in marker[9].split(":"))
            self.behind = seen < top
            if not self.lanes.claimed(next_floors, seen, marker[10], given):
                log.warning(
                    "relay.endpoints.floors_reset",
                    reason="the deliveries' ids were handed out again (a TRUNCATE … RESTART "
                    "IDENTITY, a restore, a failover, a restart), or the newest deliveries "
                    "were deleted: the claim's floors are read again",
                )
        claimed = [_claimed(r, until, started) for r in rows if r[0] >= 0]
        self.swept = bool(marker[7])
        return claimed, marker[2], marker[1]

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
    ) -> list[asyncpg.Record]:
        """DELIVERY_CLAIM's rows: those claimed, each next floor (-2), the marker (-1)."""
        # After the in-flight lock, shared: every fan-out that sent deliveries at once
        # committed before this claim's snapshot, or waits for this claim (FAN_OUT_LOCK).
        rows: list[asyncpg.Record] = await self._after(
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
        return rows

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


def sent_at_once(r: asyncpg.Record, event: Envelope, until: float, started: float) -> Claimed:
    """A delivery FAN_OUT claimed as it wrote it (a row of endpoints -1), of ``event``."""
    return Claimed(
        id=r[0],
        event_id=r[3],
        endpoint_id=r[4],
        destination=event.destination,
        attempts=0,
        token=1,
        replay=False,
        found=True,
        payload=event.payload,
        content_type=event.content_type,
        headers=event.headers,
        created_at=event.created,
        url=r[5],
        secret=r[6],
        previous_secret=r[7],
        rate_limit=None,  # FAN_OUT sends none of a rate-limited endpoint at once
        lease=RowLease(until),
        lease_started=started,
        event_type=event.event_type,
        tenant=r[8],
        event_types=tuple(r[9] or ()),
        event_tenant=r[10],
    )


def _claimed(r: asyncpg.Record, until: float, started: float) -> Claimed:
    """A row of DELIVERY_CLAIM, held until ``until`` (monotonic) by the claim made at
    ``started``."""
    return Claimed(
        id=r[0],
        event_id=r[1],
        endpoint_id=r[2],
        destination=r[3],
        attempts=r[4],
        token=r[5],
        replay=r[6],
        found=r[7],
        payload=r[8] or b"",
        content_type=r[9] or "application/octet-stream",
        headers={} if r[10] in (None, "{}") else read_headers(r[10]),
        created_at=r[11] or 0.0,
        url=r[12],
        secret=r[13],
        previous_secret=r[14],
        rate_limit=r[15],
        lease=RowLease(until),
        lease_started=started,
        event_type=r[16],
        tenant=r[17],
        event_types=tuple(r[18] or ()),
        event_tenant=r[19],
    )


__all__ = ["Claimed", "DeliveryRecord", "DeliveryStore", "RowLease", "sent_at_once", "takes"]
