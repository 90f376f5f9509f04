"""Recording the outcomes of a batch of events in one statement: every kind of outcome, or plain
deliveries only, and each of these with retention = 0 (delivered rows deleted as recorded).

Their text, and why each is written so, is in relay/db/queries/outcomes.sql."""

from __future__ import annotations

from outbox.sql import load

_q = load("relay.db.queries", "outcomes.sql", binds="numbered")

RECORD = _q["record"]
RECORD_DELIVERED = _q["record_delivered"]
RECORD_DELETING = _q["record_deleting"]
RECORD_DELIVERED_DELETING = _q["record_delivered_deleting"]
