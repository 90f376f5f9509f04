-- The statements of `endpoints show` and `endpoints delete`'s question (relay/ops/endpoints.py
-- runs them): an endpoint's deliveries and newest attempts. The endpoints themselves are read
-- and changed by outbox.endpoints' own statements. Filled in as relay/ops/queries.sql says.

-- name: endpoint_deliveries
-- params: endpoint_id
-- One endpoint's (:endpoint_id) deliveries by status. Its last outcome is that of the newest delivery
-- that was tried: a success there (last_error NULL) means the endpoint has recovered.

WITH tried AS (
    SELECT last_error, last_status
    FROM {deliveries}
    WHERE endpoint_id = :endpoint_id AND (last_error IS NOT NULL OR last_status IS NOT NULL)
    ORDER BY id DESC
    LIMIT 1
)
SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'running') AS running,
       count(*) FILTER (WHERE status = 'delivered') AS delivered,
       count(*) FILTER (WHERE status = 'failed') AS failed,
       count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
       CAST(extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))
            AS float8) AS oldest_pending_age,
       (SELECT last_error FROM tried) AS last_error,
       (SELECT last_status FROM tried) AS last_status
FROM {deliveries}
WHERE endpoint_id = :endpoint_id

-- name: endpoint_recent_attempts
-- params: endpoint_id, limit
-- Its (:endpoint_id) newest :limit attempts (outbox_attempts_endpoint_idx), replays included.

SELECT at, event_id, http_status, duration_ms, error
FROM {attempts}
WHERE endpoint_id = :endpoint_id
ORDER BY at DESC, id DESC
LIMIT :limit
