-- The console benchmark's statements (relay/tools/bench/console.py runs them): the scratch
-- outbox filled with a large history, and what is read back of it. asyncpg's: :name binds
-- handed out as $1, $2, … in their params' order (outbox/sql.py).

-- name: fill
-- params: first, last, rows, pending, hours, pad, keyed_failed, running
-- Rows :first..:last of :rows in all; :pending pending rows (the newest), :running of them
-- running; :hours hours of history; :pad the payload's padding; :keyed_failed KEYED_FAILED.
-- A row's place i sets its time (created_at rises with id, as in a live table), its
-- destination (i % 10) and, through a multiplicative hash h, whether it failed or was skipped.

INSERT INTO outbox (destination, key, tenant, event_type, payload, content_type, status,
                    attempts, run_after, locked_by, locked_until, last_error, created_at,
                    delivered_at, finished_at)
SELECT d.destination,
       CASE WHEN d.keyed AND (NOT r.failed OR h % :keyed_failed::bigint = 0) THEN 'key-' || (i % 10000) END,
       'tenant-' || (i % 50), d.event_type,
       convert_to('{"i":' || i || ',"pad":"' || :pad::text || '"}', 'UTF8'), 'application/json',
       r.status,
       CASE r.status WHEN 'failed' THEN 25 WHEN 'pending' THEN h % 3 ELSE 1 END,
       CASE WHEN r.status = 'pending' AND h % 20 = 0 THEN now() + interval '5 min'
            ELSE t.created_at END,
       CASE WHEN r.status = 'running' THEN 'bench-relay-1' END,
       CASE WHEN r.status = 'running' THEN now() + interval '20 s' END,
       CASE WHEN r.status IN ('failed', 'skipped')
            THEN (ARRAY['HTTP 503 from https://hooks.example.com: upstream unavailable',
                        'timeout after 10s waiting for https://partner.example.net',
                        'MessageSizeTooLargeError: the message is 1048712 bytes',
                        'HTTP 410 from https://old.example.org: endpoint gone',
                        'KafkaTimeoutError: batch expired'])[1 + (h / 1000) % 5]
                 || CASE WHEN r.status = 'skipped' THEN ' [skipped by ops]' ELSE '' END END,
       t.created_at,
       CASE WHEN r.status = 'delivered' THEN t.created_at + t.lag END,
       CASE WHEN r.status = 'delivered' THEN t.created_at + t.lag
            WHEN r.status IN ('failed', 'skipped') THEN t.created_at + interval '20 min' END
FROM generate_series(:first::bigint, :last::bigint) AS i
CROSS JOIN LATERAL (SELECT (i * 2654435761) % 1000003 AS h) AS x
CROSS JOIN LATERAL (
    SELECT now() - make_interval(secs => :hours::float8 * 3600 * (:rows::bigint - i) / :rows)
               AS created_at,
           make_interval(secs => 0.05 + (h % 2000) / 1000.0) AS lag
) AS t
CROSS JOIN LATERAL (
    SELECT CASE
               WHEN i > :rows - :pending::bigint AND i <= :rows - :pending + :running::bigint THEN 'running'
               WHEN i > :rows - :pending THEN 'pending'
               WHEN h % 1000 = 0 THEN 'failed'
               WHEN h % 10000 = 1 THEN 'skipped'
               ELSE 'delivered'
           END AS status,
           h % 1000 = 0 AND i <= :rows - :pending AS failed
) AS r
CROSS JOIN LATERAL (
    SELECT (ARRAY['orders', 'orders', 'orders', 'orders', 'emails', 'emails', 'emails',
                  'webhooks', 'webhooks', 'audit'])[1 + i % 10] AS destination,
           (i % 10 < 4 OR i % 10 IN (7, 8)) AS keyed,
           (ARRAY['order.created', 'order.paid', 'email.sent', 'audit.logged'])[1 + i % 4]
               AS event_type
) AS d

-- name: vacuum_analyze
VACUUM (ANALYZE) outbox

-- name: table_size
SELECT pg_total_relation_size('outbox')

-- name: rows_by_status
SELECT status, count(*) AS n FROM outbox GROUP BY 1
