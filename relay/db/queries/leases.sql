-- The leases of claimed rows: the fence every outcome, heartbeat and release goes through, the
-- heartbeat, the release on a clean stop, and the reaper's statements for leases that expired.
-- relay/db/queries/leases.py names them; they are asyncpg's (:name binds handed out as $1,
-- $2, … in their params' order: outbox/sql.py).
--
-- The fence of every outcome, heartbeat and release, written alike wherever rows are touched
-- under a claim (here, deliveries.sql and outcomes.sql; tests/test_sql_files.py checks it):
-- the row matched to its (id, token) pair, still running under this relay and that very claim,
--     o.id = u.id AND CASE WHEN o.claims = u.token AND o.status = 'running'
--                               AND o.locked_by = :relay THEN true END
-- The test is a CASE, which no index's predicate matches, so that each row is read by its id.
-- Written plainly, it names the rows of the partial index outbox_lease_idx, and statistics
-- (none yet, or taken while few rows were running) make that index look nearly empty: the
-- planner then read all of it instead of the batch's rows by id. Under a held snapshot the
-- index keeps the dead entry of every row claimed since, and the statement's cost grew with
-- them (tests/test_held_snapshot_plans.py).
-- heartbeat and release are deliveries.sql's delivery_heartbeat and delivery_release on the
-- events (o) rather than the deliveries (d); reap and delivery_reap share the CTE limits and
-- what they set on a row whose lease expired: an attempt counted (the request may have been
-- sent), due at once, and why.

-- name: heartbeat
-- params: ids, tokens, relay, lease
-- Extends the lease of the rows this relay still holds under their claims' tokens; returns
-- their ids. A row missing from the answer was lost (reaped after a stall, and maybe claimed
-- again).

UPDATE {table} AS o SET locked_until = now() + make_interval(secs => :lease)
FROM unnest(:ids::bigint[], :tokens::int[]) AS u(id, token)
WHERE o.id = u.id AND CASE WHEN o.claims = u.token AND o.status = 'running' AND o.locked_by = :relay THEN true END
RETURNING o.id

-- name: settled
-- params: ids, tokens
-- Of (id, token) pairs a heartbeat could not renew, those recorded as delivered under that very
-- claim: a sink that records in its own statement (the endpoints sink's fan_out) did so before
-- the relay handed the outcome over. They are settled, not lost. (A reaped row is pending, or
-- failed, or claimed again under a newer token.) Rare: only rows the heartbeat missed.
-- Each row read by its id (o.id = ANY(:ids), the status a CASE): a plain status test named
-- outbox_delivered_idx, and with 1,500 rows missed the planner hashed every delivered row the
-- retention keeps (tests/test_batch_plans.py).

SELECT o.id FROM {table} AS o
JOIN unnest(:ids::bigint[], :tokens::int[]) AS u(id, token) ON o.id = u.id AND o.claims = u.token
WHERE o.id = ANY(:ids::bigint[]) AND CASE WHEN o.status = 'delivered' THEN true END

-- name: reap
-- params: default_max_attempts, batch, destinations, max_attempts, only, never, within
-- Rows whose relay stopped heartbeating go back to pending (or to failed once they have used
-- every attempt: a row that crashes its relay each time must not loop for ever).
-- :destinations/:max_attempts give per-destination attempt limits; :default_max_attempts is the
-- limit for any other destination. :only: only these rows (NULL: any); :never: never these
-- (rows the database refused to reap). :within: only leases that ended in the last :within
-- seconds, of the destinations this relay (:destinations) or any registered relay serves (NULL:
-- all of them): the reaper's earlier pass took the older ones. A held snapshot keeps the dead
-- entry of every row ever claimed in outbox_lease_idx, each with the time its lease would have
-- ended; a pass over all of them, every second, grew with every row delivered
-- (docs/performance.md). Within each destination the bounded pass reads the index from the
-- bound on. The reaper passes over all of them now and then, for what a bounded pass cannot see
-- (see relay/maintenance/reaper.py). At most :batch rows.

WITH expired AS (
    SELECT id FROM {table}
    WHERE status = 'running' AND locked_until < now()
      AND (:within::float8 IS NULL OR (
          locked_until >= now() - make_interval(secs => :within::float8)
          AND destination = ANY(ARRAY(
              SELECT DISTINCT d FROM {relays} AS r CROSS JOIN LATERAL unnest(r.destinations) AS d
              UNION SELECT unnest(:destinations::text[])))))
      AND (:only::bigint[] IS NULL OR id = ANY(:only::bigint[]))
      AND NOT (id = ANY(:never::bigint[]))
    ORDER BY locked_until
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
),
limits AS (
    SELECT * FROM unnest(:destinations::text[], :max_attempts::int[]) AS l(destination, max_attempts)
)
UPDATE {table} AS o
SET status = CASE WHEN o.attempts + 1 >= coalesce(
                      (SELECT l.max_attempts FROM limits AS l WHERE l.destination = o.destination),
                      :default_max_attempts)
                  THEN 'failed' ELSE 'pending' END,
    attempts = o.attempts + 1,
    run_after = now(),
    last_error = 'lease expired: relay ' || coalesce(o.locked_by, '?')
                 || ' stopped before recording an outcome',
    finished_at = CASE WHEN o.attempts + 1 >= coalesce(
                      (SELECT l.max_attempts FROM limits AS l WHERE l.destination = o.destination),
                      :default_max_attempts)
                  THEN now() END,
    locked_by = NULL,
    locked_until = NULL
FROM expired
WHERE o.id = expired.id
RETURNING o.id, o.status, o.destination

-- name: expired
-- params: batch, never
-- Rows whose lease expired, for reaping them one at a time when the database refuses to reap
-- them together (a trigger that refuses one row must not keep every dead relay's rows).

SELECT id FROM {table}
WHERE status = 'running' AND locked_until < now() AND NOT (id = ANY(:never::bigint[]))
ORDER BY locked_until
LIMIT :batch

-- name: release
-- params: relay, ids, tokens
-- On clean shutdown: rows claimed but not attempted go back untouched (no attempt counted),
-- if this relay still holds them under the same claim.

UPDATE {table} AS o
SET status = 'pending', locked_by = NULL, locked_until = NULL, run_after = now()
FROM unnest(:ids::bigint[], :tokens::int[]) AS u(id, token)
WHERE o.id = u.id AND CASE WHEN o.claims = u.token AND o.status = 'running' AND o.locked_by = :relay THEN true END
