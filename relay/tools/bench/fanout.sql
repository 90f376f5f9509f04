-- The fan-out benchmark's own statements (relay/tools/bench/fanout.py, fanout_load.py and
-- fanout_setup.py run them, through the names of fanout_sql.py): events, endpoints and a dead
-- endpoint's backlog inserted in one statement each, and what a run reads back of its
-- deliveries. asyncpg's: :name binds handed out as $1, $2, … in their params' order
-- (outbox/sql.py).

-- name: events
-- params: destination, rows, length, tenant

INSERT INTO outbox (destination, key, payload, content_type, tenant, event_type)
SELECT :destination, 'key-' || (i % 1000), convert_to(rpad('{"i":' || i || ',"pad":"', :length, 'x') || '"}',
       'UTF8'), 'application/json', :tenant::text, 'bench.event'
FROM generate_series(1, :rows) AS i

-- name: endpoints
-- params: destination, urls, tenant, secrets

INSERT INTO outbox_endpoints (destination, url, tenant, secret, description)
SELECT :destination, u.url, :tenant::text, u.secret, 'bench'
FROM unnest(:urls::text[], :secrets::text[]) WITH ORDINALITY AS u(url, secret, n)
ORDER BY u.n
RETURNING id, url

-- name: filler
-- params: destination, endpoints, secret
-- The endpoints no event matches: one statement, whatever their number.

INSERT INTO outbox_endpoints (destination, url, tenant, secret, description)
SELECT :destination, 'http://127.0.0.1:9/never/' || i, 'bench-other-' || i, :secret, 'bench filler'
FROM generate_series(1, :endpoints) AS i

-- name: dead_backlog
-- params: destination, endpoint_id, backlog
-- A dead endpoint's backlog from before the run: deliveries waiting out their backoff (as a
-- failing endpoint's are). Negative event ids: they name no event and are never due here.

INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, run_after, attempts)
SELECT -i, :endpoint_id, :destination, now() + interval '1 day', 3 FROM generate_series(1, :backlog) AS i

-- name: analyze_endpoints
ANALYZE outbox_endpoints

-- name: count_endpoints
SELECT count(*) FROM outbox_endpoints

-- name: healthy_delivered
-- params: endpoint_ids

SELECT count(*) FROM outbox_deliveries WHERE endpoint_id = ANY(:endpoint_ids::bigint[])
  AND status = 'delivered'

-- name: recorded_latency
-- params: endpoint_ids
-- Commit-to-recorded, from the database alone: the attempt's log time (the start of the
-- statement recording it) less the event's created_at (the start of its transaction).

SELECT extract(epoch FROM a.at - o.created_at)::float8 * 1000
FROM outbox_attempts AS a JOIN outbox AS o ON o.id = a.event_id
WHERE a.endpoint_id = ANY(:endpoint_ids::bigint[]) AND a.http_status BETWEEN 200 AND 299

-- name: fanned_out
-- Fan-out lag: an event's recording as fanned out less its created_at.

SELECT count(*) FILTER (WHERE status = 'delivered') AS fanned_out,
       extract(epoch FROM max(delivered_at))::float8 AS last,
       percentile_disc(0.5) WITHIN GROUP (ORDER BY lag) FILTER (WHERE lag IS NOT NULL) AS p50,
       percentile_disc(0.99) WITHIN GROUP (ORDER BY lag) FILTER (WHERE lag IS NOT NULL) AS p99
FROM (SELECT status, delivered_at,
             CASE WHEN status = 'delivered'
                  THEN extract(epoch FROM delivered_at - created_at)::float8 END AS lag
      FROM outbox) AS o

-- name: last_healthy
-- params: endpoint_ids

SELECT extract(epoch FROM max(at))::float8 FROM outbox_attempts
WHERE endpoint_id = ANY(:endpoint_ids::bigint[]) AND http_status BETWEEN 200 AND 299

-- name: relay_backends

SELECT pid FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND application_name LIKE 'outbox-relay%'

-- name: count_events
SELECT count(*) FROM outbox

-- name: deliveries_by_status
SELECT status, count(*) FROM outbox_deliveries GROUP BY 1

-- name: count_attempts
SELECT count(*) FROM outbox_attempts

-- name: probe_claim_all
-- params: relay_id
-- The probe's events, claimed at once by the probe's relay id: (id, fencing token), by id.

UPDATE outbox SET status = 'running', locked_by = :relay_id, locked_until = now() + interval '1 hour',
    claims = claims + 1
WHERE status = 'pending'
RETURNING id, claims

-- name: truncate_probe
-- The statement probe's rows, removed afterwards.
TRUNCATE outbox, outbox_deliveries, outbox_attempts

-- name: table_versions
-- The three tables' row versions and sizes at the end of a run (a held snapshot keeps every
-- dead one): the statistics' counts, flushed by the relay's backends as they exit.
SELECT c.relname AS name, s.n_live_tup AS live, s.n_dead_tup AS dead,
       round(pg_table_size(c.oid) / 1048576.0, 1)::float8 AS table_mb,
       round(pg_indexes_size(c.oid) / 1048576.0, 1)::float8 AS indexes_mb
FROM pg_class AS c JOIN pg_stat_user_tables AS s ON s.relid = c.oid
WHERE c.relname IN ('outbox', 'outbox_deliveries', 'outbox_attempts')
ORDER BY c.relname
