-- The relay's checks of the database at start (relay/db/checks.py): that it answers, and that
-- the columns, indexes and privileges it needs are there. relay/db/queries/checks.py names
-- them; they are asyncpg's (:name binds handed out as $1, $2, … in their params' order:
-- outbox/sql.py).

-- name: ping
-- Whether the database answers: the store's check, and the listener's on its idle connection
-- every 30 seconds (a silent network loss never terminates a connection: it asks).
SELECT 1

-- name: column_exists
-- params: table, column
-- pg_attribute, not information_schema: the latter hides columns the role has no privilege
-- on, and a role granted before a migration must hear "grant", not "migrate".

SELECT EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = to_regclass(:table) AND attname = :column AND NOT attisdropped)

-- name: index_valid
-- params: index
-- A usable index (an interrupted CREATE INDEX CONCURRENTLY leaves an invalid one behind) and
-- its predicate, as PostgreSQL prints it.

SELECT (SELECT pg_get_expr(indpred, indrelid) FROM pg_index
        WHERE indexrelid = to_regclass(:index) AND indisvalid)

-- name: table_privilege
-- params: table, privilege
-- Whether this role holds the privilege (SELECT, UPDATE, …) on the table.
SELECT has_table_privilege(to_regclass(:table), :privilege)
