-- The drain benchmark's own statements (relay/tools/bench/drain.py runs them): the naive loop
-- it is compared with. asyncpg's: :name binds handed out as $1, $2, … in their params' order
-- (outbox/sql.py).

-- name: naive_pick
-- The seed article's loop, one row per round: claim and mark running, commit, deliver, mark
-- done. Kept here (not in outbox.queries) because the product never runs it.

SELECT id, destination, key, payload, content_type, attempts, created_at FROM outbox
WHERE status = 'pending' AND run_after <= now() ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED

-- name: naive_running
-- params: id
UPDATE outbox SET status = 'running' WHERE id = :id

-- name: naive_done
-- params: id
UPDATE outbox SET status = 'delivered', delivered_at = now() WHERE id = :id

-- name: truncate_outbox
TRUNCATE outbox
