"""What the relay measures for its gauges: pending rows by destination, read lane by lane, and
the oldest holder of the xmin horizon (the snapshot that keeps dead rows).

Their text, and why each is written so, is in relay/db/queries/gauges.sql."""

from __future__ import annotations

from outbox.sql import load

_q = load("relay.db.queries", "gauges.sql", binds="numbered")

PENDING_BY_DESTINATION = _q["pending_by_destination"]
SNAPSHOT_HOLDER = _q["snapshot_holder"]
