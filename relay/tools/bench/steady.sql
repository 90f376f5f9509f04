-- The writers' business statements (relay/tools/bench/steady.py; enqueue.py and fanout_load.py
-- run them too): an order, written in the same transaction as its events. asyncpg's: :name
-- binds handed out as $1, $2, … in their params' order (outbox/sql.py).

-- name: business
CREATE TABLE IF NOT EXISTS bench_orders (id bigserial PRIMARY KEY, total int)

-- name: order
-- params: total
INSERT INTO bench_orders (total) VALUES (:total) RETURNING id
