"""What the relays share: the registry of relays (who serves which destinations), the rows of
destinations nobody serves, the paused destinations and the lock of jobs run by one relay."""

from __future__ import annotations

# A relay says it is alive, and what it serves, every few seconds (one row per relay).
REGISTER = """
INSERT INTO {relays}
    (relay_id, host, pid, version, destinations, circuits, features, features_at)
VALUES ($1, $2, $3, $4, $5::text[], $6::jsonb, ARRAY['ordered-owner'], now())
ON CONFLICT (relay_id) DO UPDATE
SET host = EXCLUDED.host, pid = EXCLUDED.pid, version = EXCLUDED.version,
    destinations = EXCLUDED.destinations, circuits = EXCLUDED.circuits,
    features = EXCLUDED.features, features_at = now(), seen_at = now(), stopped_at = NULL
"""

# On a clean stop. The row stays: its destinations still count as served for a while, so a
# rolling restart does not make another relay fail their rows as unknown.
UNREGISTER = """
UPDATE {relays} SET stopped_at = now(), seen_at = now(), circuits = '{}' WHERE relay_id = $1
"""

FORGET_RELAYS = "DELETE FROM {relays} WHERE seen_at < now() - make_interval(secs => $1)"

# Pending rows of destinations that neither this relay ($1) nor any relay seen in the last $2
# seconds serves (see the relay registry): nobody will deliver them until a config changes.
# Failing them ($3) spares rows younger than a grace period, so a relay that serves them has
# time to start (a new deployment, a relay added for a new destination).
_UNSERVED = """
WHERE status = 'pending' AND NOT (destination = ANY($1::text[]))
  AND NOT EXISTS (SELECT 1 FROM {relays} AS r
                  WHERE r.seen_at > now() - make_interval(secs => $2)
                    AND {table}.destination = ANY(r.destinations))
"""

UNKNOWN_DESTINATIONS = (
    """
SELECT destination, count(*) AS rows, min(created_at) AS oldest
FROM {table}
"""
    + _UNSERVED
    + """
GROUP BY destination
ORDER BY destination
"""
)

FAIL_UNKNOWN_DESTINATIONS = (
    """
UPDATE {table}
SET status = 'failed',
    finished_at = now(),
    last_error = 'unknown destination ' || quote_literal(destination)
                 || ': no running relay serves it; add it to a relay config, then run '
                 || 'outbox-relay retry'
"""
    + _UNSERVED
    + """
  AND created_at < now() - make_interval(secs => $3)
  AND attempts = 0  -- a row some relay already tried is served (maybe by one not registered)
RETURNING destination
"""
)

PAUSED = "SELECT destination FROM {paused}"

# Jobs that one relay at a time should run take this lock in their own short transaction. It
# is released at commit or when the connection dies, so a crashed relay never holds it.
TRY_JOB_LOCK = "SELECT pg_try_advisory_xact_lock(hashtextextended('outbox-relay:' || $1, 0))"
