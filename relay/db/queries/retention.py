"""Deleting what is no longer needed: purges of delivered, failed and skipped events (never one
a delivery still needs), retention's batches, and the ended deliveries and the message log.

Their text, and why each is written so, is in relay/db/queries/retention.sql."""

from __future__ import annotations

from outbox.sql import load

_q = load("relay.db.queries", "retention.sql", binds="numbered")

PURGE_DELIVERED = _q["purge_delivered"]
PURGE_FINISHED = _q["purge_finished"]
DELETE_LOCKED = _q["delete_locked"]
RETENTION_DELIVERED = _q["retention_delivered"]
PURGE_DELIVERIES = _q["purge_deliveries"]
PURGE_ATTEMPTS = _q["purge_attempts"]
