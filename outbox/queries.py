"""Every SQL statement of outbox-relay, in one place.

Statements name the table as ``{table}``; :func:`render` fills in the quoted, schema-qualified
name once, when an :class:`~outbox.Outbox` or a relay is created. Values are always bound
parameters, never formatted in.
"""

from __future__ import annotations


def quote_ident(name: str) -> str:
    """Quote an SQL identifier the way PostgreSQL's quote_ident() does, always."""
    if not name or "\x00" in name:
        raise ValueError(f"invalid SQL identifier {name!r}")
    return '"' + name.replace('"', '""') + '"'


def qualified_table(schema: str, table: str = "outbox") -> str:
    return f"{quote_ident(schema)}.{quote_ident(table)}"


def render(sql: str, table: str) -> str:
    return sql.replace("{table}", table)


def render_schema(sql: str, schema: str) -> str:
    return sql.replace("{schema}", quote_ident(schema))


def render_database(sql: str, name: str) -> str:
    return sql.replace("{database}", quote_ident(name))


# Scratch databases of the demo and the benchmark.
CREATE_DATABASE = "CREATE DATABASE {database}"
DROP_DATABASE = "DROP DATABASE IF EXISTS {database} WITH (FORCE)"


def render_ops(sql: str, schema: str) -> str:
    """Fill in ``{table}`` (the outbox) and ``{paused}`` (outbox_paused) of ``schema``."""
    return sql.replace("{table}", qualified_table(schema)).replace(
        "{paused}", qualified_table(schema, PAUSED_TABLE)
    )


# --- enqueue --------------------------------------------------------------------------------

# SQLAlchemy text() form (named binds); works for every SQLAlchemy PostgreSQL driver.
ENQUEUE_SA = """
INSERT INTO {table} (destination, key, payload, content_type, headers, run_after)
VALUES (:destination, :key, :payload, :content_type, CAST(:headers AS jsonb),
        COALESCE(CAST(:run_after AS timestamptz), now()))
RETURNING id
"""

ENQUEUE_PG = """
INSERT INTO {table} (destination, key, payload, content_type, headers, run_after)
VALUES ($1, $2, $3, $4, $5::jsonb, COALESCE($6::timestamptz, now()))
RETURNING id
"""

# Many rows in one statement. Identity values are drawn in the order unnest yields rows, so
# the ascending ids correspond to the input order.
ENQUEUE_MANY_SA = """
INSERT INTO {table} (destination, key, payload, content_type, headers, run_after)
SELECT d, k, p, c, h::jsonb, COALESCE(r, now())
FROM unnest(CAST(:destinations AS text[]), CAST(:keys AS text[]), CAST(:payloads AS bytea[]),
            CAST(:content_types AS text[]), CAST(:headers AS text[]),
            CAST(:run_afters AS timestamptz[])) AS u(d, k, p, c, h, r)
RETURNING id
"""

ENQUEUE_MANY_PG = """
INSERT INTO {table} (destination, key, payload, content_type, headers, run_after)
SELECT d, k, p, c, h::jsonb, COALESCE(r, now())
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[], $5::text[], $6::timestamptz[])
     AS u(d, k, p, c, h, r)
RETURNING id
"""

# --- migrations -----------------------------------------------------------------------------

MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS outbox_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""

SCHEMA_EXISTS = "SELECT to_regnamespace($1) IS NOT NULL"
MIGRATIONS_TABLE_EXISTS = "SELECT to_regclass($1 || '.outbox_migrations') IS NOT NULL"
APPLIED_MIGRATIONS = "SELECT version FROM {schema}.outbox_migrations ORDER BY version"
CREATE_SCHEMA = "CREATE SCHEMA IF NOT EXISTS {schema}"
# SET LOCAL keeps the connection's own search_path once the migration's transaction ends.
USE_SCHEMA = "SET LOCAL search_path TO {schema}"

RECORD_MIGRATION = "INSERT INTO outbox_migrations (version, name) VALUES ($1, $2)"

# A fixed key so concurrent `migrate` runs on one database queue up instead of racing.
MIGRATE_LOCK = "SELECT pg_advisory_lock(hashtextextended('outbox-relay:migrate:' || $1, 0))"
MIGRATE_UNLOCK = "SELECT pg_advisory_unlock(hashtextextended('outbox-relay:migrate:' || $1, 0))"

TABLE_EXISTS = "SELECT to_regclass($1) IS NOT NULL"

# --- relay ----------------------------------------------------------------------------------

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
SET status = 'running', locked_by = $3, locked_until = now() + make_interval(secs => $4)
WHERE o.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING o.id, o.destination, o.key, o.payload, o.content_type, o.headers::text,
          o.attempts, o.created_at
"""

# All outcomes of a batch in one statement. Only rows this relay still holds are touched: if
# its lease expired and another relay took a row over, that relay's outcome wins.
RECORD = """
UPDATE {table} AS o
SET status = u.status,
    attempts = o.attempts + u.counted,
    run_after = CASE WHEN u.status = 'pending'
                     THEN now() + make_interval(secs => u.delay) ELSE o.run_after END,
    last_error = COALESCE(u.error, o.last_error),
    delivered_at = CASE WHEN u.status = 'delivered' THEN now() END,
    locked_by = NULL,
    locked_until = NULL
FROM unnest($1::bigint[], $2::text[], $3::int[], $4::float8[], $5::text[])
     AS u(id, status, counted, delay, error)
WHERE o.id = u.id AND o.status = 'running' AND o.locked_by = $6
"""

HEARTBEAT = """
UPDATE {table} SET locked_until = now() + make_interval(secs => $3)
WHERE id = ANY($1::bigint[]) AND status = 'running' AND locked_by = $2
"""

# Rows whose relay stopped heartbeating go back to pending (or to failed once they have used
# every attempt: a row that crashes its relay each time must not loop for ever). $3/$4 give
# per-destination attempt limits; $1 is the limit for any other destination.
REAP = """
WITH expired AS (
    SELECT id FROM {table}
    WHERE status = 'running' AND locked_until < now()
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
    locked_by = NULL,
    locked_until = NULL
FROM expired
WHERE o.id = expired.id
RETURNING o.id, o.status, o.destination
"""

# On clean shutdown: rows claimed but not attempted go back untouched (no attempt counted).
RELEASE = """
UPDATE {table}
SET status = 'pending', locked_by = NULL, locked_until = NULL, run_after = now()
WHERE status = 'running' AND locked_by = $1 AND id = ANY($2::bigint[])
"""

UNKNOWN_DESTINATIONS = """
SELECT destination, count(*) AS rows, min(created_at) AS oldest
FROM {table}
WHERE status = 'pending' AND NOT (destination = ANY($1::text[]))
GROUP BY destination
ORDER BY destination
"""

FAIL_UNKNOWN_DESTINATIONS = """
UPDATE {table}
SET status = 'failed',
    last_error = 'unknown destination ' || quote_literal(destination)
                 || ': add it to the relay config, then run outbox-relay retry'
WHERE status = 'pending' AND NOT (destination = ANY($1::text[]))
RETURNING destination
"""

# With retention = 0: delivered rows are deleted by the statement that records them, the rest
# updated as in RECORD. Still one statement; the two parts touch disjoint rows.
RECORD_DELETING = """
WITH u AS (
    SELECT * FROM unnest($1::bigint[], $2::text[], $3::int[], $4::float8[], $5::text[])
         AS u(id, status, counted, delay, error)
),
gone AS (
    DELETE FROM {table} AS o
    USING u
    WHERE o.id = u.id AND u.status = 'delivered' AND o.status = 'running' AND o.locked_by = $6
)
UPDATE {table} AS o
SET status = u.status,
    attempts = o.attempts + u.counted,
    run_after = CASE WHEN u.status = 'pending'
                     THEN now() + make_interval(secs => u.delay) ELSE o.run_after END,
    last_error = COALESCE(u.error, o.last_error),
    locked_by = NULL,
    locked_until = NULL
FROM u
WHERE o.id = u.id AND u.status <> 'delivered' AND o.status = 'running' AND o.locked_by = $6
"""

# --- operations: pause, retention, gauges -----------------------------------------------------

PAUSED_TABLE = "outbox_paused"
PAUSED = "SELECT destination FROM {paused}"

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
NOTIFY = "SELECT pg_notify($1, '')"

# --- operations: the CLI ----------------------------------------------------------------------

STATUS_COUNTS = """
SELECT destination,
       count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'pending' AND run_after <= now()) AS due,
       count(*) FILTER (WHERE status = 'running') AS running,
       count(*) FILTER (WHERE status = 'delivered') AS delivered,
       count(*) FILTER (WHERE status = 'failed') AS failed,
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
SET status = 'pending', attempts = 0, run_after = now(), locked_by = NULL, locked_until = NULL
FROM matching
WHERE o.id = matching.id
RETURNING o.id, o.destination
"""
)

ID_STATUSES = "SELECT id, status FROM {table} WHERE id = ANY($1::bigint[])"

# purge: delivered rows age from delivered_at (found through outbox_delivered_idx), failed
# rows from created_at. $1: seconds, $2: destinations or NULL, $3: batch size.
PURGE_PREVIEW = """
SELECT destination, status, count(*) AS rows
FROM {table}
WHERE ((status = 'delivered' AND delivered_at < now() - make_interval(secs => $1))
       OR (status = 'failed' AND $3::bool AND created_at < now() - make_interval(secs => $1)))
  AND ($2::text[] IS NULL OR destination = ANY($2::text[]))
GROUP BY destination, status
ORDER BY destination, status
"""

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

PURGE_FAILED = """
WITH doomed AS (
    SELECT id FROM {table}
    WHERE status = 'failed' AND created_at < now() - make_interval(secs => $1)
      AND ($2::text[] IS NULL OR destination = ANY($2::text[]))
    ORDER BY id
    LIMIT $3
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {table} AS o
USING doomed
WHERE o.id = doomed.id AND o.status = 'failed'
"""

# --- per-key ordered delivery ----------------------------------------------------------------

# The visibility fence (see migrations/0003), read in a statement of its own *before* the
# ordered claim, whose snapshot must be younger than this reading: a transaction that commits
# between a claim's snapshot and its reading of pg_locks would release its lock while its
# rows stay invisible to that claim. Every id up to the result belongs to a transaction that
# had finished when it was read: the smallest fence key still held (taken before its holder
# drew any id), capped at the highest id then visible (ids are drawn in increasing order, so
# a row at or below it was drawn before this reading, and so were all lower ids).
FENCE = """
SELECT least(
    (SELECT coalesce(min(((l.classid::bigint << 32) | l.objid::bigint) - 4611686018427387904),
                     9223372036854775807)
     FROM pg_locks AS l
     WHERE l.locktype = 'advisory' AND l.objsubid = 1
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND l.classid >= 1073741824 AND l.classid < 1342177280),
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
    SET status = 'running', locked_by = $3, locked_until = now() + make_interval(secs => $4)
    WHERE o.id = ANY(ARRAY(SELECT id FROM locked))
    RETURNING o.id, o.destination, o.key, o.payload, o.content_type, o.headers::text AS headers,
              o.attempts, o.created_at
)
SELECT * FROM claimed
UNION ALL
SELECT -1, NULL, CASE
           WHEN (SELECT count(*) FROM heads) >= $2 THEN (SELECT max(key) FROM heads)
           WHEN (SELECT count(*) FROM k) >= $5 THEN (SELECT key FROM k ORDER BY n DESC LIMIT 1)
       END,
       NULL, NULL, NULL, 0, NULL
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

# An operator gives up on failed rows: they will not be delivered, and an ordered key they
# were blocking moves on (its next row is the key's head from now on).
SKIP = """
UPDATE {table}
SET status = 'skipped',
    last_error = coalesce(last_error, '') || ' [skipped by ' || $2 || ' at ' || now() || ']'
WHERE id = ANY($1::bigint[]) AND status = 'failed'
RETURNING id, destination, key
"""
