-- The console's own statements (what it shows beyond the operations commands' functions),
-- which relay/ui/ runs through relay/ui/queries.py. Placeholders as in relay/db/queries/
-- ({table}, {endpoints}, …), filled in by relay.db.queries.render_ops.

-- name: series
-- params: destination
-- Delivered rows per minute of the last hour, and their commit-to-delivery lag (average and
-- worst), per destination (destination: one, or NULL for all). Read from the delivered
-- rows still kept (relay.retention), through the partial index on delivered_at.

WITH per_minute AS (
    SELECT date_trunc('minute', delivered_at) AS minute,
           count(*) AS delivered,
           avg(extract(epoch FROM delivered_at - created_at))::float8 AS lag_avg,
           max(extract(epoch FROM delivered_at - created_at))::float8 AS lag_max
    FROM {table}
    WHERE status = 'delivered' AND delivered_at > now() - interval '1 hour'
      AND (:destination::text IS NULL OR destination = :destination::text)
    GROUP BY 1
)
-- Every minute of the hour, a quiet one as 0 delivered (no lag): the chart shows the gap.
SELECT extract(epoch FROM m.minute)::bigint AS minute,
       coalesce(p.delivered, 0) AS delivered, p.lag_avg, p.lag_max
FROM generate_series(date_trunc('minute', now() - interval '59 minutes'),
                     date_trunc('minute', now()), interval '1 minute') AS m(minute)
LEFT JOIN per_minute AS p USING (minute)
ORDER BY 1

-- name: endpoints
-- params: destination, limit, after_id
-- A page of endpoints with their health, never their secrets; the URL is shown by origin
-- only. By keyset: those after id :after_id (0 for the first page), through the primary key.
-- Each one's pending deliveries are counted in the claim's two lanes, which together hold
-- every one of them once (outbox_deliveries_fresh_idx, outbox_deliveries_waiting_idx).

SELECT e.id, e.destination, e.url, e.tenant, e.event_types, e.rate_limit, e.description,
       e.enabled, e.disabled_reason, e.failing_since, e.last_success_at,
       CASE WHEN (to_jsonb(e) ->> 'circuit_open_until')::timestamptz > now()
            THEN (to_jsonb(e) ->> 'circuit_open_until')::timestamptz END AS circuit_open_until,
       (SELECT count(*) FROM {deliveries} AS d
        WHERE d.endpoint_id = e.id
          AND d.status = 'pending' AND d.claims = 0 AND NOT d.replay AND d.run_after <= d.created_at)
       + (SELECT count(*) FROM {deliveries} AS d
          WHERE d.endpoint_id = e.id
            AND d.status = 'pending' AND (d.claims <> 0 OR d.replay OR d.run_after > d.created_at))
           AS pending
FROM {endpoints} AS e
WHERE (:destination::text IS NULL OR e.destination = :destination::text) AND e.id > :after_id::bigint
ORDER BY e.id
LIMIT :limit

-- name: endpoint_row
-- params: endpoint_id
-- One endpoint, named on the question before an action on it.
SELECT id, destination, url, enabled FROM {endpoints} WHERE id = :endpoint_id

-- name: endpoint_destination
-- params: endpoint_id
SELECT destination FROM {endpoints} WHERE id = :endpoint_id

-- name: server_now
SELECT now()

-- name: catalog_endpoints
-- The endpoints by the event types they name, for the catalog's page, in one read of the
-- endpoints table: a row per destination and type named, with how many endpoints name it
-- (enabled ones apart) and the first ids; endpoints that name none (they take every type of
-- their destination) counted under a NULL event_type.

SELECT e.destination, t.event_type, count(*) AS endpoints,
       count(*) FILTER (WHERE e.enabled) AS enabled,
       (array_agg(e.id ORDER BY e.id))[1:20] AS ids
FROM {endpoints} AS e
LEFT JOIN LATERAL unnest(e.event_types) AS t(event_type) ON true
GROUP BY e.destination, t.event_type
ORDER BY e.destination, t.event_type
