"""The fan-out benchmark's own statements: events, endpoints and a dead endpoint's backlog
inserted in one statement each, and what a run reads back of its deliveries."""

EVENTS = """
INSERT INTO outbox (destination, key, payload, content_type, tenant, event_type)
SELECT $1, 'key-' || (i % 1000), convert_to(rpad('{"i":' || i || ',"pad":"', $3, 'x') || '"}',
       'UTF8'), 'application/json', $4::text, 'bench.event'
FROM generate_series(1, $2) AS i
"""

ENDPOINTS = """
INSERT INTO outbox_endpoints (destination, url, tenant, secret, description)
SELECT $1, u.url, $3::text, u.secret, 'bench'
FROM unnest($2::text[], $4::text[]) WITH ORDINALITY AS u(url, secret, n)
ORDER BY u.n
RETURNING id, url
"""

# The endpoints no event matches: one statement, whatever their number.
FILLER = """
INSERT INTO outbox_endpoints (destination, url, tenant, secret, description)
SELECT $1, 'http://127.0.0.1:9/never/' || i, 'bench-other-' || i, $3, 'bench filler'
FROM generate_series(1, $2) AS i
"""

# A dead endpoint's backlog from before the run: deliveries waiting out their backoff (as a
# failing endpoint's are). Negative event ids: they name no event and are never due here.
DEAD_BACKLOG = """
INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, run_after, attempts)
SELECT -i, $2, $1, now() + interval '1 day', 3 FROM generate_series(1, $3) AS i
"""

HEALTHY_DELIVERED = """
SELECT count(*) FROM outbox_deliveries WHERE endpoint_id = ANY($1::bigint[])
  AND status = 'delivered'
"""

# Commit-to-recorded, from the database alone: the attempt's log time (the start of the
# statement recording it) less the event's created_at (the start of its transaction).
RECORDED_LATENCY = """
SELECT extract(epoch FROM a.at - o.created_at)::float8 * 1000
FROM outbox_attempts AS a JOIN outbox AS o ON o.id = a.event_id
WHERE a.endpoint_id = ANY($1::bigint[]) AND a.http_status BETWEEN 200 AND 299
"""

# Fan-out lag: an event's recording as fanned out less its created_at.
FANNED_OUT = """
SELECT count(*) FILTER (WHERE status = 'delivered') AS fanned_out,
       extract(epoch FROM max(delivered_at))::float8 AS last,
       percentile_disc(0.5) WITHIN GROUP (ORDER BY lag) FILTER (WHERE lag IS NOT NULL) AS p50,
       percentile_disc(0.99) WITHIN GROUP (ORDER BY lag) FILTER (WHERE lag IS NOT NULL) AS p99
FROM (SELECT status, delivered_at,
             CASE WHEN status = 'delivered'
                  THEN extract(epoch FROM delivered_at - created_at)::float8 END AS lag
      FROM outbox) AS o
"""

LAST_HEALTHY = """
SELECT extract(epoch FROM max(at))::float8 FROM outbox_attempts
WHERE endpoint_id = ANY($1::bigint[]) AND http_status BETWEEN 200 AND 299
"""

RELAY_BACKENDS = """
SELECT pid FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND application_name LIKE 'outbox-relay%'
"""

# The probe's events, claimed at once by the probe's relay id: (id, fencing token), by id.
PROBE_CLAIM_ALL = """
UPDATE outbox SET status = 'running', locked_by = $1, locked_until = now() + interval '1 hour',
    claims = claims + 1
WHERE status = 'pending'
RETURNING id, claims
"""
