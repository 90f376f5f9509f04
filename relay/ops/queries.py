"""The statements of the operations commands (status, show, retry, purge, pause, skip,
endpoints): see relay/queries.py for how ``{table}``, ``{paused}`` and ``{relays}`` are
filled in, and outbox.queries.render_endpoints for ``{deliveries}`` and ``{attempts}``."""

from __future__ import annotations

# The relay's statements the commands run too.
from relay.queries import BLOCKED_KEYS as BLOCKED_KEYS
from relay.queries import NOTIFY as NOTIFY
from relay.queries import PAUSED_TABLE as PAUSED_TABLE
from relay.queries import PURGE_DELIVERED as PURGE_DELIVERED
from relay.queries import PURGE_FINISHED as PURGE_FINISHED
from relay.queries import RELAYS_TABLE as RELAYS_TABLE
from relay.queries import TABLE_EXISTS as TABLE_EXISTS
from relay.queries import qualified_table as qualified_table
from relay.queries import render_ops as render_ops

PAUSED_DETAIL = """
SELECT destination, paused_at, paused_by, reason FROM {paused} ORDER BY destination
"""

PAUSE = """
INSERT INTO {paused} (destination, paused_by, reason)
VALUES ($1, $2, $3)
ON CONFLICT (destination) DO UPDATE
SET reason = COALESCE(EXCLUDED.reason, {paused}.reason)
RETURNING paused_at, (xmax = 0) AS inserted
"""

RESUME = "DELETE FROM {paused} WHERE destination = $1 RETURNING paused_at"

RELAYS = """
SELECT relay_id, host, pid, version, destinations, started_at, seen_at, stopped_at,
       extract(epoch FROM now() - seen_at)::float8 AS seen_age
FROM {relays}
ORDER BY relay_id
"""

STATUS_COUNTS = """
SELECT destination,
       count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'pending' AND run_after <= now()) AS due,
       count(*) FILTER (WHERE status = 'running') AS running,
       count(*) FILTER (WHERE status = 'delivered') AS delivered,
       count(*) FILTER (WHERE status = 'failed') AS failed,
       count(*) FILTER (WHERE status = 'skipped') AS skipped,
       extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::float8
           AS oldest_pending_age,
       max(delivered_at) AS last_delivered_at
FROM {table}
GROUP BY destination
ORDER BY destination
"""

STATUS_LEASES = """
SELECT destination, locked_by, count(*) AS rows,
       extract(epoch FROM min(locked_until) - now())::float8 AS lease_left
FROM {table}
WHERE status = 'running'
GROUP BY destination, locked_by
ORDER BY destination, locked_by
"""

STATUS_ERRORS = """
SELECT destination, last_error, count(*) AS rows
FROM {table}
WHERE status = 'failed'
GROUP BY destination, last_error
ORDER BY destination, rows DESC
"""

SHOW = """
SELECT id, destination, key, status, attempts, run_after, locked_by, locked_until, last_error,
       created_at, delivered_at, content_type, headers::text AS headers,
       octet_length(payload) AS payload_bytes, substring(payload FROM 1 FOR $2) AS payload_head
FROM {table}
WHERE id = ANY($1::bigint[])
ORDER BY id
"""

# Failed rows matching the retry filters; a NULL filter matches everything.
_FAILED_MATCHING = """
FROM {table}
WHERE status = 'failed'
  AND ($1::text[] IS NULL OR destination = ANY($1::text[]))
  AND ($2::bigint[] IS NULL OR id = ANY($2::bigint[]))
  AND ($3::timestamptz IS NULL OR created_at >= $3::timestamptz)
  AND ($4::text IS NULL OR last_error ILIKE $4::text)
"""

RETRY_PREVIEW = (
    """
SELECT destination, count(*) AS rows, min(id) AS first_id, max(id) AS last_id
"""
    + _FAILED_MATCHING
    + """
GROUP BY destination
ORDER BY destination
"""
)

RETRY = (
    """
WITH matching AS (
    SELECT id
"""
    + _FAILED_MATCHING
    + """
    FOR UPDATE
)
UPDATE {table} AS o
SET status = 'pending', attempts = 0, run_after = now(), locked_by = NULL, locked_until = NULL,
    finished_at = NULL
FROM matching
WHERE o.id = matching.id
RETURNING o.id, o.destination
"""
)

ID_STATUSES = "SELECT id, status FROM {table} WHERE id = ANY($1::bigint[])"

# purge: delivered rows age from delivered_at (found through outbox_delivered_idx), skipped
# and failed rows from finished_at, when they got that status (outbox_finished_idx; rows that
# ended before migration 0004 have none and age from created_at).
# $1: seconds, $2: destinations or NULL, $3: whether failed rows go too.
PURGE_PREVIEW = """
SELECT destination, status, count(*) AS rows
FROM {table}
WHERE ((status = 'delivered' AND delivered_at < now() - make_interval(secs => $1))
       OR (status IN ('failed', 'skipped')
           AND (status = 'skipped' OR $3::bool)
           AND coalesce(finished_at, created_at) < now() - make_interval(secs => $1)))
  AND ($2::text[] IS NULL OR destination = ANY($2::text[]))
GROUP BY destination, status
ORDER BY destination, status
"""

# An operator gives up on failed rows: they will not be delivered, and an ordered key they
# were blocking moves on (its next row is the key's head from now on).
SKIP = """
UPDATE {table}
SET status = 'skipped',
    finished_at = now(),
    last_error = coalesce(last_error, '') || ' [skipped by ' || $2 || ' at ' || now() || ']'
WHERE id = ANY($1::bigint[]) AND status = 'failed'
RETURNING id, destination, key
"""


# --- endpoints show / delete ----------------------------------------------------------------
# SQLAlchemy text() forms (named binds): the endpoints commands run through outbox.endpoints,
# which takes a SQLAlchemy connection. {deliveries} and {attempts} are the schema's tables,
# filled in by outbox.queries.render_endpoints.

# One endpoint's deliveries by status. Its last outcome is that of the newest delivery that
# was tried: a success there (last_error NULL) means the endpoint has recovered.
ENDPOINT_DELIVERIES = """
WITH tried AS (
    SELECT last_error, last_status
    FROM {deliveries}
    WHERE endpoint_id = :id AND (last_error IS NOT NULL OR last_status IS NOT NULL)
    ORDER BY id DESC
    LIMIT 1
)
SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'running') AS running,
       count(*) FILTER (WHERE status = 'delivered') AS delivered,
       count(*) FILTER (WHERE status = 'failed') AS failed,
       count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
       CAST(extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))
            AS float8) AS oldest_pending_age,
       (SELECT last_error FROM tried) AS last_error,
       (SELECT last_status FROM tried) AS last_status
FROM {deliveries}
WHERE endpoint_id = :id
"""

# Its newest attempts (outbox_attempts_endpoint_idx), replays included.
ENDPOINT_RECENT_ATTEMPTS = """
SELECT at, event_id, http_status, duration_ms, error
FROM {attempts}
WHERE endpoint_id = :id
ORDER BY at DESC, id DESC
LIMIT :limit
"""
