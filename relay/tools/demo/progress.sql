-- What the demo reads back from the outbox while and after the relay runs
-- (relay/tools/demo/progress.py runs them on asyncpg).

-- name: progress
-- The events, and the endpoints' deliveries they fanned out to, and how many of each are
-- delivered: the demo stops the relay when all are.
SELECT (SELECT count(*) FROM outbox) AS events,
       (SELECT count(*) FROM outbox WHERE status = 'delivered') AS events_delivered,
       (SELECT count(*) FROM outbox_deliveries) AS deliveries,
       (SELECT count(*) FROM outbox_deliveries WHERE status = 'delivered') AS deliveries_delivered

-- name: attempts
-- params: id
-- The attempts the relay counted for one event (the one the receiver answered 503 once).
SELECT attempts FROM outbox WHERE id = :id
