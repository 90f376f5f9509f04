-- What the relays share: the registry of relays (who serves which destinations), the rows of
-- destinations nobody serves, the paused destinations and the lock of jobs run by one relay.
-- relay/db/queries/registry.py names them; they are asyncpg's (:name binds handed out as $1,
-- $2, … in their params' order: outbox/sql.py).

-- name: register
-- params: relay, host, pid, version, destinations, circuits, batch_claims
-- A relay says it is alive, and what it serves, every few seconds (one row per relay). Its
-- features (migration 0013) say how it claims: 'batch-claims' if it claims its unordered
-- destinations' fresh rows under batch leases (relay.claims = "batch", :batch_claims), which
-- relays claiming them by row must not serve beside it (mixed_claims).

INSERT INTO {relays}
    (relay_id, host, pid, version, destinations, circuits, features, features_at)
VALUES (:relay, :host, :pid, :version, :destinations::text[], :circuits::jsonb,
        ARRAY['ordered-owner'] || CASE WHEN :batch_claims::boolean THEN ARRAY['batch-claims'] ELSE '{}'::text[] END,
        now())
ON CONFLICT (relay_id) DO UPDATE
SET host = EXCLUDED.host, pid = EXCLUDED.pid, version = EXCLUDED.version,
    destinations = EXCLUDED.destinations, circuits = EXCLUDED.circuits,
    features = EXCLUDED.features, features_at = now(), seen_at = now(), stopped_at = NULL

-- name: unregister
-- params: relay
-- On a clean stop. The row stays: its destinations still count as served for a while, so a
-- rolling restart does not make another relay fail their rows as unknown.

UPDATE {relays} SET stopped_at = now(), seen_at = now(), circuits = '{}' WHERE relay_id = :relay

-- name: forget_relays
-- params: older_than
-- Relays not seen for :older_than seconds leave the registry.
DELETE FROM {relays} WHERE seen_at < now() - make_interval(secs => :older_than)

-- name: unknown_destinations
-- params: known, served_within
-- Pending rows of destinations that neither this relay (:known) nor any relay seen in the last
-- :served_within seconds serves (see the relay registry): nobody will deliver them until a
-- config changes. Read in the gaps of outbox_claim_idx between the destinations served, as
-- gauges.sql's pending_by_destination reads the unserved ones: a held snapshot keeps a dead
-- entry there for every row of a served destination claimed since, and a read of every
-- pending row (as fail_unknown_destinations' WHERE, which runs only with
-- unknown_destinations = "fail") read all of them at every report (0.5 s after three minutes
-- at 3,000 events/s, and growing: tests/test_held_snapshot_plans.py). The rows of a
-- destination nobody serves are never claimed, and leave no dead entries to read.

WITH served AS (
    SELECT DISTINCT s.d FROM (
        SELECT unnest(:known::text[]) AS d
        UNION ALL
        SELECT d FROM {relays} AS r CROSS JOIN LATERAL unnest(r.destinations) AS d
        WHERE r.seen_at > now() - make_interval(secs => :served_within)
    ) AS s
),
gaps AS (
    -- Below each destination served, above the one before; past the last one, below.
    SELECT lag(d, 1, '') OVER (ORDER BY d) AS lo, d AS hi FROM served
)
SELECT u.destination, u.rows, u.oldest FROM (
    -- Aggregated inside each gap's LATERAL, so that each gap is a range of the index (see
    -- pending_by_destination).
    SELECT s.* FROM gaps AS g
    CROSS JOIN LATERAL (
        SELECT o.destination, count(*) AS rows, min(o.created_at) AS oldest FROM {table} AS o
        WHERE o.destination > g.lo AND o.destination < g.hi AND o.status = 'pending'
        GROUP BY o.destination
    ) AS s
    UNION ALL
    SELECT o.destination, count(*), min(o.created_at) FROM {table} AS o
    WHERE o.destination > (SELECT coalesce(max(d), '') FROM served) AND o.status = 'pending'
    GROUP BY o.destination
) AS u
ORDER BY u.destination

-- name: fail_unknown_destinations
-- params: known, served_within, grace
-- Failing the rows of unknown_destinations spares rows younger than a grace period (:grace
-- seconds), so a relay that serves them has time to start (a new deployment, a relay added for a
-- new destination), and rows in flight in a live batch lease (relay.claims = "batch": such a
-- row is pending and unattempted until its outcome, batches.sql) whatever the registry says: a
-- relay holds them, and failing them would refuse its outcome (a retry would send them again);
-- once the batch ends the reaper counts an attempt, and the row is spared as tried. It reads
-- the pending rows between the destinations served, as unknown_destinations does: a read of
-- every pending row read, under a held snapshot, the dead entry of every row of a served
-- destination claimed since, at every report (tests/test_held_snapshot_plans.py: 900 pages
-- after 40,000 rows delivered, 6 for the report). A row claimed in a batch while this
-- statement runs, on a snapshot from before the claim, is failed all the same (the claim
-- writes no row to wait for): a known gap, tests/test_batch_registry.py.

WITH served AS (
    SELECT DISTINCT s.d FROM (
        SELECT unnest(:known::text[]) AS d
        UNION ALL
        SELECT d FROM {relays} AS r CROSS JOIN LATERAL unnest(r.destinations) AS d
        WHERE r.seen_at > now() - make_interval(secs => :served_within)
    ) AS s
),
gaps AS (
    SELECT lag(d, 1, '') OVER (ORDER BY d) AS lo, d AS hi FROM served
),
unserved AS MATERIALIZED (
    -- The pending rows between the destinations served, as unknown_destinations reads them
    -- (each gap a range of the index of their own, never the served ones' dead entries).
    SELECT s.id FROM gaps AS g
    CROSS JOIN LATERAL (
        SELECT o.id FROM {table} AS o
        WHERE o.destination > g.lo AND o.destination < g.hi AND o.status = 'pending'
        OFFSET 0
    ) AS s
    UNION ALL
    SELECT o.id FROM {table} AS o
    WHERE o.destination > (SELECT coalesce(max(d), '') FROM served) AND o.status = 'pending'
)
UPDATE {table}
SET status = 'failed',
    finished_at = now(),
    last_error = 'unknown destination ' || quote_literal(destination)
                 || ': no running relay serves it; add it to a relay config, then run '
                 || 'outbox-relay retry'
FROM unserved AS u
-- Each row read by its id, and tested as a CASE (no partial index's predicate: see
-- leases.sql), again on its current version if another transaction wrote it meanwhile.
WHERE {table}.id = u.id AND CASE
WHEN status = 'pending' AND NOT (destination = ANY(:known::text[]))
  AND NOT EXISTS (SELECT 1 FROM {relays} AS r
                  WHERE r.seen_at > now() - make_interval(secs => :served_within)
                    AND {table}.destination = ANY(r.destinations))

  AND created_at < now() - make_interval(secs => :grace)
  AND attempts = 0  -- a row some relay already tried is served (maybe by one not registered)
  AND NOT EXISTS (SELECT 1 FROM {batches} AS b
                  WHERE b.relay IS NOT NULL AND b.destination = {table}.destination
                    AND {table}.id > b.first_id AND {table}.id <= b.last_id)
  THEN true END
RETURNING destination

-- name: mixed_claims
-- params: relay, destinations, batch, seen_within
-- The other relays running (not stopped, seen in the last :seen_within seconds) that serve one
-- of :destinations (this relay's that batch leases could claim: unordered, not endpoints) the
-- other way: under batch leases while this relay claims them by row (:batch false), or by
-- row while it claims them under batch leases. A relay claiming by row takes the fresh rows
-- of another's open batches again: they are delivered twice (docs/deploying.md). A relay
-- whose features were not written at its last registration (an earlier release, or one
-- rolled back under the same relay_id) claims by row. The destinations each serves of them.

SELECT r.relay_id, r.host,
       ARRAY(SELECT d FROM unnest(r.destinations) AS d
             WHERE d = ANY(:destinations::text[]) ORDER BY d) AS destinations
FROM {relays} AS r
WHERE r.relay_id <> :relay AND r.stopped_at IS NULL
  AND r.seen_at > now() - make_interval(secs => :seen_within)
  AND r.destinations && :destinations::text[]
  AND ('batch-claims' = ANY(r.features) AND r.features_at IS NOT DISTINCT FROM r.seen_at) <> :batch
ORDER BY r.relay_id

-- name: paused
-- The destinations paused (`outbox-relay pause`): the relay claims none of their rows.
SELECT destination FROM {paused}

-- name: try_job_lock
-- params: job
-- Jobs that one relay at a time should run take this lock in their own short transaction. It
-- is released at commit or when the connection dies, so a crashed relay never holds it.
SELECT pg_try_advisory_xact_lock(hashtextextended('outbox-relay:' || :job, 0))

-- name: settling_lock
-- params: schema
-- One relay at a time settles how it claims, checks the relays running, and registers
-- (relay/runtime/claim_modes.py one_at_a_time): this lock, of the schema's name, held by a
-- transaction left open meanwhile. Transaction-scoped, not a session's: behind PgBouncer in
-- transaction mode a session lock stays on the server connection once the client has gone,
-- and every relay starting after would wait for it.
SELECT pg_advisory_xact_lock(hashtextextended('outbox-relay:claims:' || :schema, 0))

-- name: settling_holder
-- params: schema
-- Who holds settling_lock: named by a relay that gave up waiting for it.
SELECT coalesce(nullif(a.application_name, ''), 'no application_name') || ', pid ' || l.pid
       || coalesce(', from ' || host(a.client_addr), '') || ', ' || coalesce(a.state, '?')
FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.classid::bigint << 32) | l.objid::bigint)
      = hashtextextended('outbox-relay:claims:' || :schema, 0)
LIMIT 1
