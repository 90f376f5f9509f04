-- Deleting what is no longer needed: purges of delivered, failed and skipped events (never one
-- a delivery still needs), retention's batches, and the ended deliveries and the message log.
-- relay/db/queries/retention.py names them, relay/db/retention.py runs them; they are
-- asyncpg's (:name binds handed out as $1, $2, … in their params' order: outbox/sql.py).
--
-- The open-delivery test, written alike in every statement that deletes events (here,
-- outcomes.sql's _deleting ones and relay/ops/queries.sql's purge_selected_*;
-- tests/test_sql_files.py checks it):
--     (SELECT EXISTS (
--               SELECT 1 FROM {deliveries} AS d
--               WHERE d.event_id = o.id AND d.status IN ('pending', 'running')))
-- An event (o) whose payload a delivery still needs: one of its deliveries is open (pending or
-- running), whether its endpoint is enabled or not. A disabled endpoint keeps its queue: an
-- endpoint that answered 410 once (a bad deploy), was disabled after disable_after or by an
-- operator gets everything queued for it once it is enabled again, and `replay --endpoint
-- --since` finds its backlog's events. Deleting the endpoint cancels its deliveries, and
-- lets their events go. One probe of the deliveries' unique index (event_id, endpoint_id).
--
-- Written as a scalar subquery, evaluated row by row: a bare EXISTS may be turned into a join,
-- and with the endpoint tables analysed while empty (any Kafka-only deployment) the planner
-- nested that join under the running rows it believed were one, reading the whole batch once
-- per running row (tests/test_batch_plans).

-- name: purge_delivered
-- params: older_than, destinations, batch
-- Purging is two statements in one transaction, for every purge (retention, `outbox-relay
-- purge`, the console): one locks a batch of candidates (FOR UPDATE SKIP LOCKED, passing over
-- rows a delivery still needs as the statement's snapshot shows them), then delete_locked
-- deletes those of them no delivery needs, in a snapshot of its own. In one statement a replay
-- that committed after the snapshot, adding or reopening a delivery of an event, would go
-- unseen, and the event be deleted under it: a replay locks the event first (FOR KEY SHARE),
-- so once the candidates are locked no replay of them can begin, and one that committed
-- before is seen by the DELETE.

SELECT id FROM {table} AS o
WHERE status = 'delivered' AND delivered_at < now() - make_interval(secs => :older_than)
  AND (:destinations::text[] IS NULL OR destination = ANY(:destinations::text[]))
  AND NOT (SELECT EXISTS (
          SELECT 1 FROM {deliveries} AS d
          WHERE d.event_id = o.id AND d.status IN ('pending', 'running')))
ORDER BY delivered_at
LIMIT :batch
FOR UPDATE SKIP LOCKED

-- name: purge_finished
-- params: older_than, destinations, batch, statuses
-- Failed or skipped rows (:statuses: which of the two) that ended more than :older_than seconds
-- ago, but those a delivery still needs (an event fanned out, then failed by the reaper): the
-- first statement of a purge, as purge_delivered.

SELECT id FROM {table} AS o
WHERE status IN ('failed', 'skipped') AND status = ANY(:statuses::text[])
  AND coalesce(finished_at, created_at) < now() - make_interval(secs => :older_than)
  AND (:destinations::text[] IS NULL OR destination = ANY(:destinations::text[]))
  AND NOT (SELECT EXISTS (
          SELECT 1 FROM {deliveries} AS d
          WHERE d.event_id = o.id AND d.status IN ('pending', 'running')))
ORDER BY coalesce(finished_at, created_at)
LIMIT :batch
FOR UPDATE SKIP LOCKED

-- name: delete_locked
-- params: ids, statuses
-- The second statement of a purge: of the rows (:ids) the first locked, those still of a status
-- of :statuses and needed by no delivery, seen afresh.

DELETE FROM {table} AS o
WHERE o.id = ANY(:ids::bigint[]) AND o.status = ANY(:statuses::text[])
  AND NOT (SELECT EXISTS (
          SELECT 1 FROM {deliveries} AS d
          WHERE d.event_id = o.id AND d.status IN ('pending', 'running')))

-- name: retention_delivered
-- params: older_than, batch, after_at, after_id
-- Retention's batch of delivered rows older than :older_than seconds, the first statement of
-- its purge (then delete_locked): it examines at most :batch of them, oldest first, resuming
-- after the last row the previous batch of the same run examined (:after_at and :after_id, its
-- delivered_at and id; NULL: from the oldest), and locks those no open delivery needs. An event
-- kept for a delivery (its endpoint failing or disabled) is examined once per retention run,
-- not once per batch: purge_delivered's filter walks every kept event again in each batch.
-- Returns the ids locked, how many it examined (fewer than :batch: the run is over) and where
-- it stopped.

WITH examined AS MATERIALIZED (
    SELECT o.id, o.delivered_at, (SELECT EXISTS (
          SELECT 1 FROM {deliveries} AS d
          WHERE d.event_id = o.id AND d.status IN ('pending', 'running'))) AS kept
    FROM {table} AS o
    WHERE o.status = 'delivered' AND o.delivered_at < now() - make_interval(secs => :older_than)
      AND (:after_at::timestamptz IS NULL
           OR (o.delivered_at >= :after_at::timestamptz
               AND (o.delivered_at, o.id) > (:after_at::timestamptz, :after_id::bigint)))
    ORDER BY o.delivered_at, o.id
    LIMIT :batch
),
locked AS (
    SELECT o.id FROM {table} AS o
    WHERE o.id = ANY(ARRAY(SELECT id FROM examined WHERE NOT kept)) AND o.status = 'delivered'
    FOR UPDATE SKIP LOCKED
),
last AS (
    SELECT delivered_at, id FROM examined ORDER BY delivered_at DESC, id DESC LIMIT 1
)
SELECT ARRAY(SELECT id FROM locked) AS ids,
       (SELECT count(*) FROM examined)::int AS examined,
       (SELECT delivered_at FROM last) AS at, (SELECT id FROM last) AS id

-- name: purge_deliveries
-- params: older_than, batch
-- Retention of the message log and of ended deliveries, a batch at a time.

WITH doomed AS (
    SELECT id FROM {deliveries}
    WHERE status IN ('delivered', 'failed', 'cancelled')
      AND finished_at < now() - make_interval(secs => :older_than)
    ORDER BY finished_at
    LIMIT :batch
    -- A delivery a replay holds is left for the next run, never waited for.
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {deliveries} AS d USING doomed
-- Re-checked on the row itself: a delivery replayed since the snapshot is pending again.
WHERE d.id = doomed.id AND d.status IN ('delivered', 'failed', 'cancelled')

-- name: purge_attempts
-- params: older_than, batch
-- The message log's: of the :batch attempts with the lowest ids (the primary key; no index of
-- `at`, migration 0020), those older than :older_than seconds. Ids are handed out in the order
-- attempts are logged and `at` is the time of the statement that logged them, so the lowest
-- ids are the oldest attempts, but not all of them: one logged by a statement that began
-- before another's and drew its id after it is older than the one below it, and one logged
-- while the server's clock was ahead (set right since) is younger than every one above it,
-- for as long as the clock was ahead. Each attempt of the batch is judged by its own `at`, so
-- one not yet old enough holds back none of those past it: stopping at it, retention deleted
-- nothing for a day after a clock a day ahead, while the log grew. Returns how many it deleted
-- and how many it examined (:batch: there may be more; a run goes on while it deletes some).
-- The rows are deleted by id (= ANY): joined to the batch, the planner read the whole log.

WITH head AS MATERIALIZED (
    SELECT id, at FROM {attempts}
    ORDER BY id
    LIMIT :batch
),
gone AS (
    DELETE FROM {attempts} AS a
    WHERE a.id = ANY(ARRAY(
        SELECT h.id FROM head AS h
        WHERE h.at < now() - make_interval(secs => :older_than)))
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone)::int AS deleted, (SELECT count(*) FROM head)::int AS examined
