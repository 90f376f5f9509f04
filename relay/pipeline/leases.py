"""The rows this relay holds: claimed, not yet recorded.

Every claimed row is in :class:`Leases` until its outcome is written (or the relay finds it
no longer holds the row). The heartbeat renews what is held; a row whose renewal the
database refuses was taken back (reaped after a stall) and is never sent from then on. Its
``capacity`` event wakes the claimer whenever rows leave.

One Leases serves one source of rows (the events, through the Store; see relay/db/leasing.py):
rows are known by id, and ids of two sources may be equal, so each source has its own.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Generic, TypeVar

import structlog

from outbox.status import Status
from relay.db.leasing import Held, LeaseStatements
from relay.db.store import Record
from relay.obs.metrics import Metrics

log = structlog.get_logger("relay")

LOST_IDS_LOGGED = 20

H = TypeVar("H", bound=Held)


class Leases(Generic[H]):
    def __init__(self, metrics: Metrics, stats: Counter[str]) -> None:
        self.metrics = metrics
        self.stats = stats
        self.capacity = asyncio.Event()  # set whenever rows leave
        self._held: dict[int, H] = {}
        # Rows whose outcome is with the completer: id -> (token, when handed over).
        self._handed: dict[int, tuple[int, float]] = {}
        # Rows let go without an outcome written (given up, lost, forgotten): they may still
        # be running in the table. The claimer takes them (see take_dropped).
        self._dropped: list[H] = []
        # What its log lines add to say whose rows they are (a source's ids may equal the
        # events'): set by its pipe (relay/runtime/pipes.py); none for the events.
        self.fields: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[H]:
        return iter(list(self._held.values()))

    def tokens(self) -> list[tuple[int, int]]:
        """(id, token) of every row held."""
        return [(i, e.token) for i, e in self._held.items()]

    def claimed(self, batch: Sequence[H]) -> None:
        for env in batch:
            earlier = self._held.get(env.id)
            if earlier is not None:
                # This relay claimed the row again: its earlier claim expired (a stall longer
                # than the lease) and was reaped. That claim can no longer record anything.
                self.lose([earlier], "claimed again after the lease expired")
            self._held[env.id] = env

    def handed(self, envs: Iterable[H]) -> None:
        """Their outcomes are with the completer from now on."""
        now = time.monotonic()
        for env in envs:
            self._handed[env.id] = (env.token, now)
        # They left their sink, which may take more now.
        self.capacity.set()

    def recorded(
        self,
        records: Sequence[Record],
        written: set[tuple[int, int]],
        abandoned: set[tuple[int, int]],
    ) -> bool:
        """The completer wrote (or gave up on) these records. Returns whether a head of an
        ordered key finished, so the next row of its key can be claimed now."""
        next_heads = False
        stale: list[int] = []
        counts: dict[str, int] = {}
        held, handed = self._held, self._handed
        for r in records:
            env = held.get(r.id)
            mine = env is not None and env.token == r.token
            if mine:
                del held[r.id]
                handed.pop(r.id, None)
            if (r.id, r.token) in written:
                kind = r.status if r.counted else "deferred"
                counts[kind] = counts.get(kind, 0) + 1
                # By value: a source's statuses may be plain strings.
                next_heads |= r.status != Status.PENDING and r.key is not None
            else:
                if mine:
                    self._dropped.append(env)  # type: ignore[arg-type]
                if (r.id, r.token) not in abandoned:
                    stale.append(r.id)
        self.stats.update(counts)
        if stale:
            self._log_lost(stale, "outcome not recorded: the row is no longer this claim's")
        self.capacity.set()
        return next_heads

    def lose(self, envs: Iterable[H], why: str) -> None:
        """Rows this relay found it no longer holds: never sent from now on, never renewed."""
        lost = []
        for env in envs:
            env.lease.lost.add(env.id)
            if self._held.get(env.id) is env:
                del self._held[env.id]
                self._handed.pop(env.id, None)
                self._dropped.append(env)
            lost.append(env.id)
        if lost:
            self._log_lost(lost, why)
            self.capacity.set()

    def forget(self, envs: Iterable[H]) -> None:
        """Stop renewing leases this relay cannot settle: the reaper takes the rows back."""
        for env in envs:
            if self._held.get(env.id) is env:
                del self._held[env.id]
                self._handed.pop(env.id, None)
                self._dropped.append(env)
        self.capacity.set()

    def take_dropped(self) -> list[H]:
        """The rows let go without an outcome written since the last call: the owner of an
        ordered destination holds their keys until they are no longer running."""
        dropped, self._dropped = self._dropped, []
        return dropped

    async def heartbeat(self, source: LeaseStatements, lease: float) -> None:
        """Renew the leases of the rows held (``source``'s rows: this Leases's); drop those
        the database says are gone."""
        started = time.monotonic()
        # A row whose outcome has waited to be written for this long is let go: the reaper
        # takes it back after its lease, instead of this relay renewing it for ever.
        stuck_since = started - max(10 * lease, 300.0)
        held = [
            (i, e.token)
            for i, e in self._held.items()
            if (h := self._handed.get(i)) is None or h[0] != e.token or h[1] > stuck_since
        ]
        if not held:
            return
        alive = await source.heartbeat(held)
        until = started + lease
        missed = []
        for i, token in held:
            env = self._held.get(i)
            if env is None or env.token != token:
                continue  # recorded (or claimed again) while the heartbeat ran
            if i in alive:
                env.lease.until = max(env.lease.until, until)
            elif self._handed.get(i, (None,))[0] != token:
                missed.append(env)
        if not missed:
            return
        # Its outcome is not being written: the row was reaped, maybe claimed again; unless
        # its sink recorded it in its own statement, before the hand-over (FAN_OUT).
        settled = await source.settled([(e.id, e.token) for e in missed])
        lost = [e for e in missed if e.id not in settled and self._held.get(e.id) is e]
        if lost:
            self.lose(lost, "lease not renewed: the row was taken back after the lease expired")

    def _log_lost(self, ids: list[int], why: str) -> None:
        # Labelled by whose rows they are: the events' pipe adds no field (see Pipe.fields).
        self.metrics.leases_lost.labels(self.fields.get("source", "events")).inc(len(ids))
        self.stats["lease_lost"] += len(ids)
        log.warning(
            "relay.lease.lost",
            count=len(ids),
            ids=sorted(ids)[:LOST_IDS_LOGGED],
            reason=why,
            **self.fields,
            action="another claim of these rows delivers and records them; if this repeats, "
            "the relay stalls for longer than relay.lease (raise it, or look for pauses)",
        )


def ids(envs: Sequence[Held]) -> list[int]:
    """Row ids for a log line: all of a small batch, the first few of a large one."""
    return [e.id for e in envs[:LOST_IDS_LOGGED]]
