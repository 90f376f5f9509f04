-- The statements of the operations commands (status, show, list, retry, purge, pause, skip),
-- which relay/ops/ runs through relay/ops/queries.py; replay's are in relay/ops/replay.sql,
-- the endpoints commands' in relay/ops/endpoints.sql. They are asyncpg's (:name binds handed
-- out as $1, $2, … in their params' order: outbox/sql.py); see
-- relay/db/queries/ for how {table}, {paused} and {relays} are filled in, and
-- outbox.queries.render_endpoints for {endpoints}, {deliveries} and {attempts}.
--
-- A preview's selection (retry_selection, purge_selection, and replay.sql's
-- replay_endpoint_selection): what a preview matched, for its confirmation to act on exactly
-- those rows (admin.Selection): how many, the highest id, and a digest of the ids that does not
-- depend on their order (a sum of their hashes: any row that leaves or joins the set changes
-- it), with the clock the windows were measured from; then the FROM … WHERE of the statement's
-- own filter.

-- name: paused_detail

SELECT destination, paused_at, paused_by, reason FROM {paused} ORDER BY destination

-- name: pause
-- params: destination, paused_by, reason

INSERT INTO {paused} (destination, paused_by, reason)
VALUES (:destination, :paused_by, :reason)
ON CONFLICT (destination) DO UPDATE
SET reason = COALESCE(EXCLUDED.reason, {paused}.reason)
RETURNING paused_at, (xmax = 0) AS inserted

-- name: resume
-- params: destination
DELETE FROM {paused} WHERE destination = :destination RETURNING paused_at

-- name: relays
-- circuits and features through to_jsonb: a schema before migration 0010 (0013) has no such
-- column. How each claims its unordered destinations, as relay/db/queries/registry.sql's
-- mixed_claims reads it: under batch leases if its last registration said so (features
-- written then), else by row (a relay of an earlier release says nothing).

SELECT relay_id, host, pid, version, destinations, started_at, seen_at, stopped_at,
       extract(epoch FROM now() - seen_at)::float8 AS seen_age,
       coalesce(to_jsonb(r) -> 'circuits', '{}'::jsonb)::text AS circuits,
       CASE WHEN coalesce(to_jsonb(r) -> 'features', '[]'::jsonb) ? 'batch-claims'
                 AND to_jsonb(r) -> 'features_at' = to_jsonb(r) -> 'seen_at'
            THEN 'batch' ELSE 'row' END AS claims
FROM {relays} AS r
ORDER BY relay_id

-- name: jit_off
-- `status` aggregates over the partial indexes: compiling them (JIT) costs more than it saves.
SET LOCAL jit = off

-- name: status_counts
-- `status` counts what the partial indexes hold exactly: pending rows (outbox_claim_idx) and
-- running ones (outbox_lease_idx) here, failed and skipped ones (outbox_finished_idx) in
-- status_ended. Those are few next to the delivered history, which status_delivered counts
-- only while it is small (see admin.status); past that it is estimated from the table's
-- statistics (status_estimate): an exact count of millions of delivered rows reads them all.

WITH pending AS (
    SELECT destination, count(*) AS pending, count(*) FILTER (WHERE run_after <= now()) AS due,
           min(created_at) AS oldest
    FROM {table}
    WHERE status = 'pending'
    GROUP BY destination
),
running AS (
    SELECT destination, count(*) AS running
    FROM {table}
    WHERE status = 'running'
    GROUP BY destination
)
SELECT destination, coalesce(pending, 0) AS pending, coalesce(due, 0) AS due,
       coalesce(running, 0) AS running,
       extract(epoch FROM now() - oldest)::float8 AS oldest_pending_age
FROM pending
FULL JOIN running USING (destination)
ORDER BY destination

-- name: status_ended
-- Failed rows by destination and error, and skipped rows by destination (their errors carry
-- who skipped them and when): one pass over outbox_finished_idx.

SELECT destination, status, CASE WHEN status = 'failed' THEN last_error END AS last_error,
       count(*) AS rows
FROM {table}
WHERE status IN ('failed', 'skipped')
GROUP BY 1, 2, 3
ORDER BY destination, rows DESC

-- name: status_delivered_probe
-- params: limit
-- Delivered rows, up to :limit of them (an index-only scan of outbox_delivered_idx): whether
-- there are few enough to count exactly.

SELECT count(*) FROM (SELECT 1 FROM {table} WHERE status = 'delivered' LIMIT :limit) AS few

-- name: status_delivered

SELECT destination, count(*) AS delivered, max(delivered_at) AS last_delivered_at
FROM {table}
WHERE status = 'delivered'
GROUP BY destination

-- name: status_delivered_latest
-- params: limit
-- The newest :limit deliveries, walked back through outbox_delivered_idx: each destination among
-- them and its last delivery (when there are too many delivered rows to read them all).

SELECT destination, max(delivered_at) AS last_delivered_at
FROM (SELECT destination, delivered_at
      FROM {table}
      WHERE status = 'delivered'
      ORDER BY delivered_at DESC
      LIMIT :limit) AS latest
GROUP BY destination

-- name: status_estimate
-- params: table, schema
-- What the planner knows of the outbox (:table, the qualified table; :schema its schema): its rows at
-- the last VACUUM or ANALYZE and the pages they filled then, the pages it has now, and the
-- destinations' shares (the most common values and the rest). No row of pg_stats: not yet
-- analyzed.

SELECT c.reltuples::float8 AS reltuples, c.relpages::float8 AS relpages,
       (pg_relation_size(c.oid) / current_setting('block_size')::int)::float8 AS pages,
       s.most_common_vals::text::text[] AS common, s.most_common_freqs::float8[] AS freqs,
       s.null_frac::float8 AS null_frac, s.n_distinct::float8 AS n_distinct,
       s.attname IS NOT NULL AS analyzed
FROM pg_class AS c
LEFT JOIN pg_stats AS s
  ON s.schemaname = :schema AND s.tablename = 'outbox' AND s.attname = 'destination'
WHERE c.oid = :table::regclass

-- name: status_leases

SELECT destination, locked_by, count(*) AS rows,
       extract(epoch FROM min(locked_until) - now())::float8 AS lease_left
FROM {table}
WHERE status = 'running'
GROUP BY destination, locked_by
ORDER BY destination, locked_by

-- name: status_batched
-- Rows in flight under batch leases (relay.claims = "batch"): the fresh rows of each open
-- batch's range, which the table shows pending. status counts them running, with their relay
-- and lease, as status_leases does rows claimed one by one. Read through outbox_fresh_idx,
-- only in the ranges of open batches (a few).

SELECT b.destination, b.relay AS locked_by, count(o.id) AS rows,
       extract(epoch FROM min(b.lease_until) - now())::float8 AS lease_left
FROM {batches} AS b
JOIN {table} AS o
  ON o.destination = b.destination AND o.id > b.first_id AND o.id <= b.last_id
 AND o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at
WHERE b.relay IS NOT NULL
GROUP BY b.destination, b.relay
ORDER BY b.destination, b.relay

-- name: status_blocked_keys
-- BLOCKED_KEYS for `status` (the relay's reporter runs relay.db.queries.BLOCKED_KEYS): the same
-- rows, planned per failed row with a key: one probe of outbox_key_idx (which holds the
-- pending and failed rows of each key) counts the pending rows behind it and sees
-- whether an older failed row blocks the key first. No sort of every pending keyed row.

SELECT f.destination, f.key, f.id AS failed_id, f.last_error, k.waiting
FROM {table} AS f
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE n.status = 'pending' AND n.id > f.id) AS waiting,
           count(*) FILTER (WHERE n.status = 'failed' AND n.id < f.id) AS failed_before
    FROM {table} AS n
    WHERE n.destination = f.destination AND n.key = f.key AND n.key IS NOT NULL
      AND n.status IN ('pending', 'failed')
) AS k
WHERE f.status = 'failed' AND f.key IS NOT NULL AND k.waiting > 0 AND k.failed_before = 0
ORDER BY f.destination, f.key

-- name: show
-- params: ids, payload_bytes

SELECT id, destination, key, status, attempts, run_after, locked_by, locked_until, last_error,
       created_at, delivered_at, content_type, headers::text AS headers,
       octet_length(payload) AS payload_bytes, substring(payload FROM 1 FOR :payload_bytes) AS payload_head
FROM {table}
WHERE id = ANY(:ids::bigint[])
ORDER BY id

-- name: retry_selection
-- params: destinations, ids, since, error_like, max_id
-- The failed rows matching the retry filters, as a selection; a NULL filter matches
-- everything. :max_id bounds the ids when a preview is confirmed: rows that failed since, with
-- higher ids, are not the preview's. retry_preview and retry filter the same way (written
-- alike, tests/test_sql_files.py checks it).

SELECT count(*) AS rows, coalesce(max(id), 0) AS max_id,
       coalesce(sum(hashint8extended(id, 0)::numeric), 0)::text AS digest, now() AS at

FROM {table}
WHERE status = 'failed'
  AND (:destinations::text[] IS NULL OR destination = ANY(:destinations::text[]))
  AND (:ids::bigint[] IS NULL OR id = ANY(:ids::bigint[]))
  AND (:since::timestamptz IS NULL OR created_at >= :since::timestamptz)
  AND (:error_like::text IS NULL OR last_error ILIKE :error_like::text)
  AND (:max_id::bigint IS NULL OR id <= :max_id::bigint)

-- name: retry_preview
-- params: destinations, ids, since, error_like, max_id

SELECT destination, count(*) AS rows, min(id) AS first_id, max(id) AS last_id

FROM {table}
WHERE status = 'failed'
  AND (:destinations::text[] IS NULL OR destination = ANY(:destinations::text[]))
  AND (:ids::bigint[] IS NULL OR id = ANY(:ids::bigint[]))
  AND (:since::timestamptz IS NULL OR created_at >= :since::timestamptz)
  AND (:error_like::text IS NULL OR last_error ILIKE :error_like::text)
  AND (:max_id::bigint IS NULL OR id <= :max_id::bigint)

GROUP BY destination
ORDER BY destination

-- name: retry
-- params: destinations, ids, since, error_like, max_id

WITH matching AS (
    SELECT id

FROM {table}
WHERE status = 'failed'
  AND (:destinations::text[] IS NULL OR destination = ANY(:destinations::text[]))
  AND (:ids::bigint[] IS NULL OR id = ANY(:ids::bigint[]))
  AND (:since::timestamptz IS NULL OR created_at >= :since::timestamptz)
  AND (:error_like::text IS NULL OR last_error ILIKE :error_like::text)
  AND (:max_id::bigint IS NULL OR id <= :max_id::bigint)

    FOR UPDATE
)
UPDATE {table} AS o
SET status = 'pending', attempts = 0, run_after = now(), locked_by = NULL, locked_until = NULL,
    finished_at = NULL
FROM matching
WHERE o.id = matching.id
RETURNING o.id, o.destination

-- name: id_statuses
-- params: ids
SELECT id, destination, status FROM {table} WHERE id = ANY(:ids::bigint[])

-- name: purge_preview
-- params: older_than_seconds, destinations, include_failed
-- purge: delivered rows age from delivered_at (found through outbox_delivered_idx), skipped
-- and failed rows from finished_at, when they got that status (outbox_finished_idx; rows that
-- ended before migration 0004 have none and age from created_at).
-- Destinations NULL for all; include_failed: whether failed rows go too.

SELECT destination, status, count(*) AS rows
FROM {table}
WHERE ((status = 'delivered' AND delivered_at < now() - make_interval(secs => :older_than_seconds))
       OR (status IN ('failed', 'skipped')
           AND (status = 'skipped' OR :include_failed::bool)
           AND coalesce(finished_at, created_at) < now() - make_interval(secs => :older_than_seconds)))
  AND (:destinations::text[] IS NULL OR destination = ANY(:destinations::text[]))
GROUP BY destination, status
ORDER BY destination, status

-- name: purge_selection
-- params: older_than_seconds, destinations, include_failed, as_of, max_id
-- The rows purge_preview counts, as a selection (as_of: the clock "older than" is measured
-- from, NULL for now(); max_id: the highest id, or NULL).

SELECT count(*) AS rows, coalesce(max(id), 0) AS max_id,
       coalesce(sum(hashint8extended(id, 0)::numeric), 0)::text AS digest, now() AS at

FROM {table}
WHERE ((status = 'delivered'
        AND delivered_at < coalesce(:as_of::timestamptz, now()) - make_interval(secs => :older_than_seconds))
       OR (status IN ('failed', 'skipped')
           AND (status = 'skipped' OR :include_failed::bool)
           AND coalesce(finished_at, created_at)
               < coalesce(:as_of::timestamptz, now()) - make_interval(secs => :older_than_seconds)))
  AND (:destinations::text[] IS NULL OR destination = ANY(:destinations::text[]))
  AND (:max_id::bigint IS NULL OR id <= :max_id::bigint)

-- name: purge_selected_delivered
-- params: older_than_seconds, destinations, batch, as_of, max_id
-- A confirmed preview's purge, in batches as the relay's (relay/db/queries/retention.sql's
-- purge_delivered, purge_finished, each followed by delete_locked: change them together; the
-- NOT (SELECT EXISTS …) is its open-delivery test, written alike, tests/test_sql_files.py
-- checks it), within its selection: aged as of the preview's clock (:as_of with the seconds :older_than_seconds), ids up to
-- its highest (:max_id). Rows only leave that set (their timestamps are set when they end, to a
-- later time), so no batch deletes a row the preview did not count.

SELECT id FROM {table} AS o
WHERE status = 'delivered' AND delivered_at < :as_of::timestamptz - make_interval(secs => :older_than_seconds)
  AND (:destinations::text[] IS NULL OR destination = ANY(:destinations::text[]))
  AND id <= :max_id::bigint
  AND NOT (SELECT EXISTS (
          SELECT 1 FROM {deliveries} AS d
          WHERE d.event_id = o.id AND d.status IN ('pending', 'running')))
ORDER BY delivered_at
LIMIT :batch
FOR UPDATE SKIP LOCKED

-- name: purge_selected_finished
-- params: older_than_seconds, destinations, batch, as_of, max_id, statuses
-- statuses: which of failed and skipped.

SELECT id FROM {table} AS o
WHERE status IN ('failed', 'skipped') AND status = ANY(:statuses::text[])
  AND coalesce(finished_at, created_at) < :as_of::timestamptz - make_interval(secs => :older_than_seconds)
  AND (:destinations::text[] IS NULL OR destination = ANY(:destinations::text[]))
  AND id <= :max_id::bigint
  AND NOT (SELECT EXISTS (
          SELECT 1 FROM {deliveries} AS d
          WHERE d.event_id = o.id AND d.status IN ('pending', 'running')))
ORDER BY coalesce(finished_at, created_at)
LIMIT :batch
FOR UPDATE SKIP LOCKED

-- name: skip
-- params: ids, skipped_by
-- An operator gives up on failed rows: they will not be delivered, and an ordered key they
-- were blocking moves on (its next row is the key's head from now on).

UPDATE {table}
SET status = 'skipped',
    finished_at = now(),
    last_error = coalesce(last_error, '') || ' [skipped by ' || :skipped_by || ' at ' || now() || ']'
WHERE id = ANY(:ids::bigint[]) AND status = 'failed'
RETURNING id, destination, key

-- name: endpoint_tables_exist
-- params: endpoints, deliveries, attempts
-- Endpoints in show, status and replay. Their URLs are read to be cut down to their origin:
-- the commands never print a path or query, nor a secret.

SELECT to_regclass(:endpoints) IS NOT NULL AND to_regclass(:deliveries) IS NOT NULL AND to_regclass(:attempts) IS NOT NULL

-- name: show_deliveries
-- params: ids
-- `show`: the deliveries of these events (the unique index on (event_id, endpoint_id)), the
-- ones that need a look first. An endpoint deleted since has no URL.

SELECT d.id, d.event_id, d.endpoint_id, e.url, d.status, d.attempts, d.last_status,
       d.last_error, d.run_after, d.locked_by, d.created_at, d.finished_at
FROM {deliveries} AS d
LEFT JOIN {endpoints} AS e ON e.id = d.endpoint_id
WHERE d.event_id = ANY(:ids::bigint[])
ORDER BY d.event_id,
         CASE d.status WHEN 'failed' THEN 0 WHEN 'running' THEN 1 WHEN 'pending' THEN 2
                       WHEN 'cancelled' THEN 3 ELSE 4 END,
         d.endpoint_id

-- name: show_attempts
-- params: ids
-- `show`: the message log of these events (outbox_attempts_event_idx), oldest first.

SELECT id, delivery_id, event_id, endpoint_id, at, http_status, duration_ms, response, error,
       replay
FROM {attempts}
WHERE event_id = ANY(:ids::bigint[])
ORDER BY event_id, at, id

-- name: status_endpoints
-- params: limit
-- `status`: the endpoints, those that need a look first (pending deliveries, failing or
-- disabled), at most :limit. Pending deliveries are counted from the claim's two lanes alone
-- (their count and lowest id per endpoint, an index-only scan of outbox_deliveries_fresh_idx
-- and one of outbox_deliveries_waiting_idx: together they hold every pending delivery, once),
-- and the age of the oldest is read from that one row; the last HTTP status is the newest
-- attempt's (outbox_attempts_endpoint_idx). total and needing_attention count every endpoint.

WITH waiting AS (
    SELECT endpoint_id, sum(n)::bigint AS pending, min(oldest_id) AS oldest_id
    FROM (
        SELECT endpoint_id, count(*) AS n, min(id) AS oldest_id
        FROM {deliveries}
        WHERE status = 'pending' AND claims = 0 AND NOT replay AND run_after <= created_at
        GROUP BY endpoint_id
        UNION ALL
        SELECT endpoint_id, count(*), min(id)
        FROM {deliveries}
        WHERE status = 'pending' AND (claims <> 0 OR replay OR run_after > created_at)
        GROUP BY endpoint_id
    ) AS lanes
    GROUP BY endpoint_id
),
listed AS (
    SELECT e.id, e.destination, e.url, e.enabled, e.disabled_reason, e.disabled_at,
           e.failing_since, e.last_success_at, coalesce(w.pending, 0) AS pending, w.oldest_id,
           (NOT e.enabled OR e.failing_since IS NOT NULL OR w.pending IS NOT NULL) AS attention,
           count(*) OVER () AS total,
           count(*) FILTER (WHERE NOT e.enabled OR e.failing_since IS NOT NULL
                                  OR w.pending IS NOT NULL) OVER () AS needing_attention
    FROM {endpoints} AS e
    LEFT JOIN waiting AS w ON w.endpoint_id = e.id
    ORDER BY attention DESC, pending DESC, e.failing_since NULLS LAST, e.id
    LIMIT :limit
)
SELECT l.id, l.destination, l.url, l.enabled, l.disabled_reason, l.disabled_at,
       l.failing_since, l.last_success_at, l.pending, l.total, l.needing_attention,
       extract(epoch FROM now() - (SELECT d.created_at FROM {deliveries} AS d
                                   WHERE d.id = l.oldest_id))::float8 AS oldest_pending_age,
       a.http_status AS last_http_status, a.at AS last_attempt_at,
       -- Read through to_jsonb: a schema before migration 0009 has no such column.
       (SELECT CASE WHEN (to_jsonb(x) ->> 'circuit_open_until')::timestamptz > now()
                    THEN (to_jsonb(x) ->> 'circuit_open_until')::timestamptz END
        FROM {endpoints} AS x WHERE x.id = l.id) AS circuit_open_until
FROM listed AS l
LEFT JOIN LATERAL (
    SELECT http_status, at FROM {attempts}
    WHERE endpoint_id = l.id
    ORDER BY at DESC, id DESC
    LIMIT 1
) AS a ON true
ORDER BY l.attention DESC, l.pending DESC, l.failing_since NULLS LAST, l.id

-- name: list
-- `list`: rows newest first, a page at a time by keyset (id < the previous page's last id),
-- never OFFSET. relay/ops/rows.py joins the filters given with AND (queries.LIST_FILTERS). A
-- status is written in as a literal (one of outbox.status.Status, checked first), never bound,
-- so that the planner matches the partial indexes whose predicate is a status whatever plan it
-- caches; the other values are bound. {tenant} and {event_type} are the columns, or NULL before
-- migration 0006.
--
-- list walks the primary key backwards and stops after LIMIT matching rows: instant without a
-- filter, for delivered rows and for a backlog of pending ones (the newest rows), and the
-- planner takes outbox_claim_idx or outbox_key_idx instead where they hold fewer rows. A filter
-- no index serves (--error-like, a key or a destination alone) is checked on the rows of that
-- walk, which reads far back for a rare match: add a status, --min-id or --before-id.

SELECT id, destination, key, {tenant} AS tenant, {event_type} AS event_type, status,
       attempts, created_at, run_after, delivered_at, last_error
FROM {table}
WHERE {where}
ORDER BY id DESC
LIMIT {limit}

-- name: list_gathered
-- Running, failed and skipped rows (queries.LIST_GATHERED_STATUSES) are few next to the table,
-- each kind in a partial index (outbox_lease_idx, outbox_finished_idx), and failed ones are
-- often old (an incident last week): walking the primary key back to them would read every
-- newer row. They are gathered through their index first (MATERIALIZED: the LIMIT cannot turn
-- it into that walk), then sorted: a page costs the rows of that status (and filters) below
-- the keyset.

WITH matching AS MATERIALIZED (
    SELECT id, destination, key, {tenant} AS tenant, {event_type} AS event_type, status,
           attempts, created_at, run_after, delivered_at, last_error
    FROM {table}
    WHERE {where}
)
SELECT * FROM matching
ORDER BY id DESC
LIMIT {limit}

-- name: notify_endpoints
-- params: channel
-- A NOTIFY whose payload wakes the relays' endpoint deliveries as well as their claims (see
-- relay.app.Relay._notified): after a replay or a resume.
SELECT pg_notify(:channel, 'endpoints')
