-- The statements of `replay` (relay/ops/replay.py runs them): an event's deliveries put back
-- to pending (or one added), an endpoint's deliveries of a window, and the selection that
-- confirms a preview of them. Filled in as relay/ops/queries.sql says.
--
-- Whether endpoint e takes event o now (the `coalesce((e.tenant IS NULL OR …), false)` written
-- out in replay_event, replay_endpoint_preview, replay_endpoint and replay_endpoint_within,
-- alike: tests/test_sql_files.py checks it): the rule fan-out applies (relay/db/queries/
-- FAN_OUT), read at the time of the replay: an endpoint's tenant or event types may have
-- changed since the event was fanned out to it (an endpoint handed over to another customer),
-- and a replay must never send one tenant's event to another's endpoint. NULL-safe: an event
-- without a tenant goes only to endpoints taking every tenant.

-- name: replay_event_row
-- params: event_id
-- `replay`: the event, locked against deletion (retention, purge) until the replay commits:
-- a delivery put back to pending keeps its event from then on.

SELECT id, destination, status, tenant, event_type FROM {table} WHERE id = :event_id FOR KEY SHARE

-- name: replay_endpoint_row
-- params: endpoint_id

SELECT id, destination, url, enabled, tenant, event_types FROM {endpoints} WHERE id = :endpoint_id

-- name: replay_event
-- params: event_id, endpoint_id
-- `replay ID [--endpoint EID]`: the event's deliveries (endpoint_id: only that endpoint's, or
-- NULL for all) back to pending as replays, due now, with their attempts afresh; a running one is
-- left to the relay that holds it, one whose endpoint was deleted stays as it is (no relay
-- would ever claim it), and one whose endpoint no longer takes the event (see above) is left
-- as it is and said so. Returns every delivery looked at, each saying whether it was replayed;
-- the row lock re-reads a delivery a relay changed meanwhile, so `status` is its state now.

WITH target AS (
    SELECT d.id, d.endpoint_id, d.status, d.locked_by, e.url, e.id IS NOT NULL AS endpoint_exists,
           coalesce(e.enabled, false) AS enabled, e.tenant, e.event_types,
           coalesce((e.tenant IS NULL OR e.tenant = o.tenant)
             AND (cardinality(e.event_types) = 0 OR o.event_type = ANY(e.event_types)),
             false) AS takes
    FROM {deliveries} AS d
    JOIN {table} AS o ON o.id = d.event_id
    LEFT JOIN {endpoints} AS e ON e.id = d.endpoint_id
    WHERE d.event_id = :event_id AND (:endpoint_id::bigint IS NULL OR d.endpoint_id = :endpoint_id::bigint)
    FOR UPDATE OF d
),
replayed AS (
    UPDATE {deliveries} AS d
    SET status = 'pending', attempts = 0, run_after = now(), replay = true, finished_at = NULL,
        locked_by = NULL, locked_until = NULL
    FROM target AS t
    WHERE d.id = t.id AND t.status <> 'running' AND t.endpoint_exists AND t.takes
    RETURNING d.id
)
SELECT t.id, t.endpoint_id, t.status, t.locked_by, t.url, t.endpoint_exists, t.enabled,
       t.tenant, t.event_types, t.takes, r.id IS NOT NULL AS replayed
FROM target AS t
LEFT JOIN replayed AS r ON r.id = t.id
ORDER BY t.endpoint_id

-- name: replay_event_insert
-- params: event_id, endpoint_id, destination, serial
-- `replay ID --endpoint EID` for an endpoint the event was never fanned out to (it was added
-- later, or did not match then): a delivery of its own, pending as a replay. The caller has
-- checked that the endpoint takes the event (admin.replay_event). It draws its id under the
-- fan-outs' lock (:serial; see relay/db/queries/deliveries.sql, fan_out), as every writer of
-- deliveries does: the relays' claims take the highest id as one below which every delivery
-- is seen.

INSERT INTO {deliveries} (event_id, endpoint_id, destination, replay)
SELECT :event_id, :endpoint_id, :destination, true
FROM (SELECT pg_advisory_xact_lock(:serial::int, 1)) AS l
ON CONFLICT (event_id, endpoint_id) DO NOTHING
RETURNING id

-- name: replay_endpoint_selection
-- params: endpoint_id, within_seconds, statuses, max_id, as_of
-- The deliveries of replay_endpoint's window as a selection (see relay/ops/queries.sql,
-- retry_selection), within a confirmed preview's window as replay_endpoint_within's: ids up
-- to :max_id, measured from the preview's clock :as_of (NULL for none and now(), in the preview
-- itself). Whether each one's event is
-- still there is part of the digest (the seed of its hash), as it decides what is sent; so is
-- where the delivery stands (status, attempts, when it ended or is due): a replay leaves its
-- deliveries in the window (pending, due), and a preview confirmed twice (a form posted again)
-- must not send them twice, nor again once the relay has sent them.

SELECT count(*) AS rows, coalesce(max(d.id), 0) AS max_id,
       coalesce(sum(hashint8extended(d.id, hashtextextended(concat_ws(',',
           EXISTS (SELECT 1 FROM {table} AS o WHERE o.id = d.event_id), d.status, d.attempts,
           d.finished_at, d.run_after, d.replay), 0))::numeric), 0)::text AS digest,
       now() AS at
FROM {deliveries} AS d

WHERE d.endpoint_id = :endpoint_id
  AND d.created_at >= coalesce(:as_of::timestamptz, now()) - make_interval(secs => :within_seconds)
  AND d.status = ANY(:statuses::text[])
  AND (:max_id::bigint IS NULL OR d.id <= :max_id::bigint)

-- name: replay_endpoint_preview
-- params: endpoint_id, within_seconds, statuses
-- What replay_endpoint would do, counted by status, whether the event is still there and
-- whether the endpoint still takes it.

SELECT d.status, o.id IS NOT NULL AS found, coalesce(coalesce((e.tenant IS NULL OR e.tenant = o.tenant)
             AND (cardinality(e.event_types) = 0 OR o.event_type = ANY(e.event_types)),
             false), false) AS takes, count(*) AS n
FROM {deliveries} AS d
JOIN {endpoints} AS e ON e.id = d.endpoint_id
LEFT JOIN {table} AS o ON o.id = d.event_id

WHERE d.endpoint_id = :endpoint_id AND d.created_at >= now() - make_interval(secs => :within_seconds)
  AND d.status = ANY(:statuses::text[])

GROUP BY 1, 2, 3

-- name: replay_endpoint
-- params: endpoint_id, within_seconds, statuses
-- `replay --endpoint EID --since D`: the endpoint's deliveries (:endpoint_id) created in the last :within_seconds
-- seconds whose status is one of :statuses (ended ones, and pending ones: a disabled endpoint's
-- backlog, or deliveries waiting out a backoff), back to pending as replays, due now. Those
-- whose event is gone (deleted by retention or purge) and those whose event the endpoint no
-- longer takes (its tenant or event types changed since) are left as they are and counted.
-- The events of the others are locked against deletion until the replay commits.

WITH target AS (
    SELECT d.id, d.status
    FROM {deliveries} AS d
    JOIN {endpoints} AS e ON e.id = d.endpoint_id
    JOIN {table} AS o ON o.id = d.event_id

WHERE d.endpoint_id = :endpoint_id AND d.created_at >= now() - make_interval(secs => :within_seconds)
  AND d.status = ANY(:statuses::text[])

      AND coalesce((e.tenant IS NULL OR e.tenant = o.tenant)
             AND (cardinality(e.event_types) = 0 OR o.event_type = ANY(e.event_types)),
             false)
    FOR UPDATE OF d FOR KEY SHARE OF o
),
replayed AS (
    UPDATE {deliveries} AS d
    SET status = 'pending', attempts = 0, run_after = now(), replay = true, finished_at = NULL,
        locked_by = NULL, locked_until = NULL
    FROM target AS t
    WHERE d.id = t.id
    RETURNING t.status
),
skipped AS (
    SELECT o.id IS NOT NULL AS found, count(*) AS n
    FROM {deliveries} AS d
    JOIN {endpoints} AS e ON e.id = d.endpoint_id
    LEFT JOIN {table} AS o ON o.id = d.event_id

WHERE d.endpoint_id = :endpoint_id AND d.created_at >= now() - make_interval(secs => :within_seconds)
  AND d.status = ANY(:statuses::text[])

      AND NOT (o.id IS NOT NULL AND coalesce((e.tenant IS NULL OR e.tenant = o.tenant)
             AND (cardinality(e.event_types) = 0 OR o.event_type = ANY(e.event_types)),
             false))
    GROUP BY 1
)
SELECT status, count(*) AS n, true AS found, true AS takes FROM replayed GROUP BY status
UNION ALL
SELECT NULL, n, found, false FROM skipped

-- name: replay_endpoint_within
-- params: endpoint_id, within_seconds, statuses, max_id, as_of
-- replay_endpoint within a confirmed preview's selection: the same statement, both its
-- windows bounded as replay_endpoint_selection's (ids up to :max_id, measured from the preview's
-- clock :as_of); tests/test_sql_files.py checks that the two differ in their windows alone, and
-- tests/test_console_actions.py runs it.

WITH target AS (
    SELECT d.id, d.status
    FROM {deliveries} AS d
    JOIN {endpoints} AS e ON e.id = d.endpoint_id
    JOIN {table} AS o ON o.id = d.event_id

WHERE d.endpoint_id = :endpoint_id
  AND d.created_at >= coalesce(:as_of::timestamptz, now()) - make_interval(secs => :within_seconds)
  AND d.status = ANY(:statuses::text[])
  AND (:max_id::bigint IS NULL OR d.id <= :max_id::bigint)

      AND coalesce((e.tenant IS NULL OR e.tenant = o.tenant)
             AND (cardinality(e.event_types) = 0 OR o.event_type = ANY(e.event_types)),
             false)
    FOR UPDATE OF d FOR KEY SHARE OF o
),
replayed AS (
    UPDATE {deliveries} AS d
    SET status = 'pending', attempts = 0, run_after = now(), replay = true, finished_at = NULL,
        locked_by = NULL, locked_until = NULL
    FROM target AS t
    WHERE d.id = t.id
    RETURNING t.status
),
skipped AS (
    SELECT o.id IS NOT NULL AS found, count(*) AS n
    FROM {deliveries} AS d
    JOIN {endpoints} AS e ON e.id = d.endpoint_id
    LEFT JOIN {table} AS o ON o.id = d.event_id

WHERE d.endpoint_id = :endpoint_id
  AND d.created_at >= coalesce(:as_of::timestamptz, now()) - make_interval(secs => :within_seconds)
  AND d.status = ANY(:statuses::text[])
  AND (:max_id::bigint IS NULL OR d.id <= :max_id::bigint)

      AND NOT (o.id IS NOT NULL AND coalesce((e.tenant IS NULL OR e.tenant = o.tenant)
             AND (cardinality(e.event_types) = 0 OR o.event_type = ANY(e.event_types)),
             false))
    GROUP BY 1
)
SELECT status, count(*) AS n, true AS found, true AS takes FROM replayed GROUP BY status
UNION ALL
SELECT NULL, n, found, false FROM skipped
