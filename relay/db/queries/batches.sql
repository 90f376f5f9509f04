-- Batch leases (relay.claims = "batch", migration 0015): the claim of an unordered
-- destination that takes its fresh rows under one lease row in outbox_batches ({batches})
-- instead of writing a new version of each, and what the reaper does when such a lease
-- expires. relay/db/queries/batches.py names them, relay/db/claims.py and the reaper run them;
-- they are asyncpg's (:name binds handed out as $1, $2, … in their params' order:
-- outbox/sql.py).
--
-- A row taken by a batch stays as it was written (pending, claims = 0) until its outcome is
-- recorded; its fencing token is the batch's id, negated (the statements below, not
-- outcomes.sql's and leases.sql's): the outcome applies while the row is still fresh and the
-- batch is still this relay's. A
-- delivered event then leaves one dead row version (its outcome's), not two, and a held
-- snapshot keeps half as many.
--
-- The outcomes, heartbeat and release of a batch's rows: outcomes.sql's and leases.sql's for
-- rows whose token is a batch's. The fence, written alike in each (tests/test_sql_files.py):
-- the row still as the claim found it (fresh: no outcome recorded, not released or reaped, not
-- changed by an operator), inside the range of its own batch, of the ids' current epoch, and
-- that batch still this relay's (not ended by the reaper):
--     o.id = u.id AND CASE WHEN o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at
--       AND EXISTS (SELECT 1 FROM {batches} AS b WHERE b.id = -u.token AND CASE WHEN b.relay = :relay
--                   AND b.destination = o.destination AND o.id > b.first_id AND o.id <= b.last_id
--                   AND b.epoch = (SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{table})::text, 'id')::regclass)::bigint) THEN true END) THEN true END
-- A CASE, as leases.sql's fence is: written plainly, the row's test names the rows of
-- outbox_fresh_idx, which the planner then read whole (it looks nearly empty to statistics
-- taken once most rows were delivered, or to none), and under a held snapshot that index keeps
-- the dead entry of every row delivered since (bench steady --hold-snapshot --claims batch:
-- 8,000 pages read to record a batch of 70 rows after 30 s, 26,000 after 60 s). As a CASE it
-- is no index condition: each row is read by its id, and its batch by the batch's id. The
-- batch's own tests are a CASE too: written plainly, with the epoch a parameter, they made the
-- planner read the destination's chain in outbox_batches_chain_key, every batch below the row
-- (and their dead versions), for each row (bench steady --hold-snapshot --claims batch: a
-- record of 100 rows read 730,000 pages after a minute).
-- The outcomes' fence (record_batch and its three variants) has one test more, in the batch's
-- CASE: the row was written before the claim (migration 0016),
--     AND (b.snapshot_xmax IS NULL OR age(o.xmin) > age(b.snapshot_xmax) OR o.created_at <= b.created_at)
-- snapshot_xmax is the xmax of the claim's snapshot: every row a claim takes was written by a
-- transaction that snapshot saw committed, so an older one, whatever the claim's transaction
-- did before. A row given the id of one in flight while its batch is live (the rows deleted by
-- hand, the sequence set back with setval: no new epoch) is written by a later transaction, at
-- a later time, and the outcome of the row that was sent must not mark it delivered
-- (tests/test_batch_review.py). A row is the batch's if either says it is older, as in
-- sweep_batches: its xmin alone does not say when it was written (a rewrite that copies every
-- row, as pg_repack or an ALTER TABLE changing a column's type does, or a backfill that keeps
-- it fresh, gives a row in flight a newer version; ages are compared modulo 2^32, and a row
-- pending for more than 2^31 transactions, its frozen xmin kept, looks newer), and created_at
-- alone is no better (an insert may give it; the clock may step back; an insert whose
-- transaction began after the claim's can commit before the claim's statement reads its
-- snapshot: tests/test_batch_review.py). So a row in flight is refused only when both fail (a
-- rewrite while the clock stands behind the claim's), and an id handed out again still takes
-- the outcome when both pass (its insert gave a created_at no later than the claim's, or ran
-- while the clock stood behind, or in a transaction that already had an id when the claim
-- read its snapshot, or that began before the claim's: created_at
-- defaults to now(), its transaction's start, so an enqueue with no created_at given is one:
-- tests/test_batch_fence_review.py). NULL: a batch claimed before migration 0016, fenced as before. The
-- release keeps the fence without it: a row put back untouched into the waiting lane, whichever
-- it is, is claimed again and sent.
-- The epoch of the ids is the file of the id column's sequence (as claim.sql's fence reads
-- it, last column): it changes when ids may be handed out again from the start (TRUNCATE ...
-- RESTART IDENTITY, ALTER SEQUENCE ... RESTART; PostgreSQL gives a sequence a new file on
-- any ALTER SEQUENCE), and then a batch of the earlier epoch records nothing and puts
-- nothing back: the claims start a new chain from the start, and deliver again what was in
-- flight. A rewrite of the table (VACUUM FULL, CLUSTER, pg_repack) or a TRUNCATE without
-- RESTART IDENTITY hands out no id again: the chains go on, and the batches in flight
-- (tests/test_batch_review.py). Read in an uncorrelated subquery (once per statement, not
-- per row: finding a column's sequence reads pg_depend), the table named by its row's type
-- (a schema's name in a string literal could break the statement). Ids handed out again
-- below a chain's end without a new epoch (setval, an explicit id) are sweep_batches'. A
-- recorded, released or reaped row's claims becomes 1: it is no longer fresh, whatever the
-- clock says (a retry waits in the waiting lane, and is claimed row by row). Endpoints
-- destinations are never claimed in batches, so no delivery ever reads these rows: the
-- _deleting statements need not keep an event for its deliveries, as outcomes.sql's do.

-- name: claim_batch
-- params: destination, batch, relay, lease, fence, epoch
-- The claim of claim.sql, in one statement, with the fresh lane under a batch lease. Rows due
-- again (the waiting lane) are claimed row by row as there, written running with their own
-- token. Fresh rows are read in id order from the end of the destination's chain of batches
-- (the last_id of its batch with the highest first_id, of the ids' current epoch :epoch)
-- up to :fence, a FENCE reading made before this statement (claim.sql): every id up to it
-- belongs to a transaction that had ended, so no row that commits late can be passed over,
-- and nothing but the chain's end needs to be kept between claims. The batch added to the
-- chain begins where it ended and ends at the last row taken; a claim that read an end of
-- the chain another claim has added to since (its snapshot is older than that commit) meets
-- the unique (destination, epoch, first_id) and takes no fresh row (ON CONFLICT DO NOTHING:
-- it waits for that claim to end, and adds nothing if it committed); it says so in a last row,
-- id -1 and nothing else, and the relay claims again at once, a new statement that reads the
-- chain's new end (relay/db/claims.py: with 4 relays on one destination, 43 claims of 60 came
-- back empty without it). The :batch first rows
-- of both lanes in run_after order are claimed, as in claim.sql; the fresh ones taken are as
-- many of the lowest fresh ids, so that a batch holds every fresh row of its range.
-- Fresh rows are returned with the token -id of their batch. Fresh rows are taken only while
-- :epoch, the epoch of the ids the FENCE reading read, is still the current one: a reading
-- made before a TRUNCATE ... RESTART IDENTITY (a drain goes on an older one) names the old
-- epoch, whose chain and fence the new rows' ids, handed out again, would pass; the new
-- epoch's chain takes them (tests/test_batch_claims.py). The batch keeps the xmax of this
-- statement's snapshot (snapshot_xmax), which the rows taken were all read with: the
-- outcomes' fence (above).

WITH chain AS MATERIALIZED (
    SELECT coalesce(
        (SELECT b.last_id FROM {batches} AS b
         WHERE b.destination = :destination AND b.epoch = :epoch::bigint
         ORDER BY b.first_id DESC
         LIMIT 1),
        0) AS position
),
waiting AS (
    SELECT id, run_after FROM {table}
    WHERE destination = :destination AND status = 'pending' AND (claims <> 0 OR run_after > created_at)
      AND run_after <= now()
    ORDER BY run_after, id
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
),
fresh AS MATERIALIZED (
    SELECT id, run_after FROM {table}
    WHERE destination = :destination AND status = 'pending' AND claims = 0 AND run_after <= created_at AND id > (SELECT position FROM chain) AND id <= :fence::bigint
      AND (SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{table})::text, 'id')::regclass)::bigint) = :epoch::bigint
    ORDER BY id
    LIMIT :batch
),
chosen AS MATERIALIZED (
    SELECT c.id, c.fresh FROM (
        SELECT id, run_after, false AS fresh FROM waiting
        UNION ALL SELECT id, run_after, true AS fresh FROM fresh
    ) AS c
    ORDER BY c.run_after, c.id
    LIMIT :batch
),
taken AS MATERIALIZED (
    SELECT f.id FROM fresh AS f
    ORDER BY f.id
    LIMIT (SELECT count(*) FROM chosen AS c WHERE c.fresh)
),
lease AS (
    INSERT INTO {batches} (destination, epoch, first_id, last_id, relay, lease_until, snapshot_xmax)
    SELECT :destination, :epoch::bigint, c.position, t.last_id, :relay,
           now() + make_interval(secs => :lease), pg_snapshot_xmax(pg_current_snapshot())::xid
    FROM chain AS c, (SELECT max(id) AS last_id FROM taken) AS t
    WHERE t.last_id IS NOT NULL
    ON CONFLICT (destination, epoch, first_id) DO NOTHING
    RETURNING id
),
claimed AS (
    UPDATE {table} AS o
    SET status = 'running', locked_by = :relay, locked_until = now() + make_interval(secs => :lease),
        claims = o.claims + 1
    WHERE o.id = ANY(ARRAY(SELECT c.id FROM chosen AS c WHERE NOT c.fresh))
    RETURNING o.id, o.destination, o.key, o.payload, o.content_type, o.headers::text AS headers,
              o.attempts, extract(epoch FROM o.created_at)::float8 AS created_at,
              o.claims::bigint AS claims, o.event_type
)
SELECT * FROM claimed
UNION ALL
SELECT o.id, o.destination, o.key, o.payload, o.content_type, o.headers::text AS headers,
       o.attempts, extract(epoch FROM o.created_at)::float8 AS created_at,
       -l.id AS claims, o.event_type
FROM {table} AS o, lease AS l
WHERE o.id = ANY(ARRAY(SELECT t.id FROM taken AS t))
UNION ALL
SELECT -1, NULL, NULL, NULL, NULL, NULL, 0, 0, 0, NULL
WHERE EXISTS (SELECT 1 FROM taken) AND NOT EXISTS (SELECT 1 FROM lease)

-- name: claim_past_fence
-- params: table, destination, batch, relay, lease, fence, cursor
-- The fresh rows of a destination claimed in batches that lie past the fence (:fence, as FENCE
-- read it) while an inserting transaction stays open below them: claim_batch takes no row past
-- the fence, so one application transaction left open after an insert (a bulk import, a
-- session idle in transaction) would hold back every row committed after it for as long as it
-- stays open. The relay runs this once the fence has stood still for a while with rows visible
-- past it (relay/db/claims.py): they are claimed row by row, as claim.sql claims (running
-- under this relay's lease, their own token, two row versions each), from :cursor (at or above
-- the fence: where the previous such claim ended), and left to the chain once the fence passes
-- them (no longer fresh, a batch passes over them).
--
-- A batch claim reads its rows without locking them, so a row claimed here must lie past the
-- fence of every batch claim whose snapshot cannot see this claim: otherwise both would take
-- it. Hence the gate, before the rows are claimed: this statement holds a fence key of value
-- :fence (shared, as the inserts' trigger takes its keys: migrations/0004) until it commits,
-- and only then checks that another transaction still holds a key at or below :fence. A FENCE
-- reading made after the key was taken sees it, and reads a fence no higher than :fence; one
-- made before saw that other key held (taken before the reading: a key taken after it is at or
-- above every id then visible, so above that reading's fence anyway), and read no higher
-- either. Only an insert's key counts: the pair the trigger takes (tagged with this table, and
-- untagged, of one value: migrations/0004), never a key this statement takes in another
-- relay (tagged only), whose value is an older fence's and proves nothing of the readings
-- made since (tests/test_batch_claims.py: four relays claiming past the fence together took
-- rows in flight in a batch). Once that key is gone, no row is claimed here: the batch claims
-- take them (the relay reads the fence again). The check reads pg_locks, which is no snapshot but the locks held at
-- that moment; each step waits for the one before it (the EXISTS is correlated with the gate).
-- The argument holds only while a key's value lies above every id visible when it was taken.
-- Two keys do not: another schema's outbox whose tag collides with this one's (migrations/0004)
-- takes its pair at its own sequence's value, and a sequence set back (setval) hands out keys
-- below the ids already drawn. Either lowers the fence below rows in flight in a batch, which
-- are still fresh, and the gate passed on it: both relays sent them
-- (tests/test_batch_past_fence_review.py). So no row at or below the end of the destination's
-- chain (as this statement's snapshot sees it, of the ids' current epoch) is taken here: a
-- committed batch's rows are never claimed again. A batch claim still running when this
-- statement read its snapshot is covered by the gate alone, and the gate counts a key only
-- when its transaction also holds a lock on this table (an insert keeps one until it ends):
-- an insert into another schema's outbox whose tag collides takes none.
-- The marker row (id -1) carries where the next such claim starts in `key`, and whether the
-- gate let this one claim in `content_type` ('t' or 'f').

WITH gate AS MATERIALIZED (
    SELECT pg_try_advisory_xact_lock_shared(
        4611686018427387904 + ((1 + mod(:table::regclass::oid::bigint, 16383)) << 48) + :fence::bigint) AS locked
),
open_below AS MATERIALIZED (
    SELECT g.locked AND EXISTS (
        SELECT 1 FROM pg_locks AS l
        JOIN pg_locks AS u
          ON u.virtualtransaction = l.virtualtransaction AND u.locktype = 'advisory'
         AND u.objsubid = 1 AND u.granted AND u.database = l.database
         AND ((u.classid::bigint << 32) | u.objid::bigint)
             = ((l.classid::bigint << 32) | l.objid::bigint) - ((1 + mod(:table::regclass::oid::bigint, 16383)) << 48)
        WHERE g.locked AND l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
          AND l.pid IS DISTINCT FROM pg_backend_pid()
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.classid::bigint >= 1073741824 AND l.classid::bigint < 2147483648
          AND ((((l.classid::bigint << 32) | l.objid::bigint) - 4611686018427387904) >> 48)
              = 1 + mod(:table::regclass::oid::bigint, 16383)
          AND ((((l.classid::bigint << 32) | l.objid::bigint) - 4611686018427387904) & 281474976710655)
              <= :fence::bigint
          AND EXISTS (SELECT 1 FROM pg_locks AS t
                      WHERE t.virtualtransaction = l.virtualtransaction AND t.locktype = 'relation'
                        AND t.database = l.database AND t.relation = :table::regclass)
    ) AS open
    FROM gate AS g
),
chain AS MATERIALIZED (
    SELECT greatest(:cursor::bigint, coalesce(
        (SELECT b.last_id FROM {batches} AS b
         WHERE b.destination = :destination
           AND b.epoch = (SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{table})::text, 'id')::regclass)::bigint)
         ORDER BY b.first_id DESC
         LIMIT 1),
        0)) AS position
),
fresh AS (
    SELECT id, run_after FROM {table}
    WHERE destination = :destination AND status = 'pending' AND claims = 0 AND run_after <= created_at AND id > (SELECT position FROM chain) AND run_after <= now()
    ORDER BY id
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
),
chosen AS (
    SELECT f.id FROM fresh AS f WHERE (SELECT b.open FROM open_below AS b)
),
claimed AS (
    UPDATE {table} AS o
    SET status = 'running', locked_by = :relay, locked_until = now() + make_interval(secs => :lease),
        claims = o.claims + 1
    WHERE o.id = ANY(ARRAY(SELECT id FROM chosen))
    RETURNING o.id, o.destination, o.key, o.payload, o.content_type, o.headers::text AS headers,
              o.attempts, extract(epoch FROM o.created_at)::float8 AS created_at, o.claims,
              o.event_type
),
next_cursor AS MATERIALIZED (
    SELECT coalesce(
        (SELECT min(o.id) - 1 FROM {table} AS o
         WHERE o.destination = :destination AND o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at AND o.id > (SELECT position FROM chain)
           AND o.id NOT IN (SELECT c.id FROM chosen AS c)),
        (SELECT max(c.id) FROM chosen AS c),
        (SELECT position FROM chain)) AS cursor
)
SELECT * FROM claimed
UNION ALL
SELECT -1, NULL, n.cursor::text, NULL,
       CASE WHEN (SELECT b.open FROM open_below AS b) THEN 't' ELSE 'f' END,
       NULL, 0, NULL, 0, NULL
FROM next_cursor AS n

-- name: reap_batches
-- params: default_max_attempts, batch, destinations, max_attempts, only, never, within
-- Batches whose lease ended (their relay stopped heartbeating, or recorded everything and let
-- it lapse): the rows of each still fresh, which its relay took and did not record, are put
-- back as leases.sql's reap puts back a row (an attempt counted, since the request may have
-- been sent, due at once, why; failed once every attempt is used), into the waiting lane
-- (run_after is now later than created_at). The batch is marked ended (relay NULL), which
-- fences off an outcome its relay might still record. At most :batch batches, oldest first;
-- :destinations/:max_attempts and :default_max_attempts as for reap, and :within too: only
-- leases that ended in the last :within seconds (NULL: whenever). Every batch ends this way,
-- and under a held snapshot each leaves a dead entry in outbox_batches_lease_idx at the time
-- its lease ended: a pass from the start of the index would read all of them, every second
-- (40,000 ended batches under a held snapshot: 6 ms a pass instead of 0.07). :only: only
-- these batches (NULL: any); :never: never these (batches whose rows the database refused to
-- put back: the reaper's fallback, as for reap).

WITH expired AS (
    SELECT id, relay FROM {batches}
    WHERE relay IS NOT NULL AND lease_until < now()
      AND (:within::float8 IS NULL OR lease_until >= now() - make_interval(secs => :within::float8))
      AND (:only::bigint[] IS NULL OR id = ANY(:only::bigint[]))
      AND NOT (id = ANY(:never::bigint[]))
    ORDER BY lease_until
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
),
ended AS (
    UPDATE {batches} AS b SET relay = NULL
    WHERE b.id = ANY(ARRAY(SELECT e.id FROM expired AS e))
    RETURNING b.id, b.destination, b.first_id, b.last_id, b.epoch
),
left_over AS MATERIALIZED (
    -- Each ended batch's rows still fresh, read in its own range (a subquery per batch, never
    -- flattened into a join: see the fence above).
    SELECT f.id, x.relay
    FROM ended AS e JOIN expired AS x ON x.id = e.id
    CROSS JOIN LATERAL (
        SELECT o.id FROM {table} AS o
        WHERE o.destination = e.destination AND o.id > e.first_id AND o.id <= e.last_id
          AND o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at
          AND e.epoch = (SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{table})::text, 'id')::regclass)::bigint)
        OFFSET 0
    ) AS f
),
limits AS (
    SELECT * FROM unnest(:destinations::text[], :max_attempts::int[]) AS l(destination, max_attempts)
)
UPDATE {table} AS o
SET status = CASE WHEN o.attempts + 1 >= coalesce(
                      (SELECT l.max_attempts FROM limits AS l WHERE l.destination = o.destination),
                      :default_max_attempts)
                  THEN 'failed' ELSE 'pending' END,
    attempts = o.attempts + 1,
    run_after = now(),
    last_error = 'lease expired: relay ' || e.relay
                 || ' stopped before recording an outcome',
    claims = 1,
    finished_at = CASE WHEN o.attempts + 1 >= coalesce(
                      (SELECT l.max_attempts FROM limits AS l WHERE l.destination = o.destination),
                      :default_max_attempts)
                  THEN now() END
FROM left_over AS e
WHERE o.id = e.id
  AND CASE WHEN o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at THEN true END
RETURNING o.id, o.status, o.destination

-- name: expired_batches
-- params: batch, never
-- Batches whose lease expired, but :never, for reaping them one at a time when the database
-- refuses to reap them together (leases.sql's expired: a trigger that refuses one row must not
-- keep every dead relay's batches). Only after reap_batches failed: from the start of
-- outbox_batches_lease_idx, a held snapshot's dead entries included.

SELECT id FROM {batches}
WHERE relay IS NOT NULL AND lease_until < now() AND NOT (id = ANY(:never::bigint[]))
ORDER BY lease_until
LIMIT :batch

-- name: forget_batches
-- params: keep
-- Ended batches older than :keep seconds, but the last of each chain (where the next claim
-- begins). Kept that long so that a claim whose snapshot predates a batch still meets it
-- (claim_batch); a claim statement never runs for that long (the relay's command timeout).

DELETE FROM {batches} AS b
WHERE b.relay IS NULL AND b.created_at < now() - make_interval(secs => :keep::float8)
  AND EXISTS (SELECT 1 FROM {batches} AS n
              WHERE n.destination = b.destination AND n.epoch = b.epoch AND n.first_id > b.first_id)

-- name: record_batch
-- params: ids, tokens, statuses, counted, delays, errors, relay
-- outcomes.sql's record for rows of batches.

UPDATE {table} AS o
SET status = u.status,
    attempts = o.attempts + u.counted,
    run_after = CASE WHEN u.status = 'pending'
                     THEN now() + make_interval(secs => u.delay) ELSE o.run_after END,
    last_error = COALESCE(u.error, o.last_error),
    delivered_at = CASE WHEN u.status = 'delivered' THEN now() END,
    finished_at = CASE WHEN u.status <> 'pending' THEN now() END,
    claims = 1
FROM unnest(:ids::bigint[], :tokens::bigint[], :statuses::text[], :counted::int[], :delays::float8[], :errors::text[])
     AS u(id, token, status, counted, delay, error)
WHERE o.id = u.id AND o.id = ANY(:ids::bigint[]) AND CASE WHEN o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at
  AND EXISTS (SELECT 1 FROM {batches} AS b
            WHERE b.id = -u.token AND CASE WHEN b.relay = :relay AND b.destination = o.destination
              AND o.id > b.first_id AND o.id <= b.last_id
              AND b.epoch = (SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{table})::text, 'id')::regclass)::bigint)
              AND (b.snapshot_xmax IS NULL OR age(o.xmin) > age(b.snapshot_xmax) OR o.created_at <= b.created_at) THEN true END) THEN true END
RETURNING o.id, u.token

-- name: record_batch_delivered
-- params: ids, tokens, relay
-- outcomes.sql's record_delivered for rows of batches: a batch of plain deliveries.

UPDATE {table} AS o
SET status = 'delivered',
    attempts = o.attempts + 1,
    delivered_at = now(),
    finished_at = now(),
    claims = 1
FROM unnest(:ids::bigint[], :tokens::bigint[]) AS u(id, token)
WHERE o.id = u.id AND o.id = ANY(:ids::bigint[]) AND CASE WHEN o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at
  AND EXISTS (SELECT 1 FROM {batches} AS b
            WHERE b.id = -u.token AND CASE WHEN b.relay = :relay AND b.destination = o.destination
              AND o.id > b.first_id AND o.id <= b.last_id
              AND b.epoch = (SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{table})::text, 'id')::regclass)::bigint)
              AND (b.snapshot_xmax IS NULL OR age(o.xmin) > age(b.snapshot_xmax) OR o.created_at <= b.created_at) THEN true END) THEN true END
RETURNING o.id, u.token

-- name: record_batch_deleting
-- params: ids, tokens, statuses, counted, delays, errors, relay, delivered_ids, delivered_tokens
-- record_batch with retention = 0: delivered rows deleted, the others updated as there.
-- :delivered_ids/:delivered_tokens are the delivered ones again (see outcomes.sql's
-- record_deleting why each part reads its pairs straight from unnest).

WITH gone AS (
    DELETE FROM {table} AS o
    USING unnest(:delivered_ids::bigint[], :delivered_tokens::bigint[]) AS u(id, token)
    WHERE o.id = u.id AND o.id = ANY(:delivered_ids::bigint[]) AND CASE WHEN o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at
      AND EXISTS (SELECT 1 FROM {batches} AS b
            WHERE b.id = -u.token AND CASE WHEN b.relay = :relay AND b.destination = o.destination
              AND o.id > b.first_id AND o.id <= b.last_id
              AND b.epoch = (SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{table})::text, 'id')::regclass)::bigint)
              AND (b.snapshot_xmax IS NULL OR age(o.xmin) > age(b.snapshot_xmax) OR o.created_at <= b.created_at) THEN true END) THEN true END
    RETURNING o.id, u.token
),
kept AS (
    UPDATE {table} AS o
    SET status = u.status,
        attempts = o.attempts + u.counted,
        run_after = CASE WHEN u.status = 'pending'
                         THEN now() + make_interval(secs => u.delay) ELSE o.run_after END,
        last_error = COALESCE(u.error, o.last_error),
        delivered_at = CASE WHEN u.status = 'delivered' THEN now() END,
        finished_at = CASE WHEN u.status <> 'pending' THEN now() END,
        claims = 1
    FROM unnest(:ids::bigint[], :tokens::bigint[], :statuses::text[], :counted::int[], :delays::float8[], :errors::text[])
         AS u(id, token, status, counted, delay, error)
    WHERE o.id = u.id AND o.id = ANY(:ids::bigint[]) AND CASE WHEN o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at
      AND EXISTS (SELECT 1 FROM {batches} AS b
            WHERE b.id = -u.token AND CASE WHEN b.relay = :relay AND b.destination = o.destination
              AND o.id > b.first_id AND o.id <= b.last_id
              AND b.epoch = (SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{table})::text, 'id')::regclass)::bigint)
              AND (b.snapshot_xmax IS NULL OR age(o.xmin) > age(b.snapshot_xmax) OR o.created_at <= b.created_at) THEN true END) THEN true END
      AND u.status <> 'delivered'
    RETURNING o.id, u.token
)
SELECT id, token FROM gone UNION ALL SELECT id, token FROM kept

-- name: record_batch_delivered_deleting
-- params: ids, tokens, relay
-- record_batch_delivered with retention = 0.

DELETE FROM {table} AS o
USING unnest(:ids::bigint[], :tokens::bigint[]) AS u(id, token)
WHERE o.id = u.id AND o.id = ANY(:ids::bigint[]) AND CASE WHEN o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at
  AND EXISTS (SELECT 1 FROM {batches} AS b
            WHERE b.id = -u.token AND CASE WHEN b.relay = :relay AND b.destination = o.destination
              AND o.id > b.first_id AND o.id <= b.last_id
              AND b.epoch = (SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{table})::text, 'id')::regclass)::bigint)
              AND (b.snapshot_xmax IS NULL OR age(o.xmin) > age(b.snapshot_xmax) OR o.created_at <= b.created_at) THEN true END) THEN true END
RETURNING o.id, u.token

-- name: heartbeat_batches
-- params: tokens, relay, lease
-- leases.sql's heartbeat for rows of batches: extends the leases of the batches (:tokens, the
-- rows' tokens) this relay still holds; returns their tokens. One row per batch, whatever
-- its size.

UPDATE {batches} AS b SET lease_until = now() + make_interval(secs => :lease)
WHERE b.id = ANY(ARRAY(SELECT DISTINCT -t FROM unnest(:tokens::bigint[]) AS t))
  AND CASE WHEN b.relay = :relay THEN true END  -- by id, not outbox_batches_lease_idx (see the fence)
RETURNING -b.id

-- name: release_batch
-- params: relay, ids, tokens
-- leases.sql's release for rows of batches: on a clean stop, rows claimed and not attempted
-- move to the waiting lane untouched (run_after later than created_at; no attempt counted),
-- if still fresh and their batch still this relay's. The batch itself ends when its lease
-- does (reap_batches finds nothing of it left to put back).

UPDATE {table} AS o
SET run_after = now(), claims = 1
FROM unnest(:ids::bigint[], :tokens::bigint[]) AS u(id, token)
WHERE o.id = u.id AND o.id = ANY(:ids::bigint[]) AND CASE WHEN o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at
  AND EXISTS (SELECT 1 FROM {batches} AS b
            WHERE b.id = -u.token AND CASE WHEN b.relay = :relay AND b.destination = o.destination
              AND o.id > b.first_id AND o.id <= b.last_id
              AND b.epoch = (SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{table})::text, 'id')::regclass)::bigint) THEN true END) THEN true END

-- name: sweep_batches
-- params: destination
-- claim.sql's fresh_below for a destination claimed in batches: fresh rows at or below the end
-- of its chain (of the ids' current epoch, as this statement's snapshot sees it) that no live
-- batch (relay not NULL) of that epoch covers are never claimed: the claims only read above
-- the chain's end. None but for ids handed out again without a new epoch (a sequence set back
-- with setval, an insert with an explicit id) or a row made fresh again by hand. Each moves
-- to the waiting lane as release_batch moves a row (claims = 1, due now, no attempt counted),
-- and the claims take it row by row; returns their ids. A live batch covers only rows older
-- than it: a row whose version was written by a transaction newer than the batch's own row
-- version (age(o.xmin) < age(b.xmin)) cannot be one its claim took (a claim's transaction id
-- is given at its first write, after its snapshot: every row it took was committed, so its
-- transaction id given, before), but an id handed out again into the range of a batch whose
-- relay has recorded everything and lets its lease lapse; a heartbeat makes the batch's
-- version newer, which only leaves more rows to it (the reaper puts them back once it ends,
-- an attempt counted). A row's xmin alone does not say when it was written: a rewrite that
-- copies every row (pg_repack, an ALTER TABLE that changes a column's type) or a backfill
-- that keeps it fresh gives a row the batch took a version newer than the batch's, and the
-- sweep handed the rows in flight to the waiting lane (delivered twice, their relay's
-- outcomes refused: tests/test_batch_sweep.py). A row written (created_at, its transaction's
-- start) no later than the batch (its claim's) is the batch's too: a row is left to a batch
-- if either says it is older, and only a clock stepped back during a rewrite fools both. An
-- id handed out again gets both a newer xmin and a later created_at (but written by a
-- transaction that began before the batch: then the reaper puts it back). The ages are
-- compared modulo 2^32 (a frozen row keeps its raw xmin): a row pending for more than 2^31
-- transactions looks newer than any batch, and only created_at says it is not. Races: a
-- batch being added meanwhile
-- covers only ids above the end this snapshot read (a claim that read an older end adds
-- nothing: claim_batch), so none of them is moved; a batch ended by the reaper meanwhile had
-- its rows put back in the same statement (not fresh any more); a row a relay records, or a
-- claim or the reaper takes, meanwhile is no longer fresh when the UPDATE re-reads it, and is
-- left as they wrote it (the CASE re-checks the current version). The batch that may hold a
-- row is the one of the chain with the highest first_id below it (a chain's ranges follow
-- each other, and forget_batches deletes only ended ones): read so, each row in flight costs
-- one entry of the chain key; a test of every batch (relay, range) read, with no statistics
-- of outbox_batches, every ended batch kept below each row (tests/test_batch_sweep.py: 1.8
-- million batches for 600 rows in flight). Under a held snapshot
-- (a pg_dump, a replica's feedback) this reads every dead entry of outbox_fresh_idx below the
-- chain's end: the relay runs it with the row claims' sweep, every 30 minutes, off the
-- claim's path (relay/app.py).

WITH chain AS MATERIALIZED (
    SELECT coalesce(
        (SELECT b.last_id FROM {batches} AS b
         WHERE b.destination = :destination
           AND b.epoch = (SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{table})::text, 'id')::regclass)::bigint)
         ORDER BY b.first_id DESC
         LIMIT 1),
        0) AS position
),
stranded AS MATERIALIZED (
    SELECT o.id FROM {table} AS o
    WHERE o.destination = :destination AND o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at
      AND o.id <= (SELECT position FROM chain)
      AND NOT EXISTS (
          SELECT 1 FROM (
              -- The one batch that may hold the row: the highest first_id below it.
              SELECT b.relay, b.last_id, b.xmin AS batch_xmin, b.created_at FROM {batches} AS b
              WHERE b.destination = o.destination AND o.id > b.first_id
                AND b.epoch = (SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{table})::text, 'id')::regclass)::bigint)
              ORDER BY b.first_id DESC
              LIMIT 1
          ) AS b
          WHERE b.relay IS NOT NULL AND o.id <= b.last_id
            AND (age(o.xmin) >= age(b.batch_xmin) OR o.created_at <= b.created_at))
)
UPDATE {table} AS o
SET run_after = now(), claims = 1
FROM stranded AS s
WHERE o.id = s.id
  AND CASE WHEN o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at THEN true END
RETURNING o.id
