"""LISTEN for enqueue notifications on a dedicated connection, and keep it alive."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import asyncpg
import structlog

from outbox.errors import describe
from relay.db import queries
from relay.db.store import DB_ERRORS

log = structlog.get_logger("relay.listener")


class Listener:
    """Calls ``wake()`` on every NOTIFY. If the connection drops it reconnects with backoff;
    the relay keeps polling meanwhile, so a lost listener costs latency, never events."""

    def __init__(
        self,
        dsn: str,
        channel: str,
        wake: Callable[[], None],
        application_name: str,
        on_payload: Callable[[str], None] | None = None,
    ) -> None:
        self.dsn = dsn
        self.channel = channel
        self.wake = wake
        self.application_name = application_name
        # Called with each notification's payload too ("endpoints": an endpoint changed).
        self.on_payload = on_payload
        self.connected = asyncio.Event()

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        self.wake()
        if self.on_payload is not None and payload:
            self.on_payload(payload)

    async def run(self) -> None:
        delay = 0.2
        was_lost = False
        while True:
            lost = asyncio.Event()
            try:
                conn = await asyncpg.connect(
                    self.dsn,
                    server_settings={"application_name": self.application_name[:63]},
                )
            except DB_ERRORS as exc:
                if not was_lost:
                    log.warning("relay.listener.lost", error=describe(exc))
                    was_lost = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            try:
                conn.add_termination_listener(lambda _c, ev=lost: ev.set())
                await conn.add_listener(self.channel, self._on_notify)
                self.connected.set()
                if was_lost:
                    log.info("relay.listener.recovered", channel=self.channel)
                was_lost, delay = False, 0.2
                # Rows may have been committed while we were not listening.
                self.wake()
                while not lost.is_set():
                    try:
                        await asyncio.wait_for(lost.wait(), 30)
                    except TimeoutError:
                        # A silent network loss never terminates the connection; ask.
                        await conn.execute(queries.PING, timeout=10)
            except DB_ERRORS as exc:
                log.warning("relay.listener.lost", error=describe(exc))
                was_lost = True
            finally:
                self.connected.clear()
                conn.terminate()
            if not was_lost:
                log.warning("relay.listener.lost", error="connection closed")
                was_lost = True
            await asyncio.sleep(delay)
