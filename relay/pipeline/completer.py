"""Recording outcomes: many rows per statement, written while the next ones accumulate.

Outcomes wait in a buffer; one writer drains everything buffered into one UPDATE. While that
statement runs, new outcomes pile up for the next one, so batches grow with load and an idle
relay records a lone outcome at once.

Two kinds of failure are told apart. The database being unreachable or refusing every write
(read-only, a missing grant, a timeout: see store.UNAVAILABLE) keeps the outcomes and tries
again with backoff; the rows stay leased meanwhile. Any other refusal may be about one record
(an interval out of range, text the database's encoding cannot hold, a trigger that refuses
one row): the batch is split until that record stands alone, it is written again with its
error text made plain ASCII, and failing that its row is failed with the reason, so the rest
keep flowing. Outcomes are told apart by (row id, fencing token): the same row may have an
outcome of an older claim and one of the current claim in one batch.

A completer writes through one source's statements (relay/db/leasing.py; the events' are the
Store's): each source of rows has its own, beside its own Leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import structlog

from outbox.errors import describe
from outbox.status import Status
from relay.db.leasing import LeaseStatements
from relay.db.store import UNAVAILABLE, Record
from relay.model import truncate_error

log = structlog.get_logger("relay.completer")

Key = tuple[int, int]  # (row id, fencing token)
OnRecorded = Callable[[Sequence[Record], set[Key], set[Key]], None]


def key(r: Record) -> Key:
    return (r.id, r.token)


class Completer:
    """Writes outcomes in batches; ``on_recorded(records, written, abandoned)`` follows each
    write.

    ``records`` are the outcomes as written (a refused one replaced by its row's failure);
    ``written`` the (id, token) pairs PostgreSQL applied. An outcome that was not applied
    belongs to a claim this relay no longer holds, unless it is in ``abandoned``: nothing
    about that row could be written at all.
    """

    def __init__(
        self,
        source: LeaseStatements,
        on_recorded: OnRecorded,
        *,
        max_batch: int = 5000,
        fields: Mapping[str, str] | None = None,
        hint: Callable[[Record], str] | None = None,
        linger: float = 0.0,
        linger_rows: int = 200,
    ) -> None:
        self.source = source
        # What an operator runs once the cause of a refused outcome is fixed (the events'
        # command by default; a source's rows have their own).
        self.hint = hint or _retry_event
        # How long an outcome that finds no write in progress waits for others (up to
        # linger_rows) to share its statement: none for the events, whose outcomes come in
        # batches; a source whose outcomes come one by one (a delivery per request) writes
        # fewer, larger statements.
        self.linger = linger
        self.linger_rows = linger_rows
        # ``fields``: what its log lines add to say whose rows they are (see Pipe.fields).
        self._log = log.bind(**fields) if fields else log
        self.on_recorded = on_recorded
        self.max_batch = max_batch
        self._buffer: list[Record] = []
        self._writing: list[Record] = []
        self._ready = asyncio.Event()
        self._lock = asyncio.Lock()  # one write at a time: the loop's or the final drain's
        self._closing = False
        # Monotonic time of the first write that failed since the last one that worked.
        self.failing_since: float | None = None
        self.last_error: str | None = None
        self.rejected = 0  # outcomes PostgreSQL refused, their rows failed instead

    def add(self, records: Sequence[Record]) -> None:
        self._buffer.extend(records)
        self._ready.set()

    @property
    def pending(self) -> int:
        """Outcomes not yet written, the write in progress included."""
        return len(self._buffer) + len(self._writing)

    async def flush_once(self) -> bool:
        """Write what is buffered; False if the database refused (outcomes kept)."""
        async with self._lock:
            return await self._flush_locked()

    async def _flush_locked(self) -> bool:
        if not self._buffer:
            return True
        batch, self._buffer = self._buffer[: self.max_batch], self._buffer[self.max_batch :]
        self._writing = batch
        done = _Written()
        try:
            await self._write(batch, done)
            if len(batch) > 1 and len(done.abandoned) == len(batch):
                # Not one record of several could be written, even alone: the database is
                # refusing writes, not this or that record.
                raise _RefusesEverything(done.error)
        except asyncio.CancelledError:
            # Cut short (a shutdown that ran out of time): keep what is not known written.
            self._buffer[:0] = [r for r in batch if key(r) not in done.settled]
            raise
        except UNAVAILABLE_OR_REFUSED as exc:
            left = [r for r in batch if key(r) not in done.settled or key(r) in done.abandoned]
            self._buffer[:0] = left
            self._failed(exc, len(left))
            kept = done.without(done.abandoned)
            if kept.records:
                self.on_recorded(kept.records, kept.ids, set())
            return False
        finally:
            self._writing = []
        if self.failing_since is not None:
            self.failing_since = None
            self.last_error = None
            self._log.info("relay.record.recovered", rows=len(batch))
        self.on_recorded(done.records, done.ids, done.abandoned)
        return True

    def _failed(self, exc: BaseException, rows: int) -> None:
        self.last_error = describe(exc)
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            self._log.error(
                "relay.record.failed",
                rows=rows,
                error=self.last_error,
                action="outcomes kept in memory and retried; leases still protect the rows",
            )

    async def _write(self, batch: list[Record], done: _Written) -> None:
        """Write ``batch``, splitting it around records PostgreSQL refuses."""
        try:
            ids = await self.source.record(batch)
        except UNAVAILABLE:
            raise
        except Exception as exc:
            if len(batch) > 1:
                mid = len(batch) // 2
                await self._write(batch[:mid], done)
                await self._write(batch[mid:], done)
                return
            await self._reject(batch[0], exc, done)
            return
        done.add(batch, ids)

    async def _reject(self, bad: Record, exc: BaseException, done: _Written) -> None:
        """One outcome PostgreSQL refused: write it with plain ASCII text, or fail its row
        with the reason, or (nothing about the row can be written) let it go."""
        plain = _ascii(bad.error)
        if plain != bad.error:
            # Text the database's encoding cannot hold (a LATIN1 database, an endpoint's
            # reply in another script): the same outcome, its text escaped.
            try:
                ids = await self.source.record([replace(bad, error=plain)])
            except UNAVAILABLE:
                raise
            except Exception:  # noqa: S110 - the row is failed below, with the first error
                pass
            else:
                done.add([replace(bad, error=plain)], ids)
                return
        self.rejected += 1
        reason = _ascii(
            truncate_error(
                f"the relay could not record this row's outcome ({bad.status}): "
                f"{describe(exc)}. It is failed rather than retried for ever; fix the cause, "
                f"then {self.hint(bad)}"
            )
        )
        self._log.error("relay.record.rejected", id=bad.id, outcome=bad.status, error=describe(exc))
        # A copy, so that what a source's records carry beyond Record's fields goes with it.
        failed = replace(
            bad, status=Status.FAILED, counted=1, delay=0.0, error=reason, written=False
        )
        try:
            ids = await self.source.record([failed])
        except UNAVAILABLE:
            raise
        except Exception as again:
            # Nothing this relay can write about the row: let it go. It stays leased until
            # the relay stops renewing it (on_recorded drops it), then the reaper takes it.
            self._log.error("relay.record.abandoned", id=bad.id, error=describe(again))
            done.add([failed], set())
            done.abandoned.add(key(failed))
            done.error = describe(again)
            return
        done.add([failed], ids)

    async def run(self) -> None:
        delay = 0.1
        while not self._closing:
            await self._ready.wait()
            self._ready.clear()
            await self._linger()
            while self._buffer and not self._closing:
                if await self.flush_once():
                    delay = 0.1
                else:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)

    async def _linger(self) -> None:
        """Wait up to ``linger`` for ``linger_rows`` outcomes (a stop ends it at once)."""
        if self.linger <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.linger
        while len(self._buffer) < self.linger_rows and not self._closing:
            left = deadline - loop.time()
            if left <= 0:
                return
            self._ready.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._ready.wait()

    async def close(self, timeout: float) -> bool:
        """Stop the loop, let the write in progress finish, then flush everything left, all
        within ``timeout`` seconds. False if outcomes are left unwritten (a write still in
        progress at the deadline is cut short; its outcomes stay counted in ``pending``)."""
        self._closing = True
        self._ready.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._buffer or self._lock.locked():
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    ok = await self.flush_once()
            except TimeoutError:
                return False
            if not ok:
                if loop.time() > deadline:
                    return False
                await asyncio.sleep(0.2)
        return True


def _retry_event(r: Record) -> str:
    return f"outbox-relay retry --id {r.id}"


def _ascii(text: str | None) -> str | None:
    return text.encode("ascii", "backslashreplace").decode("ascii") if text else text


class _RefusesEverything(Exception):
    """Every record of a batch was refused, each alone: the database refuses writes."""


UNAVAILABLE_OR_REFUSED: tuple[type[BaseException], ...] = (*UNAVAILABLE, _RefusesEverything)


class _Written:
    """What a write settled so far: records written (or given up on) and pairs applied."""

    __slots__ = ("abandoned", "error", "ids", "records", "settled")

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.ids: set[Key] = set()
        self.settled: set[Key] = set()
        self.abandoned: set[Key] = set()
        self.error: str | None = None

    def add(self, records: Sequence[Record], ids: set[Key]) -> None:
        self.records.extend(records)
        self.ids |= ids
        self.settled.update(key(r) for r in records)

    def without(self, drop: set[Key]) -> _Written:
        out = _Written()
        out.add([r for r in self.records if key(r) not in drop], self.ids)
        return out
