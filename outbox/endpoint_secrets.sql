-- The relay's statements about endpoint secrets at rest (relay/sinks/endpoints/at_rest.py),
-- on asyncpg: loaded by outbox/queries.py with binds="numbered", each :name handed out as $1,
-- $2, … in its params' order. {endpoints} is the schema's table (outbox.queries.
-- render_endpoints).

-- name: endpoint_unencrypted_pg
-- At start-up, where encryption is required: the endpoints with a secret in clear, current or
-- previous, and the first ids (:listed of them); one read of the table. The slice is written
-- "[1: :listed]": "[1::listed]" would read as a cast to a type named listed.
-- params: listed

SELECT count(*), (array_agg(id ORDER BY id))[1: :listed]
FROM {endpoints}
WHERE secret NOT LIKE 'enc:%' OR previous_secret NOT LIKE 'enc:%'

-- name: endpoint_expired_previous_pg
-- Previous secrets whose window has passed (or that have none: they never sign), :batch_size
-- at a time. Read first, so that the update (which wakes every relay) runs only when one is
-- due.
-- params: batch_size

SELECT id FROM {endpoints}
WHERE previous_secret IS NOT NULL AND NOT coalesce(previous_secret_until > now(), false)
ORDER BY id
LIMIT :batch_size

-- name: endpoint_clear_previous_pg
-- The window is tested again: a rotation since the read gave the endpoint a new previous
-- secret, which stays (and a rotation waiting on the row sees the cleared one afterwards).
-- params: ids

UPDATE {endpoints} SET previous_secret = NULL, previous_secret_until = NULL
WHERE id = ANY(:ids::bigint[])
  AND previous_secret IS NOT NULL AND NOT coalesce(previous_secret_until > now(), false)
RETURNING id
