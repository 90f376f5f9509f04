"""Batch leases (relay.claims = "batch"): the claim that takes an unordered destination's
fresh rows under one lease row, the outcomes, heartbeat and release of such rows, the reaper's
statement for such leases that ended, the forgetting of old ones, and the sweep for fresh
rows below a chain's end.

Their text, and why each is written so, is in relay/db/queries/batches.sql."""

from __future__ import annotations

from outbox.sql import load

_q = load("relay.db.queries", "batches.sql", binds="numbered")

CLAIM_BATCH = _q["claim_batch"]
CLAIM_PAST_FENCE = _q["claim_past_fence"]
REAP_BATCHES = _q["reap_batches"]
EXPIRED_BATCHES = _q["expired_batches"]
FORGET_BATCHES = _q["forget_batches"]
RECORD_BATCH = _q["record_batch"]
RECORD_BATCH_DELIVERED = _q["record_batch_delivered"]
RECORD_BATCH_DELETING = _q["record_batch_deleting"]
RECORD_BATCH_DELIVERED_DELETING = _q["record_batch_delivered_deleting"]
HEARTBEAT_BATCHES = _q["heartbeat_batches"]
RELEASE_BATCH = _q["release_batch"]
SWEEP_BATCHES = _q["sweep_batches"]
