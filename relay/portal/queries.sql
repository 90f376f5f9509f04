-- The tenant portal's reads (issue #30): a tenant's endpoints, its message log (one message
-- per delivery) and the attempts of each. relay/portal/queries.py names them,
-- relay/portal/reads.py runs them. They are asyncpg's (:name binds handed out as $1, $2, … in
-- their params' order: outbox/sql.py).
--
-- The scope, written alike at the start of every statement (tests/test_sql_files.py checks
-- it): the CTE mine, the endpoints whose tenant is :tenant (bound only from a verified token:
-- relay/portal/scope.py), and when each became the tenant's (migration 0019). Every read of a
-- delivery or an attempt goes through mine, made since the endpoint became the tenant's; an
-- event is read only where its own tenant is :tenant. So an endpoint without a tenant (it
-- takes every tenant's events: the operator's) is no tenant's here, and an endpoint handed
-- from one tenant to another shows the new one nothing of what the old one was sent. A
-- delivery whose event retention deleted is shown only on an endpoint never handed over: a
-- fan-out that read the endpoint as the old tenant's while the handover was being made
-- writes its delivery after tenant_since (found by review), and only the event says whose it
-- is.
--
-- Pages are newest first by id, below :before (a cursor: relay/portal/cursors.py), :limit
-- rows; never OFFSET, never a count of the whole log.

-- name: endpoints
-- params: tenant, before, limit
-- The tenant's endpoints, with what the relays wrote of their health.

WITH mine AS (SELECT e.id, e.tenant_since FROM {endpoints} AS e WHERE e.tenant = :tenant)
SELECT e.id, e.destination, e.url, e.event_types, e.description, e.rate_limit, e.enabled,
       e.disabled_reason, e.disabled_at, e.failing_since, e.last_success_at,
       e.circuit_open_until, e.created_at, e.updated_at
FROM mine AS m JOIN {endpoints} AS e ON e.id = m.id
WHERE e.id < :before::bigint
ORDER BY e.id DESC
LIMIT :limit

-- name: endpoint_counts
-- params: tenant, endpoint_id
-- One endpoint's deliveries of the tenant by status (none if it is not the tenant's): those
-- the tenant's messages list shows.

WITH mine AS (SELECT e.id, e.tenant_since FROM {endpoints} AS e WHERE e.tenant = :tenant)
SELECT count(*) FILTER (WHERE d.status = 'pending') AS pending,
       count(*) FILTER (WHERE d.status = 'running') AS running,
       count(*) FILTER (WHERE d.status = 'delivered') AS delivered,
       count(*) FILTER (WHERE d.status = 'failed') AS failed,
       count(*) FILTER (WHERE d.status = 'cancelled') AS cancelled
FROM mine AS m JOIN {deliveries} AS d ON d.endpoint_id = m.id
    AND d.created_at >= coalesce(m.tenant_since, '-infinity')
LEFT JOIN {table} AS o ON o.id = d.event_id
WHERE m.id = :endpoint_id::bigint AND (o.tenant = :tenant OR (o.id IS NULL AND m.tenant_since IS NULL))

-- name: messages
-- params: tenant, before, limit, endpoint_id, status, event_type, since, until
-- The tenant's messages: the newest :limit deliveries below :before of each of its endpoints
-- (outbox_deliveries_endpoint_idx), each with its event's type, filtered (a NULL filter takes
-- all), then the newest :limit of those. An event deleted by retention leaves its deliveries
-- in the log without a type.

WITH mine AS (SELECT e.id, e.tenant_since FROM {endpoints} AS e WHERE e.tenant = :tenant)
SELECT d.id, d.event_id, d.endpoint_id, d.event_type, d.status, d.attempts, d.last_status,
       d.last_error, d.created_at, d.finished_at, d.replay
FROM mine AS m
CROSS JOIN LATERAL (
    SELECT d.id, d.event_id, d.endpoint_id, o.event_type, d.status, d.attempts, d.last_status,
           d.last_error, d.created_at, d.finished_at, d.replay
    FROM {deliveries} AS d
    LEFT JOIN {table} AS o ON o.id = d.event_id
    WHERE d.endpoint_id = m.id AND d.id < :before::bigint
      AND d.created_at >= coalesce(m.tenant_since, '-infinity')
      AND (o.tenant = :tenant OR (o.id IS NULL AND m.tenant_since IS NULL))
      AND (:status::text IS NULL OR d.status = :status::text)
      AND (:event_type::text IS NULL OR o.event_type = :event_type::text)
      AND (:since::timestamptz IS NULL OR d.created_at >= :since::timestamptz)
      AND (:until::timestamptz IS NULL OR d.created_at < :until::timestamptz)
    -- By the index's whole key: outbox_deliveries_endpoint_idx read backwards from :before,
    -- one endpoint's entries only, whatever the filters (a status filter planned a scan of
    -- every tenant's deliveries: found by review).
    ORDER BY d.endpoint_id DESC, d.id DESC
    LIMIT :limit
) AS d
WHERE :endpoint_id::bigint IS NULL OR m.id = :endpoint_id::bigint
ORDER BY d.id DESC
LIMIT :limit

-- name: message
-- params: tenant, delivery_id
-- One message of the tenant, with its event's payload if the event is still kept.

WITH mine AS (SELECT e.id, e.tenant_since FROM {endpoints} AS e WHERE e.tenant = :tenant)
SELECT d.id, d.event_id, d.endpoint_id, o.event_type, d.status, d.attempts, d.last_status,
       d.last_error, d.created_at, d.finished_at, d.replay, o.id IS NOT NULL AS event_kept,
       o.content_type, o.payload
FROM mine AS m
JOIN {deliveries} AS d ON d.endpoint_id = m.id
    AND d.created_at >= coalesce(m.tenant_since, '-infinity')
LEFT JOIN {table} AS o ON o.id = d.event_id
WHERE d.id = :delivery_id::bigint AND (o.tenant = :tenant OR (o.id IS NULL AND m.tenant_since IS NULL))

-- name: attempts
-- params: tenant, delivery_id, before, limit
-- The attempts of one message of the tenant (outbox_attempts_event_idx), newest first.

WITH mine AS (SELECT e.id, e.tenant_since FROM {endpoints} AS e WHERE e.tenant = :tenant)
SELECT a.id, a.at, a.http_status, a.duration_ms, a.response, a.error, a.replay
FROM mine AS m
JOIN {deliveries} AS d ON d.endpoint_id = m.id
    AND d.created_at >= coalesce(m.tenant_since, '-infinity')
LEFT JOIN {table} AS o ON o.id = d.event_id
JOIN {attempts} AS a ON a.event_id = d.event_id AND a.delivery_id = d.id
WHERE d.id = :delivery_id::bigint AND (o.tenant = :tenant OR (o.id IS NULL AND m.tenant_since IS NULL))
  AND a.id < :before::bigint
ORDER BY a.id DESC
LIMIT :limit

-- name: endpoint_lock
-- params: tenant, endpoint_id
-- Before a change to an endpoint: the endpoint, locked, if it is the tenant's (no row: as if
-- it did not exist). The lock keeps its tenant from changing until the change commits; the
-- tenant is checked again on the row locked (a change of tenant committed meanwhile is seen).

WITH mine AS (SELECT e.id, e.tenant_since FROM {endpoints} AS e WHERE e.tenant = :tenant)
SELECT e.id, e.destination, e.enabled, e.event_types,
       CAST(extract(epoch FROM now() - m.tenant_since) AS float8) AS tenant_for
FROM mine AS m JOIN {endpoints} AS e ON e.id = m.id
WHERE e.id = :endpoint_id::bigint AND e.tenant = :tenant
FOR UPDATE OF e

-- name: endpoints_counted
-- params: tenant
-- Before an endpoint is added: how many the tenant has, two additions of one tenant taking
-- turns (a transaction lock keyed by the tenant), so that neither passes the bound unseen.

WITH mine AS (SELECT e.id, e.tenant_since FROM {endpoints} AS e WHERE e.tenant = :tenant)
SELECT count(*) FROM mine AS m
WHERE (SELECT 1 FROM (SELECT pg_advisory_xact_lock(hashtext('outbox-portal:' || :tenant))) AS l) = 1

-- name: test_send
-- params: tenant, endpoint_id, event_type, payload, serial
-- A test event for one endpoint of the tenant (locked by endpoint_lock first): the event
-- written as delivered (no fan-out ever takes it, so no other endpoint gets it), and its one
-- delivery, drawn under the fan-outs' lock as every writer of deliveries does
-- (relay/db/queries/deliveries.sql, fan_out). The relays send it as any other.

WITH mine AS (SELECT e.id, e.tenant_since FROM {endpoints} AS e WHERE e.tenant = :tenant),
ep AS (
    SELECT e.id, e.destination FROM mine AS m JOIN {endpoints} AS e ON e.id = m.id
    WHERE e.id = :endpoint_id::bigint
),
event AS (
    INSERT INTO {table} (destination, payload, content_type, tenant, event_type, status,
                         attempts, delivered_at, finished_at)
    SELECT ep.destination, :payload, 'application/json', :tenant, :event_type, 'delivered',
           1, now(), now()
    FROM ep
    RETURNING id, destination
)
INSERT INTO {deliveries} (event_id, endpoint_id, destination)
SELECT event.id, :endpoint_id::bigint, event.destination
FROM event, (SELECT pg_advisory_xact_lock(:serial::int, 1)) AS l
RETURNING id, event_id
