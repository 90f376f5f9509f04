-- The demo's application side (relay/tools/demo/orders.py runs them): its orders, written
-- through SQLAlchemy's text() (:name binds as written, outbox/sql.py) in the transactions that
-- enqueue their events.

-- name: orders

CREATE TABLE IF NOT EXISTS orders (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer text NOT NULL,
    total numeric(10, 2) NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)

-- name: insert_order
-- params: c, t
-- An order (:c its customer, :t its total), in the transaction that enqueues its events.
INSERT INTO orders (customer, total) VALUES (:c, :t) RETURNING id

-- name: insert_rolled_back_order
-- The order of the transaction that fails after enqueueing: neither it nor its events survive.
INSERT INTO orders (customer, total) VALUES ('rolled-back', 1)
