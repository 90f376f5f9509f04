-- The statements the benchmark scenarios share (scratch data, the held snapshot, the table's
-- figures), which relay/tools/bench/common.py loads; history.py runs vacuum_analyze too.
-- asyncpg's: :name binds handed out as $1, $2, … in their params' order (outbox/sql.py).
-- The scratch database is migrated into the default schema: {table} is the outbox there,
-- filled in by outbox.queries.render where the statement is run.

-- name: read_outbox
-- What a pg_dump reads first: the table, in the snapshot it then holds.
SELECT count(*) FROM {table}

-- name: prefill
-- params: destination, rows, keys, length

INSERT INTO outbox (destination, key, payload, content_type)
SELECT :destination, 'key-' || (i % :keys), convert_to(rpad('{"i":' || i || ',"pad":"', :length, 'x') || '"}',
       'UTF8'), 'application/json'
FROM generate_series(1, :rows) AS i

-- name: fill_history
-- params: destination, rows, payload

INSERT INTO outbox (destination, key, payload, content_type, status, attempts, delivered_at)
SELECT :destination, 'key-' || (i % 1000), convert_to(repeat('x', :payload), 'UTF8'), 'application/json',
       'delivered', 1, now()
FROM generate_series(1, :rows) AS i

-- name: begin_repeatable_read
BEGIN ISOLATION LEVEL REPEATABLE READ

-- name: own_xmin
SELECT backend_xmin::text FROM pg_stat_activity WHERE pid = pg_backend_pid()

-- name: backend_xmin
-- params: pid
-- The held snapshot's backend, seen from another connection.
SELECT backend_xmin::text FROM pg_stat_activity WHERE pid = :pid

-- name: table_stats
-- params: relation

SELECT n_live_tup, n_dead_tup, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del,
       autovacuum_count, pg_table_size(relid) AS table_bytes,
       pg_indexes_size(relid) AS indexes_bytes
FROM pg_stat_user_tables WHERE relid = to_regclass(:relation)

-- name: other_backends
-- params: snapshot_app
-- Backends of this database other than the asking one and the held snapshot.

SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND backend_type = 'client backend'
  AND pid <> pg_backend_pid() AND application_name <> :snapshot_app

-- name: clear_stats_snapshot
SELECT pg_stat_clear_snapshot()

-- name: vacuum_analyze
VACUUM ANALYZE outbox

-- name: server_version
SHOW server_version
