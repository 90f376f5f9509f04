"""Recording outcomes: many rows per statement, written while the next ones accumulate.

Outcomes wait in a buffer; one writer drains everything buffered into one UPDATE. While that
statement runs, new outcomes pile up for the next one, so batches grow with load and an idle
relay records a lone outcome at once.

Two kinds of failure are told apart. The database being unreachable, read-only or otherwise
refusing every write keeps the outcomes and tries again with backoff (the rows stay leased
meanwhile). An outcome PostgreSQL refuses for its own values (an interval out of range, text
it cannot store) would fail every batch it is in: the batch is split until that record stands
alone, and its row is failed with the reason, so the rest keep flowing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import asyncpg
import structlog

from relay.errors import describe
from relay.model import truncate_error
from relay.store import DB_ERRORS, Record, Store

log = structlog.get_logger("relay.completer")

# Errors about the values of the records written, not about the database: retrying the same
# batch gives the same answer. asyncpg raises DataError for SQLSTATE class 22 and for values it
# cannot encode itself (a lone surrogate in a string).
BAD_RECORD: tuple[type[BaseException], ...] = (
    asyncpg.DataError,
    asyncpg.IntegrityConstraintViolationError,
    OverflowError,
    TypeError,
    ValueError,
)

OnRecorded = Callable[[Sequence[Record], set[int], set[int]], None]


class Completer:
    """Writes outcomes in batches; ``on_recorded(records, written, abandoned)`` follows each
    write.

    ``records`` are the outcomes as written (a refused one replaced by its row's failure);
    ``written`` the ids PostgreSQL applied. An outcome that was not applied belongs to a claim
    this relay no longer holds, unless its id is in ``abandoned``: nothing about that row could
    be written at all.
    """

    def __init__(self, store: Store, on_recorded: OnRecorded, *, max_batch: int = 5000) -> None:
        self.store = store
        self.on_recorded = on_recorded
        self.max_batch = max_batch
        self._buffer: list[Record] = []
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
        return len(self._buffer)

    async def flush_once(self) -> bool:
        """Write what is buffered; False if the database refused (outcomes kept)."""
        async with self._lock:
            return await self._flush_locked()

    async def _flush_locked(self) -> bool:
        if not self._buffer:
            return True
        batch, self._buffer = self._buffer[: self.max_batch], self._buffer[self.max_batch :]
        done = _Written()
        try:
            await self._write(batch, done)
        except asyncio.CancelledError:
            # Cut short (a shutdown that ran out of time): keep what is not known written.
            self._buffer[:0] = [r for r in batch if r.id not in done.settled]
            raise
        except DB_ERRORS as exc:
            left = [r for r in batch if r.id not in done.settled]
            self._buffer[:0] = left
            if self.failing_since is None:
                self.failing_since = time.monotonic()
                log.error(
                    "relay.record.failed",
                    rows=len(left),
                    error=describe(exc),
                    action="outcomes kept in memory and retried; leases still protect the rows",
                )
            self.last_error = describe(exc)
            if done.records:
                self.on_recorded(done.records, done.ids, done.abandoned)
            return False
        if self.failing_since is not None:
            self.failing_since = None
            self.last_error = None
            log.info("relay.record.recovered", rows=len(batch))
        self.on_recorded(done.records, done.ids, done.abandoned)
        return True

    async def _write(self, batch: list[Record], done: _Written) -> None:
        """Write ``batch``, splitting it around records PostgreSQL refuses."""
        try:
            ids = await self.store.record(batch)
        except BAD_RECORD as exc:
            if len(batch) > 1:
                mid = len(batch) // 2
                await self._write(batch[:mid], done)
                await self._write(batch[mid:], done)
                return
            await self._reject(batch[0], exc, done)
            return
        done.add(batch, ids)

    async def _reject(self, bad: Record, exc: BaseException, done: _Written) -> None:
        """Fail the row of an outcome PostgreSQL refused, with the reason."""
        self.rejected += 1
        reason = truncate_error(
            f"the relay could not record this row's outcome ({bad.status}): {describe(exc)}. "
            "It is failed rather than retried for ever; check the relay's settings, then "
            f"outbox-relay retry --id {bad.id}"
        )
        log.error("relay.record.rejected", id=bad.id, outcome=bad.status, error=describe(exc))
        failed = Record(bad.id, bad.token, "failed", 1, 0.0, reason, bad.destination, bad.key)
        try:
            ids = await self.store.record([failed])
        except BAD_RECORD as again:
            # Nothing this relay can write about the row: let it go. It stays leased until
            # the relay stops renewing it (on_recorded drops it), then the reaper takes it.
            log.error("relay.record.abandoned", id=bad.id, error=describe(again))
            done.add([failed], set())
            done.abandoned.add(bad.id)
            return
        done.add([failed], ids)

    async def run(self) -> None:
        delay = 0.1
        while not self._closing:
            await self._ready.wait()
            self._ready.clear()
            while self._buffer and not self._closing:
                if await self.flush_once():
                    delay = 0.1
                else:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)

    async def close(self, timeout: float) -> bool:
        """Stop the loop without cutting a write short, then flush everything left within
        ``timeout`` seconds. False if outcomes are left unwritten."""
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


class _Written:
    """What a write settled so far: records written (or given up on) and ids applied."""

    __slots__ = ("abandoned", "ids", "records", "settled")

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.ids: set[int] = set()
        self.settled: set[int] = set()
        self.abandoned: set[int] = set()

    def add(self, records: Sequence[Record], ids: set[int]) -> None:
        self.records.extend(records)
        self.ids |= ids
        self.settled.update(r.id for r in records)
