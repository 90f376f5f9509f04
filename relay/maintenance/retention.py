"""Retention: delivered and skipped rows older than ``relay.retention`` are deleted, a batch
per transaction, by one relay at a time; the message log after ``message_log_retention``;
registrations of relays long gone, and endpoints' previous secrets past their window, too."""

from __future__ import annotations

import asyncio

import structlog

from outbox.errors import describe
from relay.config import RelaySettings
from relay.db.store import DB_ERRORS, Store
from relay.obs.metrics import Metrics
from relay.sinks.endpoints.at_rest import clear_expired_previous_secrets

log = structlog.get_logger("relay")

# Registrations of relays not seen for this long are deleted.
FORGET_RELAYS_AFTER = 7 * 86400.0


class Retention:
    def __init__(
        self, settings: RelaySettings, store: Store, metrics: Metrics, stopping: asyncio.Event
    ) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.stopping = stopping

    async def __call__(self) -> None:
        rs = self.settings
        total = 0
        await self.store.forget_relays(FORGET_RELAYS_AFTER)
        cursor = None
        ran = False
        while not self.stopping.is_set():
            batch = await self.store.delete_finished(
                rs.retention, rs.retention_batch_size, rs.message_log_retention, cursor
            )
            if batch is None:  # another relay is on it
                break
            ran = True
            total += batch.deleted
            self.metrics.retention_deleted.inc(batch.deleted)
            if not batch.more:
                break
            cursor = batch.cursor
            await asyncio.sleep(0)  # let deliveries and probes run between batches
        if total:
            log.info("relay.retention.deleted", rows=total, retention_s=rs.retention)
        if ran:
            # An endpoint's previous secret signs nothing once its window has passed: not
            # kept. By the relay that ran retention (one at a time), after it: a failure here
            # must not keep the rows above from going.
            try:
                cleared = await clear_expired_previous_secrets(self.store)
            except DB_ERRORS as exc:
                log.warning("relay.endpoints.previous_secrets_failed", error=describe(exc))
            else:
                if cleared:
                    log.info("relay.endpoints.previous_secrets_cleared", endpoints=cleared)
