"""What the relays share: the registry of relays (who serves which destinations), the rows of
destinations nobody serves, the paused destinations and the lock of jobs run by one relay.

Their text, and why each is written so, is in relay/db/queries/registry.sql."""

from __future__ import annotations

from outbox.sql import load

_q = load("relay.db.queries", "registry.sql", binds="numbered")

REGISTER = _q["register"]
UNREGISTER = _q["unregister"]
FORGET_RELAYS = _q["forget_relays"]
UNKNOWN_DESTINATIONS = _q["unknown_destinations"]
FAIL_UNKNOWN_DESTINATIONS = _q["fail_unknown_destinations"]
MIXED_CLAIMS = _q["mixed_claims"]
PAUSED = _q["paused"]
TRY_JOB_LOCK = _q["try_job_lock"]
SETTLING_LOCK = _q["settling_lock"]
SETTLING_HOLDER = _q["settling_holder"]
