-- The simple loop's statements (relay/tools/bench/simple.py runs them): kept here, not in
-- relay/db/queries/, because the product never runs them. asyncpg's: :name binds handed out
-- as $1, $2, … in their params' order (outbox/sql.py).

-- name: simple_claim
-- params: destination, batch

UPDATE outbox SET status = 'running', locked_until = now() + interval '60 seconds'
WHERE id = ANY(ARRAY(
    SELECT id FROM outbox
    WHERE status = 'pending' AND run_after <= now() AND destination = :destination
    ORDER BY run_after, id LIMIT :batch FOR UPDATE SKIP LOCKED))
RETURNING id, key, payload, content_type

-- name: simple_done
-- params: ids

UPDATE outbox SET status = 'delivered', delivered_at = now(), finished_at = now(),
                  locked_until = NULL
WHERE id = ANY(:ids::bigint[])
