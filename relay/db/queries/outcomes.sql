-- Recording the outcomes of a batch of events in one statement: every kind of outcome, or
-- plain deliveries only, and each of these with retention = 0 (delivered rows deleted as
-- recorded). relay/db/queries/outcomes.py names them, relay/db/store.py runs them; they are
-- asyncpg's (:name binds handed out as $1, $2, … in their params' order: outbox/sql.py).
--
-- Written alike (tests/test_sql_files.py checks it): record_deleting's UPDATE sets what record
-- sets (but for what its claims line says of itself), record_delivered_deleting's what
-- record_delivered sets, and deliveries.sql's fan_out that too; the outcomes and their text,
-- "unnest(:ids::bigint[], :tokens::int[], :statuses::text[], :counted::int[],
-- :delays::float8[], :errors::text[]) AS u(id, token, status, counted, delay, error)", in
-- record and record_deleting; each holds leases.sql's fence of held rows, and the _deleting
-- ones retention.sql's open-delivery test.

-- name: record
-- params: ids, tokens, statuses, counted, delays, errors, relay
-- All outcomes of a batch in one statement. Only rows this relay still holds under the claim
-- that produced the outcome are touched (:tokens: each row's fencing token, the `claims` value
-- its claim returned): if the lease expired and the row was claimed again, by another relay or
-- by this one, the newer claim's outcome wins. Returns the (id, token) pairs it recorded. Its
-- claims line says why it is there (sent with the statement).

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
FROM unnest(:ids::bigint[], :tokens::int[], :statuses::text[], :counted::int[], :delays::float8[], :errors::text[])
     AS u(id, token, status, counted, delay, error)
WHERE o.id = u.id AND CASE WHEN o.claims = u.token AND o.status = 'running' AND o.locked_by = :relay THEN true END
RETURNING o.id, o.claims

-- name: record_delivered
-- params: ids, tokens, relay
-- record for a batch whose outcomes are all plain deliveries (one attempt counted, no error
-- text): most batches. Only the (id, token) pairs travel; encoding the four other arrays of
-- record was an eighth of the relay's CPU per Kafka event. The same fencing as record.

UPDATE {table} AS o
SET status = 'delivered',
    attempts = o.attempts + 1,
    delivered_at = now(),
    finished_at = now(),
    claims = u.token,  -- unchanged; see record
    locked_by = NULL,
    locked_until = NULL
FROM unnest(:ids::bigint[], :tokens::int[]) AS u(id, token)
WHERE o.id = u.id AND CASE WHEN o.claims = u.token AND o.status = 'running' AND o.locked_by = :relay THEN true END
RETURNING o.id, o.claims

-- name: record_deleting
-- params: ids, tokens, statuses, counted, delays, errors, relay, delivered_ids, delivered_tokens
-- With retention = 0: delivered rows are deleted by the statement that records them, the rest
-- updated as in record. An event fanned out to endpoints whose deliveries are still open is
-- kept (recorded as delivered, like a row of record): the deliveries read its payload, and
-- retention deletes it once they have ended. Still one statement; the two parts touch
-- disjoint rows (their EXISTS tests read one snapshot). Its UPDATE sets what record sets
-- (written alike: tests/test_sql_files.py checks the two do not drift apart).
--
-- :ids to :errors are every outcome, as for record; :delivered_ids/:delivered_tokens the
-- (id, token) pairs of the delivered ones again. Each part reads its pairs straight from unnest,
-- as record does: the planner then knows how many there are. A filtered list (a CTE of the
-- outcomes with status = 'delivered') looks to it like two or three rows, and beside the running
-- rows that statistics taken while rows were pending put at one, it chose to loop over the batch
-- once per running row: 80-160 ms for 500 outcomes instead of 5 (tests/test_batch_plans.py).
-- The open-delivery tests read the event's id from its pair (g.id, u.id), not from the row:
-- a test of the row alone is applied where the table is read, to every row a sequential scan
-- reads (the planner's choice when the batch is a large part of a small table), not to the
-- batch's rows alone.

WITH gone AS (
    DELETE FROM {table} AS o
    USING unnest(:delivered_ids::bigint[], :delivered_tokens::int[]) AS g(id, token)
    WHERE o.id = g.id AND CASE WHEN o.claims = g.token AND o.status = 'running' AND o.locked_by = :relay THEN true END
      AND NOT (SELECT EXISTS (
          SELECT 1 FROM {deliveries} AS d
          WHERE d.event_id = g.id AND d.status IN ('pending', 'running')))
    RETURNING o.id, o.claims
),
kept AS (
    UPDATE {table} AS o
    SET status = u.status,
        attempts = o.attempts + u.counted,
        run_after = CASE WHEN u.status = 'pending'
                         THEN now() + make_interval(secs => u.delay) ELSE o.run_after END,
        last_error = COALESCE(u.error, o.last_error),
        delivered_at = CASE WHEN u.status = 'delivered' THEN now() END,
        finished_at = CASE WHEN u.status <> 'pending' THEN now() END,
        claims = u.token,  -- unchanged; see record
        locked_by = NULL,
        locked_until = NULL
    FROM unnest(:ids::bigint[], :tokens::int[], :statuses::text[], :counted::int[], :delays::float8[], :errors::text[])
         AS u(id, token, status, counted, delay, error)
    WHERE o.id = u.id
      AND (u.status <> 'delivered'
           OR (SELECT EXISTS (
          SELECT 1 FROM {deliveries} AS d
          WHERE d.event_id = u.id AND d.status IN ('pending', 'running'))))
      AND CASE WHEN o.claims = u.token AND o.status = 'running' AND o.locked_by = :relay THEN true END
    RETURNING o.id, o.claims
)
SELECT id, claims FROM gone UNION ALL SELECT id, claims FROM kept

-- name: record_delivered_deleting
-- params: ids, tokens, relay
-- record_delivered with retention = 0: record_deleting for a batch of plain deliveries.

WITH gone AS (
    DELETE FROM {table} AS o
    USING unnest(:ids::bigint[], :tokens::int[]) AS g(id, token)
    WHERE o.id = g.id AND CASE WHEN o.claims = g.token AND o.status = 'running' AND o.locked_by = :relay THEN true END
      AND NOT (SELECT EXISTS (
          SELECT 1 FROM {deliveries} AS d
          WHERE d.event_id = g.id AND d.status IN ('pending', 'running')))
    RETURNING o.id, o.claims
),
kept AS (
    UPDATE {table} AS o
    SET status = 'delivered',
        attempts = o.attempts + 1,
        delivered_at = now(),
        finished_at = now(),
        claims = u.token,  -- unchanged; see record
        locked_by = NULL,
        locked_until = NULL
    FROM unnest(:ids::bigint[], :tokens::int[]) AS u(id, token)
    WHERE o.id = u.id AND CASE WHEN o.claims = u.token AND o.status = 'running' AND o.locked_by = :relay THEN true END
      AND (SELECT EXISTS (
          SELECT 1 FROM {deliveries} AS d
          WHERE d.event_id = u.id AND d.status IN ('pending', 'running')))
    RETURNING o.id, o.claims
)
SELECT id, claims FROM gone UNION ALL SELECT id, claims FROM kept
