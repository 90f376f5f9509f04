"""The claim loop: claim what the sinks can take, hand it to delivery, and wait for more.

A claim is one statement per destination (``SELECT … FOR UPDATE SKIP LOCKED`` and the update
that marks the rows running, committed before any delivery). The loop holds at most
``max_in_flight`` rows, skips destinations that are paused or whose circuit is open, and
wakes on a NOTIFY, a poll interval, or freed capacity.

Other sources of rows (:class:`Feed`: a sink's table, as endpoint deliveries) are claimed
in a loop of their own beside the destinations', each into leases of its own and within a
room of its own.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import asyncpg
import structlog

from outbox.errors import describe
from relay.config import RelaySettings
from relay.db.leasing import Held
from relay.db.store import DB_ERRORS, Store
from relay.model import Envelope
from relay.obs.metrics import Metrics
from relay.pipeline.leases import Leases
from relay.pipeline.ordered import (
    MEMORY_CAP,
    PEERS_SEEN_WITHIN,
    WALK_AT_MOST,
    WALK_FIRST,
    Mode,
    Ownership,
)
from relay.pipeline.routes import Route
from relay.sinks.source import Source

log = structlog.get_logger("relay")

H = TypeVar("H", bound=Held)


@dataclass(eq=False, slots=True)
class Feed(Generic[H]):
    """A source of rows the claimer claims beside the destinations' events: into its own
    ``leases`` (its ids may equal events' ids), at most ``max_in_flight`` of them held at
    once, handed to its own ``dispatch``.

    It is claimed in a loop of its own beside the destinations' (Claimer.run), when it says
    it is due (it wakes that loop through :meth:`Claimer.wake_sources`), a poll interval
    after its last claim, and at once again while it may have more; within its own room,
    whatever the events hold; rows leaving it wake the loop once its room is taken. A failing
    claim backs off this source alone.
    """

    source: Source[H]
    leases: Leases[H]
    dispatch: Callable[[Sequence[H]], None]
    max_in_flight: int
    claimed_at: float = float("-inf")  # monotonic time of its last claim
    more: bool = False  # its last claim came back full: more rows may wait
    retry_at: float = 0.0  # while its claims fail: not claimed before this (monotonic)
    retry: float = 0.1  # the next backoff, doubling to 5 s while its claims fail


async def wait_for(
    stopping: asyncio.Event, events: Sequence[asyncio.Event], timeout: float | None
) -> None:
    """Sleep until one of ``events``, ``stopping``, or ``timeout``; whichever comes first."""
    waits = [asyncio.ensure_future(e.wait()) for e in (stopping, *events)]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class Claimer:
    def __init__(
        self,
        settings: RelaySettings,
        routes: Mapping[str, Route],
        store: Store,
        leases: Leases[Envelope],
        dispatch: Callable[[list[Envelope]], None],
        paused: Callable[[], frozenset[str]],
        metrics: Metrics,
        stats: Counter[str],
        stopping: asyncio.Event,
        sources: Sequence[Feed[Any]] = (),
    ) -> None:
        self.settings = settings
        self.routes = routes
        self.store = store
        self.leases = leases
        self.dispatch = dispatch
        self.paused = paused
        self.metrics = metrics
        self.stats = stats
        self.stopping = stopping
        self.sources = list(sources)
        self.wakeup = asyncio.Event()
        self.sources_wakeup = asyncio.Event()
        # Why the last claim failed, while claims fail (readiness reports it).
        self.error: str | None = None
        self._db_down = False
        self._scan_progressed = False
        # Per ordered destination, its walk over the keys: the key after which the next claim
        # goes on, and the key where the round ends (see _claim_one).
        self._walks: dict[str, tuple[str | None, str | None]] = {}
        # Ordered destinations whose round ended short of a full batch, and until when they
        # rest (monotonic time): not walked again before a wake-up or a poll interval, while
        # other destinations' claims go on.
        self._resting: dict[str, float] = {}
        # Ordered destinations this relay owns (see relay/pipeline/ordered.py).
        self._owners: dict[str, Ownership] = {}
        self._turn = 0  # rotates which destination claims first
        self._waiting_for_room = False  # a destination was skipped because its sink is full

    def wake(self) -> None:
        self.wakeup.set()

    def wake_sources(self) -> None:
        """A source came due (its rows are claimable: a fan-out, an outcome that freed an
        endpoint's room, a reap): claim the sources, not the events."""
        self.sources_wakeup.set()

    def key_finished(self) -> None:
        """A head of an ordered key was recorded: its key's next row is the head now, and is
        claimed at once, not at the next poll (nothing NOTIFYs for an update)."""
        if self._walks or self._owners:
            self.wake()

    def claimable(self) -> list[str]:
        paused = self.paused()
        names = [name for name in self.routes if name not in paused]
        ready = [name for name in names if self.routes[name].sink.available(name)]
        # A sink that is full now takes more when rows leave it: then wake, not at the poll.
        self._waiting_for_room = len(ready) < len(names)
        return ready

    async def run(self) -> None:
        """Claim until stopped: the destinations in one loop, the sources (if any) in
        another beside it, so that neither waits for the other's statements, errors or
        backoff. Returns once both have seen the stop (neither is cancelled mid-claim: rows
        a claim took must be held); raises what crashed one of them, the other cancelled
        (the relay stops on it)."""
        loops = {asyncio.create_task(self._claim_events(), name="claimer:events")}
        if self.sources:
            loops.add(asyncio.create_task(self._serve_sources(), name="claimer:sources"))
        try:
            done, _ = await asyncio.wait(loops, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in loops:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
        for t in done:
            t.result()

    async def _claim_events(self) -> None:
        rs = self.settings
        retry = 0.1
        capacity = self.leases.capacity
        while not self.stopping.is_set():
            # Cleared before the state is read: rows leaving after this wake the waits below.
            capacity.clear()
            free = rs.max_in_flight - len(self.leases)
            if free <= 0:
                await wait_for(self.stopping, [capacity], None)
                continue
            destinations = self.claimable()
            if not destinations:
                # Every sink is full (or paused, or its circuit open): rows leaving a sink
                # make room, so they wake the claim as a NOTIFY does, not the next poll. A
                # NOTIFY already noted stays set for the next claim, and is not waited on
                # again (that would spin).
                events = [capacity] if self.wakeup.is_set() else [self.wakeup, capacity]
                await wait_for(self.stopping, events, rs.poll_interval)
                continue
            limit = min(rs.batch_size, free)
            # Cleared before the claim: a NOTIFY that lands while it runs triggers another.
            if self.wakeup.is_set():
                self._new_rounds()
            self.wakeup.clear()
            batch, error = await self._claim(destinations, limit)
            if batch:
                # Claimed and committed: these rows are delivered even when a later
                # destination's claim failed, never left to wait for their lease.
                self._claimed(batch)
                # Let the deliveries start, so a sink that is now full says so (available())
                # before the next claim: claims follow the sinks' free capacity.
                await asyncio.sleep(0)
            if error is not None:
                self._failed(error, retry)
                await wait_for(self.stopping, [], retry)
                retry = min(retry * 2, 5.0)
                continue
            retry = 0.1
            self._database_up()
            if len(batch) < limit and not self._scan_progressed:
                events = [self.wakeup, capacity] if self._waiting_for_room else [self.wakeup]
                await wait_for(self.stopping, events, rs.poll_interval * random.uniform(0.8, 1.2))
                self._new_rounds()

    async def _serve_sources(self) -> None:
        """The sources' claims: each in its own room, when it comes due (``wake_sources``),
        at its poll, and at once again while it may have more; rows leaving a full one wake
        it. A source's failure is its own: logged, and that source alone backs off."""
        rs = self.settings
        while not self.stopping.is_set():
            self.sources_wakeup.clear()
            full, more, retry_in = await self._claim_sources()
            if more:
                await asyncio.sleep(0)  # claimed again at once, the events' loop let in
                continue
            timeout = min(rs.poll_interval, retry_in)
            await wait_for(self.stopping, [self.sources_wakeup, *full], timeout)

    async def _claim(
        self, destinations: list[str], limit: int
    ) -> tuple[list[Envelope], BaseException | None]:
        """One claim per destination, in an order that rotates from claim to claim, until the
        batch is full: a destination with a full batch always waiting cannot starve the
        others, and each claim reads only its own destination's part of the index.

        Returns what was claimed and the error that stopped it, if one did: rows already
        claimed for earlier destinations are committed and must still be delivered."""
        self._take_dropped()
        self._turn += 1
        start = self._turn % len(destinations)
        batch: list[Envelope] = []
        self._scan_progressed = False
        now = time.monotonic()
        for dest in destinations[start:] + destinations[:start]:
            if self._resting.get(dest, 0.0) > now:
                continue
            if len(batch) >= limit:
                self._scan_progressed = True  # the others' turn comes at once
                break
            route = self.routes[dest]
            # A sink whose deliveries take room of their own (endpoints) may take fewer now.
            take = route.sink.claim_limit(dest, limit - len(batch))
            if take <= 0:
                continue
            try:
                batch += await self._claim_one(route, take)
            except Exception as exc:
                return batch, exc
        return batch, None

    async def _claim_sources(self) -> tuple[list[asyncio.Event], bool, float]:
        """Claim each source that is due, or was last claimed a poll interval ago, within its
        own room; one that failed not before its backoff. What one claims is held and
        dispatched at once, before the next source's claim. Returns the capacity events of the
        sources whose room is taken (rows leaving them make room), whether one may have more
        to claim at once, and how soon a source backing off may be claimed again."""
        rs = self.settings
        now = time.monotonic()
        full: list[asyncio.Event] = []
        more = False
        retry_in = float("inf")
        for feed in self.sources:
            if self.stopping.is_set():
                break  # a claim now would hand rows to a stopping relay
            # Nothing waits for a source's rows let go unrecorded (no ordered keys): drop them.
            feed.leases.take_dropped()
            feed.leases.capacity.clear()
            room = feed.max_in_flight - len(feed.leases)
            if room <= 0:
                full.append(feed.leases.capacity)
                continue
            if feed.retry_at > now:
                retry_in = min(retry_in, feed.retry_at - now)
                continue
            due = feed.more or feed.source.due or now - feed.claimed_at >= rs.poll_interval
            if not due:
                continue
            feed.claimed_at = now
            limit = min(rs.batch_size, room)
            try:
                items = await feed.source.claim(limit, feed.leases)
            except Exception as exc:
                feed.more = False
                retry_in = min(retry_in, self._source_failed(feed, exc))
                continue
            if feed.retry_at:
                feed.retry_at, feed.retry = 0.0, 0.1
                log.info("relay.source.claim_recovered", source=feed.source.name)
            # More may wait: claim it again at once, after a full claim or while it says it is
            # still due (a walk it left off mid-way).
            feed.more = len(items) >= limit or feed.source.due
            more |= feed.more
            if items:
                feed.leases.claimed(items)
                log.debug("relay.source.claimed", source=feed.source.name, count=len(items))
                feed.dispatch(items)
        return full, more, retry_in

    def _source_failed(self, feed: Feed[Any], error: BaseException) -> float:
        """A source's claim failed: logged (once while it keeps failing) and that source
        backs off; the destinations' claims and readiness are not its. Returns the delay."""
        delay = feed.retry
        if not feed.retry_at:
            if isinstance(error, DB_ERRORS):
                log.error(
                    "relay.source.claim_failed",
                    source=feed.source.name,
                    error=describe(error),
                    retry_in=round(delay, 1),
                    action="retrying with backoff; its rows held stay leased",
                )
            else:
                log.error(
                    "relay.source.claim_crashed",
                    source=feed.source.name,
                    error=describe(error),
                    exc_info=error,
                )
                self.metrics.delivery_errors.inc()
        feed.retry_at = time.monotonic() + delay
        feed.retry = min(delay * 2, 5.0)
        return delay

    async def _claim_one(self, route: Route, limit: int) -> list[Envelope]:
        if not route.ordered:
            return await self.store.claim(route.name, limit)
        owner = await self._ownership(route.name)
        if owner is None:
            # Another relay owns it: this one stands by, and tries again after a poll.
            self._resting[route.name] = time.monotonic() + self.settings.poll_interval
            return []
        if owner.mode is Mode.OWNED:
            return await self._claim_owned(route, limit, owner)
        rows = await self._walk(route, limit)
        if owner.capped and not owner.peers and time.monotonic() >= owner.walk_until:
            owner.owned_again(route.name)  # reads fresh rows again, from the start
        return rows

    async def _ownership(self, destination: str) -> Ownership | None:
        """This relay's ownership of ordered ``destination`` (None: another relay's), taken
        if free, with the mode its claims take now."""
        store = self.store
        owner = self._owners.get(destination)
        if owner is not None and not store.owns(destination):
            del self._owners[destination]  # its connection ended: taken again afresh
            owner = None
        if owner is None:
            try:
                taken = await store.own(destination)
            except asyncpg.TooManyConnectionsError as exc:
                # No connection of its own to hold the lock with (max_connections, say): the
                # relay stands by for this destination, and serves the others.
                log.warning(
                    "relay.ordered.own_failed",
                    destination=destination,
                    error=describe(exc),
                    action="another relay owns it meanwhile; this one tries again after a poll",
                )
                return None
            if not taken:
                return None
            owner = self._owners[destination] = Ownership()
        now = time.monotonic()
        if owner.due_for_peers(now):
            owner.peers_checked = now
            peers = await store.unowned_peers(destination, PEERS_SEEN_WITHIN)
            if peers and not owner.peers:
                owner.walk("a relay of an earlier release serves it", destination)
            elif owner.peers and not peers and not owner.capped:
                owner.owned_again(destination)
            owner.peers = peers
        if owner.mode is Mode.OWNED and not owner.foreign_read:
            owner.foreign = await store.running_keyed(destination)
            owner.foreign_read = True
        return owner

    def _take_dropped(self) -> None:
        """Rows this relay let go of without an outcome written may still be running: an
        owner holds their keys as it holds those its predecessor left in flight."""
        for env in self.leases.take_dropped():
            owner = self._owners.get(env.destination)
            if owner is None or env.key is None:
                continue
            # A newer claim of the row (read at a takeover) is the one that may still run.
            known = owner.foreign.get(env.id)
            if known is None or known[0] < env.token:
                owner.foreign[env.id] = (env.token, env.key)

    async def _claim_owned(self, route: Route, limit: int, owner: Ownership) -> list[Envelope]:
        if owner.foreign:
            alive = await self.store.still_running(
                [(i, token) for i, (token, _) in owner.foreign.items()]
            )
            owner.foreign = {i: v for i, v in owner.foreign.items() if i in alive}
        # Taken again just before the keys in flight are read: a row let go while this pass
        # awaited (the completer giving up on it) is not held any more, and may still run.
        self._take_dropped()
        mine = (e.key for e in self.leases if e.destination == route.name and e.key is not None)
        rows, more = await self.store.claim_owned(
            route.name,
            limit,
            route.parks_poison,
            self.settings.batch_size * 4,
            owner.lane,
            owner.busy(mine),
            PEERS_SEEN_WITHIN,
        )
        if more is None:
            owner.peers = True
            owner.walk("a relay of an earlier release serves it", route.name)
            return []
        if owner.lane.count > MEMORY_CAP:
            owner.capped = True
            owner.walk_until = time.monotonic() + owner.walk_for
            owner.walk_for = min(2 * owner.walk_for, WALK_AT_MOST)
            owner.walk(f"more than {MEMORY_CAP} rows wait behind their keys", route.name)
            return rows
        if owner.lane.count < MEMORY_CAP // 10:
            owner.walk_for = WALK_FIRST
        if more:
            self._scan_progressed = True
        elif len(rows) < limit:
            self._resting[route.name] = time.monotonic() + self.settings.poll_interval
        return rows

    async def _walk(self, route: Route, limit: int) -> list[Envelope]:
        cursor, origin = self._walks.get(route.name, (None, None))
        # As many keys as a full batch's claim examines, whatever room is left: a round takes
        # as many claims with one free slot as with a free batch.
        scan = self.settings.batch_size * 4
        rows, nxt = await self.store.claim_ordered(
            route.name, limit, route.parks_poison, scan, cursor, origin
        )
        if nxt is not None:
            # The round is not over: claim again at once.
            self._walks[route.name] = (nxt, origin)
            self._scan_progressed = True
        else:
            self._walks[route.name] = (None, None)
            if len(rows) < limit:
                self._resting[route.name] = time.monotonic() + self.settings.poll_interval
        return rows

    def _new_rounds(self) -> None:
        """After a wake-up or a wait: every ordered destination is walked again, a round in
        progress once round every key from where it stands. A wake-up (an outcome recorded,
        a NOTIFY) can be for a key behind the cursor, which the rest of the round would not
        reach, and a round that had nothing to claim waits for one."""
        self._resting.clear()
        self._walks = {name: (cursor, cursor) for name, (cursor, _) in self._walks.items()}

    def _claimed(self, batch: list[Envelope]) -> None:
        self.leases.claimed(batch)
        self.stats["claimed"] += len(batch)
        self.metrics.batch_size.observe(len(batch))
        log.debug(
            "relay.batch.claimed", count=len(batch), first_id=batch[0].id, last_id=batch[-1].id
        )
        self.dispatch(batch)

    def _failed(self, error: BaseException, retry_in: float) -> None:
        if not isinstance(error, DB_ERRORS):
            # A bug, or a row nothing expected: the rows it claimed (if any) go back after
            # their lease; the relay keeps serving the rest, loudly.
            log.error("relay.claim.crashed", error=describe(error), exc_info=error)
            self.metrics.delivery_errors.inc()
            return
        self.error = describe(error)
        if not self._db_down:
            self._db_down = True
            log.error(
                "relay.database.unavailable",
                error=describe(error),
                retry_in=round(retry_in, 1),
                action="reconnecting with backoff; claimed rows stay leased",
            )

    def _database_up(self) -> None:
        self.error = None
        if self._db_down:
            self._db_down = False
            log.info("relay.database.recovered")
