"""Every statement the relay runs, in one place: the claim, outcomes, leases, the registry,
pauses, retention and gauges. The commands' statements (status, retry, purge, …) are in
relay/ops/queries.py.

Statements name the outbox table ``{table}``, outbox_paused ``{paused}`` and outbox_relays
``{relays}``; :func:`render_ops` fills them in for a schema once, when the store is created.
Values are always bound parameters, never formatted in.
"""

from __future__ import annotations

# Statements of the outbox library the relay runs too.
from outbox.queries import NOTIFY as NOTIFY
from outbox.queries import SERVER_ENCODING as SERVER_ENCODING
from outbox.queries import TABLE_EXISTS as TABLE_EXISTS
from outbox.queries import qualified_table as qualified_table


def render_ops(sql: str, schema: str) -> str:
    """Fill in ``{table}`` (the outbox), ``{paused}`` (outbox_paused) and ``{relays}``
    (outbox_relays) of ``schema``."""
    return (
        sql.replace("{table}", qualified_table(schema))
        .replace("{paused}", qualified_table(schema, PAUSED_TABLE))
        .replace("{relays}", qualified_table(schema, RELAYS_TABLE))
    )


# The claim: one statement per destination ($1). Pick its claimable rows in order, skip rows
# other relays are locking, mark them running under this relay's lease, return them. The
# index range is the destination's own, so other destinations' backlogs cost nothing.
CLAIM = """
WITH picked AS (
    SELECT id FROM {table}
    WHERE status = 'pending' AND run_after <= now() AND destination = $1
    ORDER BY run_after, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS o
SET status = 'running', locked_by = $3, locked_until = now() + make_interval(secs => $4),
    claims = o.claims + 1
WHERE o.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING o.id, o.destination, o.key, o.payload, o.content_type, o.headers::text,
          o.attempts, extract(epoch FROM o.created_at)::float8, o.claims
"""

# All outcomes of a batch in one statement. Only rows this relay still holds under the claim
# that produced the outcome are touched ($2: each row's fencing token, the `claims` value its
# claim returned): if the lease expired and the row was claimed again, by another relay or by
# this one, the newer claim's outcome wins. Returns the (id, token) pairs it recorded.
RECORD = """
UPDATE {table} AS o
SET status = u.status,
    attempts = o.attempts + u.counted,
    run_after = CASE WHEN u.status = 'pending'
                     THEN now() + make_interval(secs => u.delay) ELSE o.run_after END,
    last_error = COALESCE(u.error, o.last_error),
    delivered_at = CASE WHEN u.status = 'delivered' THEN now() END,
    finished_at = CASE WHEN u.status <> 'pending' THEN now() END,
    -- Unchanged (the WHERE demands it), and written so that a trigger auditing the table can
    -- tell which claim an outcome belongs to (the fault suite counts outcomes recorded over a
    -- newer claim that way).
    claims = u.token,
    locked_by = NULL,
    locked_until = NULL
FROM unnest($1::bigint[], $2::int[], $3::text[], $4::int[], $5::float8[], $6::text[])
     AS u(id, token, status, counted, delay, error)
WHERE o.id = u.id AND o.claims = u.token AND o.status = 'running' AND o.locked_by = $7
RETURNING o.id, o.claims
"""

# Extends the lease of the rows this relay still holds under its claims' tokens; returns their
# ids. A row missing from the answer was lost (reaped after a stall, and maybe claimed again).
HEARTBEAT = """
UPDATE {table} AS o SET locked_until = now() + make_interval(secs => $4)
FROM unnest($1::bigint[], $2::int[]) AS u(id, token)
WHERE o.id = u.id AND o.claims = u.token AND o.status = 'running' AND o.locked_by = $3
RETURNING o.id
"""

# Rows whose relay stopped heartbeating go back to pending (or to failed once they have used
# every attempt: a row that crashes its relay each time must not loop for ever). $3/$4 give
# per-destination attempt limits; $1 is the limit for any other destination.
# $5: only these rows (NULL: any); $6: never these (rows the database refused to reap).
REAP = """
WITH expired AS (
    SELECT id FROM {table}
    WHERE status = 'running' AND locked_until < now()
      AND ($5::bigint[] IS NULL OR id = ANY($5::bigint[]))
      AND NOT (id = ANY($6::bigint[]))
    ORDER BY locked_until
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
limits AS (
    SELECT * FROM unnest($3::text[], $4::int[]) AS l(destination, max_attempts)
)
UPDATE {table} AS o
SET status = CASE WHEN o.attempts + 1 >= coalesce(
                      (SELECT l.max_attempts FROM limits AS l WHERE l.destination = o.destination),
                      $1)
                  THEN 'failed' ELSE 'pending' END,
    attempts = o.attempts + 1,
    run_after = now(),
    last_error = 'lease expired: relay ' || coalesce(o.locked_by, '?')
                 || ' stopped before recording an outcome',
    finished_at = CASE WHEN o.attempts + 1 >= coalesce(
                      (SELECT l.max_attempts FROM limits AS l WHERE l.destination = o.destination),
                      $1)
                  THEN now() END,
    locked_by = NULL,
    locked_until = NULL
FROM expired
WHERE o.id = expired.id
RETURNING o.id, o.status, o.destination
"""

# Rows whose lease expired, for reaping them one at a time when the database refuses to reap
# them together (a trigger that refuses one row must not keep every dead relay's rows).
EXPIRED = """
SELECT id FROM {table}
WHERE status = 'running' AND locked_until < now() AND NOT (id = ANY($2::bigint[]))
ORDER BY locked_until
LIMIT $1
"""

# On clean shutdown: rows claimed but not attempted go back untouched (no attempt counted),
# if this relay still holds them under the same claim.
RELEASE = """
UPDATE {table} AS o
SET status = 'pending', locked_by = NULL, locked_until = NULL, run_after = now()
FROM unnest($2::bigint[], $3::int[]) AS u(id, token)
WHERE o.id = u.id AND o.claims = u.token AND o.status = 'running' AND o.locked_by = $1
"""

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

# With retention = 0: delivered rows are deleted by the statement that records them, the rest
# updated as in RECORD. Still one statement; the two parts touch disjoint rows. Its UPDATE
# repeats RECORD's SET list but for delivered_at (no delivered row reaches it), spelled out
# rather than pasted together so that each statement reads whole: change both together.
RECORD_DELETING = """
WITH u AS (
    SELECT * FROM unnest($1::bigint[], $2::int[], $3::text[], $4::int[], $5::float8[],
                         $6::text[])
         AS u(id, token, status, counted, delay, error)
),
gone AS (
    DELETE FROM {table} AS o
    USING u
    WHERE o.id = u.id AND u.status = 'delivered'
      AND o.claims = u.token AND o.status = 'running' AND o.locked_by = $7
    RETURNING o.id, o.claims
),
kept AS (
    UPDATE {table} AS o
    SET status = u.status,
        attempts = o.attempts + u.counted,
        run_after = CASE WHEN u.status = 'pending'
                         THEN now() + make_interval(secs => u.delay) ELSE o.run_after END,
        last_error = COALESCE(u.error, o.last_error),
        finished_at = CASE WHEN u.status <> 'pending' THEN now() END,
        claims = u.token,  -- unchanged; see RECORD
        locked_by = NULL,
        locked_until = NULL
    FROM u
    WHERE o.id = u.id AND u.status <> 'delivered'
      AND o.claims = u.token AND o.status = 'running' AND o.locked_by = $7
    RETURNING o.id, o.claims
)
SELECT id, claims FROM gone UNION ALL SELECT id, claims FROM kept
"""

PAUSED_TABLE = "outbox_paused"

RELAYS_TABLE = "outbox_relays"

PAUSED = "SELECT destination FROM {paused}"

# Jobs that one relay at a time should run take this lock in their own short transaction. It
# is released at commit or when the connection dies, so a crashed relay never holds it.
TRY_JOB_LOCK = "SELECT pg_try_advisory_xact_lock(hashtextextended('outbox-relay:' || $1, 0))"

# Pending rows per destination, for the gauges: the partial claim index holds exactly them.
PENDING_BY_DESTINATION = """
SELECT destination, count(*) AS rows,
       extract(epoch FROM now() - min(created_at))::float8 AS oldest_age
FROM {table}
WHERE status = 'pending'
GROUP BY destination
"""

PING = "SELECT 1"

# A relay says it is alive, and what it serves, every few seconds (one row per relay).
REGISTER = """
INSERT INTO {relays} (relay_id, host, pid, version, destinations)
VALUES ($1, $2, $3, $4, $5::text[])
ON CONFLICT (relay_id) DO UPDATE
SET host = EXCLUDED.host, pid = EXCLUDED.pid, version = EXCLUDED.version,
    destinations = EXCLUDED.destinations, seen_at = now(), stopped_at = NULL
"""

# On a clean stop. The row stays: its destinations still count as served for a while, so a
# rolling restart does not make another relay fail their rows as unknown.
UNREGISTER = "UPDATE {relays} SET stopped_at = now(), seen_at = now() WHERE relay_id = $1"

FORGET_RELAYS = "DELETE FROM {relays} WHERE seen_at < now() - make_interval(secs => $1)"

# The batch is picked in a CTE, which runs once: as `id IN (SELECT … LIMIT n)` the planner
# may choose a nested loop that re-runs the LIMIT subquery and deletes more than n rows.
PURGE_DELIVERED = """
WITH doomed AS (
    SELECT id FROM {table}
    WHERE status = 'delivered' AND delivered_at < now() - make_interval(secs => $1)
      AND ($2::text[] IS NULL OR destination = ANY($2::text[]))
    ORDER BY delivered_at
    LIMIT $3
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {table} AS o
USING doomed
WHERE o.id = doomed.id AND o.status = 'delivered'
"""

# Failed or skipped rows ($4: which of the two) that ended more than $1 seconds ago.
PURGE_FINISHED = """
WITH doomed AS (
    SELECT id FROM {table}
    WHERE status IN ('failed', 'skipped') AND status = ANY($4::text[])
      AND coalesce(finished_at, created_at) < now() - make_interval(secs => $1)
      AND ($2::text[] IS NULL OR destination = ANY($2::text[]))
    ORDER BY coalesce(finished_at, created_at)
    LIMIT $3
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {table} AS o
USING doomed
WHERE o.id = doomed.id AND o.status = ANY($4::text[])
"""

# The visibility fence (see migrations/0003), read in a statement of its own *before* the
# ordered claim, whose snapshot must be younger than this reading: a transaction that commits
# between a claim's snapshot and its reading of pg_locks would release its lock while its
# rows stay invisible to that claim. Every id up to the result belongs to a transaction that
# had finished when it was read: the smallest fence key still held (taken before its holder
# drew any id), capped at the highest id then visible (ids are drawn in increasing order, so
# a row at or below it was drawn before this reading, and so were all lower ids). Only this
# table's keys count ($1: the table; see migrations/0004 for the key's layout), and untagged
# keys of inserts that began under the trigger of migration 0003: an untagged key is ignored
# only when its transaction holds a tagged key of the same value (the pair the new trigger
# takes together).
FENCE = """
WITH held AS (
    SELECT l.virtualtransaction AS vxid,
           ((l.classid::bigint << 32) | l.objid::bigint) - 4611686018427387904 AS k
    FROM pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.objsubid = 1
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid::bigint >= 1073741824 AND l.classid::bigint < 2147483648
),
fence_keys AS (
    SELECT vxid, k >> 48 AS tag, k & 281474976710655 AS v FROM held
)
SELECT least(
    (SELECT coalesce(min(a.v), 9223372036854775807) FROM fence_keys AS a
     WHERE a.tag = 1 + mod($1::regclass::oid::bigint, 16383)
        OR (a.tag = 0 AND NOT EXISTS (SELECT 1 FROM fence_keys AS b
                                      WHERE b.vxid = a.vxid AND b.tag > 0 AND b.v = a.v))),
    (SELECT coalesce(max(id), 0) FROM {table})
)
"""

# The ordered claim, one statement per ordered destination ($1). It walks the destination's
# keys that have open rows in key order with a loose index scan (a recursive CTE that jumps
# from key to key on outbox_key_idx), starting after the cursor $7 (NULL: from the first
# key), at most $5 keys. A key's head is its lowest open row: pending, running, or failed
# unless the destination parks poison rows ($6). A head is claimed if it is pending, due, and
# inside the fence ($8, read by FENCE just before); a key whose head is running, backing off,
# blocked or too new is passed over, and nothing behind a head is ever looked at, so no state
# has to be kept for waiting rows. Rows without a key are not ordered and are claimed as they
# come. The last row of the result (id -1) carries the cursor for the next claim in `key`: the
# last key claimed when the batch filled up, the last key examined when the scan limit cut it
# short, NULL when the scan reached the end (start again from the first key).
CLAIM_ORDERED = """
WITH RECURSIVE k AS (
    (SELECT o.key, 1 AS n FROM {table} AS o
     WHERE o.destination = $1 AND ($7::text IS NULL OR o.key > $7::text)
       AND o.key IS NOT NULL AND o.status IN ('pending', 'running', 'failed')
     ORDER BY o.key
     LIMIT 1)
    UNION ALL
    SELECT nxt.key, k.n + 1
    FROM k CROSS JOIN LATERAL (
        SELECT o.key FROM {table} AS o
        WHERE o.destination = $1 AND o.key > k.key
          AND o.status IN ('pending', 'running', 'failed')
        ORDER BY o.key
        LIMIT 1
    ) AS nxt
    WHERE k.n < $5
),
heads AS (
    SELECT h.id, k.key FROM k
    CROSS JOIN LATERAL (
        SELECT o.id, o.status, o.run_after FROM {table} AS o
        WHERE o.destination = $1 AND o.key = k.key
          AND o.status IN ('pending', 'running', 'failed')
          AND (o.status <> 'failed' OR NOT $6::bool)
        ORDER BY o.id
        LIMIT 1
    ) AS h
    WHERE h.status = 'pending' AND h.run_after <= now()
      AND h.id <= $8
    LIMIT $2
),
unkeyed AS (
    SELECT o.id FROM {table} AS o
    WHERE o.destination = $1 AND o.status = 'pending' AND o.key IS NULL
      AND o.run_after <= now()
    ORDER BY o.run_after, o.id
    LIMIT $2
),
locked AS (
    -- Another relay may have claimed a head since this statement's snapshot: the lock
    -- re-reads the row and the status check drops it.
    SELECT o.id FROM {table} AS o
    WHERE o.id = ANY(ARRAY(SELECT id FROM heads UNION ALL SELECT id FROM unkeyed))
      AND o.status = 'pending'
    ORDER BY o.id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
claimed AS (
    UPDATE {table} AS o
    SET status = 'running', locked_by = $3, locked_until = now() + make_interval(secs => $4),
        claims = o.claims + 1
    WHERE o.id = ANY(ARRAY(SELECT id FROM locked))
    RETURNING o.id, o.destination, o.key, o.payload, o.content_type, o.headers::text AS headers,
              o.attempts, extract(epoch FROM o.created_at)::float8 AS created_at, o.claims
)
SELECT * FROM claimed
UNION ALL
SELECT -1, NULL, CASE
           WHEN (SELECT count(*) FROM heads) >= $2 THEN (SELECT max(key) FROM heads)
           WHEN (SELECT count(*) FROM k) >= $5 THEN (SELECT key FROM k ORDER BY n DESC LIMIT 1)
       END,
       NULL, NULL, NULL, 0, NULL, 0
"""

# Keys held up by a failed row: a key's first failed row with later rows of the key pending
# behind it. For a destination with ordering = "key" and poison_policy = "block" those rows
# wait; elsewhere they flow anyway. $1: destinations, or NULL for all.
BLOCKED_KEYS = """
SELECT f.destination, f.key, f.id AS failed_id, f.last_error, count(n.id) AS waiting
FROM {table} AS f
JOIN {table} AS n
  ON n.destination = f.destination AND n.key = f.key AND n.id > f.id AND n.status = 'pending'
WHERE f.status = 'failed' AND f.key IS NOT NULL
  AND ($1::text[] IS NULL OR f.destination = ANY($1::text[]))
  AND NOT EXISTS (SELECT 1 FROM {table} AS e
                  WHERE e.destination = f.destination AND e.key = f.key AND e.id < f.id
                    AND e.status = 'failed')
GROUP BY f.destination, f.key, f.id, f.last_error
ORDER BY f.destination, f.key
"""
