-- Enqueue on an asyncpg connection (outbox/writer.py): loaded by outbox/queries.py with
-- binds="numbered", each :name handed out as $1, $2, … in its params' order. psycopg 3 (and
-- Django's cursor, whichever driver it runs on) takes %s placeholders: outbox.queries derives
-- its statements from these, once, with each $n written %s (to_psycopg), so the two forms
-- cannot drift apart; the arguments are the same tuple, in the same order. SQLAlchemy's forms
-- are in enqueue_sqlalchemy.sql (the names of their binds are these). {table} is the outbox
-- table, filled in by outbox.queries.render.

-- name: enqueue_pg
-- params: destination, key, payload, content_type, headers, run_after

INSERT INTO {table} (destination, key, payload, content_type, headers, run_after)
VALUES (:destination, :key, :payload, :content_type, :headers::jsonb, COALESCE(:run_after::timestamptz, now()))
RETURNING id

-- name: enqueue_labelled_pg
-- Events with an event type or tenant (migration 0006's columns): see
-- enqueue_sqlalchemy.sql's enqueue_labelled_sa.
-- params: destination, key, payload, content_type, headers, run_after, event_type, tenant

INSERT INTO {table} (destination, key, payload, content_type, headers, run_after, event_type,
                     tenant)
VALUES (:destination, :key, :payload, :content_type, :headers::jsonb, COALESCE(:run_after::timestamptz, now()), :event_type, :tenant)
RETURNING id

-- name: enqueue_many_pg
-- Many rows in one statement. Identity values are drawn in the order unnest yields rows, so
-- the ascending ids correspond to the input order.
-- params: destinations, keys, payloads, content_types, headers, run_afters

INSERT INTO {table} (destination, key, payload, content_type, headers, run_after)
SELECT d, k, p, c, h::jsonb, COALESCE(r, now())
FROM unnest(:destinations::text[], :keys::text[], :payloads::bytea[], :content_types::text[], :headers::text[], :run_afters::timestamptz[])
     AS u(d, k, p, c, h, r)
RETURNING id

-- name: enqueue_many_labelled_pg
-- params: destinations, keys, payloads, content_types, headers, run_afters, event_types, tenants

INSERT INTO {table} (destination, key, payload, content_type, headers, run_after, event_type,
                     tenant)
SELECT d, k, p, c, h::jsonb, COALESCE(r, now()), e, t
FROM unnest(:destinations::text[], :keys::text[], :payloads::bytea[], :content_types::text[], :headers::text[], :run_afters::timestamptz[],
            :event_types::text[], :tenants::text[])
     AS u(d, k, p, c, h, r, e, t)
RETURNING id
