-- The migration runner's bookkeeping (outbox/migrate.py), and what the relay asks of a
-- database before it starts: asyncpg's, loaded by outbox/queries.py with binds="numbered"
-- (each :name handed out as $1, $2, … in its params' order). {schema} is the outbox's schema
-- and {database} a database, quoted by outbox.queries.render_schema and render_database.

-- name: migrations_table

CREATE TABLE IF NOT EXISTS outbox_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: schema_exists
-- Names are passed raw and quoted here: to_regnamespace/to_regclass parse their argument as
-- SQL text, which would fold "Events" to events and refuse "my events".
-- params: schema
SELECT to_regnamespace(quote_ident(:schema)) IS NOT NULL

-- name: outbox_table_exists
-- params: schema
SELECT to_regclass(quote_ident(:schema) || '.outbox') IS NOT NULL

-- name: migrations_table_exists
-- params: schema
SELECT to_regclass(quote_ident(:schema) || '.outbox_migrations') IS NOT NULL

-- name: applied_migrations
SELECT version FROM {schema}.outbox_migrations ORDER BY version

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS {schema}

-- name: use_schema
-- SET LOCAL keeps the connection's own search_path once the migration's transaction ends.
SET LOCAL search_path TO {schema}

-- name: use_schema_session
-- For a migration that runs outside a transaction (migrate's own connection, reset after).
SET search_path TO {schema}

-- name: reset_search_path
RESET search_path

-- name: record_migration
-- params: version, name
INSERT INTO outbox_migrations (version, name) VALUES (:version, :name)

-- name: record_migration_script
-- What `migrate --dry-run` prints for psql instead of record_migration: the migration's
-- version and name written in ({version} and {name}, filled in by outbox.migrate; a name is
-- lower-case letters, digits and underscores), its ";" added there as every line's.
INSERT INTO outbox_migrations (version, name) VALUES ({version}, '{name}')

-- name: migrate_lock
-- A fixed key so concurrent `migrate` runs on one database queue up instead of racing. Tried,
-- not waited for in one statement: a session waiting on a lock is a transaction, and CREATE
-- INDEX CONCURRENTLY (run by the session holding the lock) waits for every transaction, so the
-- two would deadlock.
-- params: schema
SELECT pg_try_advisory_lock(hashtextextended('outbox-relay:migrate:' || :schema, 0))

-- name: migrate_unlock
-- params: schema
SELECT pg_advisory_unlock(hashtextextended('outbox-relay:migrate:' || :schema, 0))

-- name: migrate_lock_holder
-- The session holding migrate_lock's key, to say who is waited for.
-- params: schema

SELECT a.pid, a.application_name, a.state, a.state_change AS since
FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND ((l.classid::bigint << 32) | l.objid::bigint)
      = hashtextextended('outbox-relay:migrate:' || :schema, 0)
LIMIT 1

-- name: migration_lock_timeout
-- A migration waits this long at most for a lock (ALTER TABLE waits for every transaction
-- using the table, and every new insert queues behind it meanwhile), then tries again later.
SET LOCAL lock_timeout = '3s'

-- name: table_exists
-- params: table
SELECT to_regclass(:table) IS NOT NULL

-- name: server_encoding
-- Events carry any Unicode text (keys, headers, error messages): the database must store it.
SELECT current_setting('server_encoding')

-- name: notify
-- params: channel
SELECT pg_notify(:channel, '')

-- name: create_database
-- Scratch databases of the demo and the benchmark (relay/tools/scratch.py).
CREATE DATABASE {database}

-- name: drop_database
DROP DATABASE IF EXISTS {database} WITH (FORCE)
