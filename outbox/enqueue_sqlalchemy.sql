-- Enqueue through SQLAlchemy's text() (outbox/writer.py), which works for every SQLAlchemy
-- PostgreSQL driver: binds as written (:name), loaded by outbox/queries.py with
-- binds="named". The asyncpg forms, and psycopg's derived from them, are in
-- enqueue_asyncpg.sql; they differ in their casts, so each driver has its own. {table} is
-- the outbox table, filled in by outbox.queries.render.

-- name: enqueue_sa
-- params: destination, key, payload, content_type, headers, run_after

INSERT INTO {table} (destination, key, payload, content_type, headers, run_after)
VALUES (:destination, :key, :payload, :content_type, CAST(:headers AS jsonb),
        COALESCE(CAST(:run_after AS timestamptz), now()))
RETURNING id

-- name: enqueue_labelled_sa
-- Events with an event type or tenant (migration 0006's columns). Events without use the
-- statements without "labelled", which name only 0001's columns: an application deployed
-- before `migrate` ran keeps enqueueing.
-- params: destination, key, payload, content_type, headers, run_after, event_type, tenant

INSERT INTO {table} (destination, key, payload, content_type, headers, run_after, event_type,
                     tenant)
VALUES (:destination, :key, :payload, :content_type, CAST(:headers AS jsonb),
        COALESCE(CAST(:run_after AS timestamptz), now()), :event_type, :tenant)
RETURNING id

-- name: enqueue_many_sa
-- Many rows in one statement. Identity values are drawn in the order unnest yields rows, so
-- the ascending ids correspond to the input order.
-- params: destinations, keys, payloads, content_types, headers, run_afters

INSERT INTO {table} (destination, key, payload, content_type, headers, run_after)
SELECT d, k, p, c, h::jsonb, COALESCE(r, now())
FROM unnest(CAST(:destinations AS text[]), CAST(:keys AS text[]), CAST(:payloads AS bytea[]),
            CAST(:content_types AS text[]), CAST(:headers AS text[]),
            CAST(:run_afters AS timestamptz[])) AS u(d, k, p, c, h, r)
RETURNING id

-- name: enqueue_many_labelled_sa
-- params: destinations, keys, payloads, content_types, headers, run_afters, event_types, tenants

INSERT INTO {table} (destination, key, payload, content_type, headers, run_after, event_type,
                     tenant)
SELECT d, k, p, c, h::jsonb, COALESCE(r, now()), e, t
FROM unnest(CAST(:destinations AS text[]), CAST(:keys AS text[]), CAST(:payloads AS bytea[]),
            CAST(:content_types AS text[]), CAST(:headers AS text[]),
            CAST(:run_afters AS timestamptz[]), CAST(:event_types AS text[]),
            CAST(:tenants AS text[])) AS u(d, k, p, c, h, r, e, t)
RETURNING id
