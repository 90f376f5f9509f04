"""Recording outcomes: many rows per statement, written while the next ones accumulate.

Outcomes wait in a buffer; one writer drains everything buffered into one UPDATE. While that
statement runs, new outcomes pile up for the next one, so batches grow with load and an idle
relay records a lone outcome at once. A failed write keeps its outcomes and tries again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import structlog

from relay.store import DB_ERRORS, Record, Store

log = structlog.get_logger("relay.completer")


class Completer:
    def __init__(
        self,
        store: Store,
        on_recorded: Callable[[Sequence[Record]], None],
        *,
        max_batch: int = 5000,
    ) -> None:
        self.store = store
        self.on_recorded = on_recorded
        self.max_batch = max_batch
        self._buffer: list[Record] = []
        self._ready = asyncio.Event()
        self._db_down = False

    def add(self, records: Sequence[Record]) -> None:
        self._buffer.extend(records)
        self._ready.set()

    @property
    def pending(self) -> int:
        return len(self._buffer)

    async def _write(self, batch: list[Record]) -> None:
        await self.store.record(batch)

    async def flush_once(self) -> bool:
        """Write what is buffered; False if the database refused (outcomes kept)."""
        if not self._buffer:
            return True
        batch, self._buffer = self._buffer[: self.max_batch], self._buffer[self.max_batch :]
        try:
            await self._write(batch)
        except DB_ERRORS as exc:
            self._buffer[:0] = batch
            if not self._db_down:
                self._db_down = True
                log.error(
                    "relay.record.failed",
                    rows=len(batch),
                    error=f"{type(exc).__name__}: {exc}",
                    action="outcomes kept in memory and retried; leases still protect the rows",
                )
            return False
        if self._db_down:
            self._db_down = False
            log.info("relay.record.recovered", rows=len(batch))
        self.on_recorded(batch)
        return True

    async def run(self) -> None:
        delay = 0.1
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._buffer:
                if await self.flush_once():
                    delay = 0.1
                else:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)

    async def drain(self, timeout: float) -> bool:
        """Flush everything within ``timeout`` seconds (used at shutdown)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._buffer:
            if not await self.flush_once():
                if loop.time() > deadline:
                    return False
                await asyncio.sleep(0.2)
        return True
