"""The leases of claimed rows: the fence every outcome, heartbeat and release goes through, the
heartbeat, the release on a clean stop, and the reaper's statements for leases that expired.

Their text, and why each is written so, is in relay/db/queries/leases.sql."""

from __future__ import annotations

from outbox.sql import load

_q = load("relay.db.queries", "leases.sql", binds="numbered")

HEARTBEAT = _q["heartbeat"]
SETTLED = _q["settled"]
REAP = _q["reap"]
EXPIRED = _q["expired"]
RELEASE = _q["release"]
