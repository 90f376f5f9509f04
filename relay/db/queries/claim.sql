-- The claim of an unordered destination (its two lanes, fresh and waiting rows), the fence it
-- reads first, and the check for fresh rows below where its claims have seen every one;
-- relay/db/queries/claim.py names them, relay/db/claims.py runs them. They are asyncpg's
-- (:name binds handed out as $1, $2, … in their params' order: outbox/sql.py).
--
-- Pieces written alike in several statements (tests/test_sql_files.py checks they stay so):
-- a fresh row, "status = 'pending' AND claims = 0 AND run_after <= created_at" (with "o."
-- where the table is o); and every claim's last step, the CTE claimed: the rows chosen marked
-- running under this relay's lease (:relay the relay, :lease the lease in seconds), the fencing
-- token taken (claims + 1), and returned as relay.db.envelopes reads them (claim, claim_fresh,
-- and ordered.sql's claim_ordered and claim_owned).

-- name: claim
-- params: destination, batch, relay, lease, cursor, top, recheck
-- The claim: one statement per destination (:destination), after fence (see below). Pick
-- its claimable rows, skip rows other relays are locking, mark them running under this relay's
-- lease, return them. The index ranges are the destination's own, so other destinations'
-- backlogs cost nothing.
--
-- Two lanes (migration 0012). Fresh rows (never claimed, due when written: nearly all of them)
-- are read in id order from outbox_fresh_idx, after the cursor :cursor: where the previous claim
-- of this relay ended. A held snapshot (a pg_dump, a report, an idle transaction) keeps every
-- claimed row's dead entry in the index; a walk from the start of the range would pass all of
-- them, claim after claim (the claim's cost grew by 0.1 ms per thousand rows delivered while a
-- snapshot was held: docs/performance.md). From the cursor it passes only those claimed since
-- the last claim. Rows due again (retried, reaped, released, replayed, or written with a later
-- run_after) are read in run_after order from outbox_waiting_idx. Up to :batch rows are locked
-- in each lane, and the :batch first in run_after order are claimed: neither lane can starve the
-- other.
--
-- Ids are drawn at insert and seen at commit, so the cursor passes ids of transactions still
-- open, whose rows may commit later. Each claim also reads the fresh rows after :recheck up to
-- the cursor: those that may have committed late since the previous claim. The relay computes
-- :recheck from what fence read before this claim and the one before (see relay/db/claims.py):
-- the keys of the inserting transactions that were open then and have ended since (each one's
-- ids are above its key), the highest id visible at the previous reading (:top now: a
-- transaction that began after a reading takes a key above it) and the first row the previous
-- claim left in that range. A transaction left open after an insert holds back none of this:
-- its rows are read once, when it ends.
--
-- The last row of the result (id -1) carries the next cursor in `key` (below the first fresh
-- row this claim saw pending and did not claim: rows other relays are claiming at this moment
-- are seen pending, so a claim that rolls back leaves its rows ahead of the cursor) and the next
-- :recheck in `content_type`. tests/test_claim_lanes.py holds these rules and the plans.

WITH waiting AS (
    SELECT id, run_after FROM {table}
    WHERE destination = :destination AND status = 'pending' AND (claims <> 0 OR run_after > created_at)
      AND run_after <= now()
    ORDER BY run_after, id
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
),
late AS (
    SELECT id, run_after FROM {table}
    WHERE destination = :destination AND status = 'pending' AND claims = 0 AND run_after <= created_at AND id > :recheck::bigint AND id <= :cursor::bigint
      AND run_after <= now()
    ORDER BY id
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
),
fresh AS (
    SELECT id, run_after FROM {table}
    WHERE destination = :destination AND status = 'pending' AND claims = 0 AND run_after <= created_at AND id > :cursor::bigint AND run_after <= now()
    ORDER BY id
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
),
chosen AS (
    SELECT c.id FROM (
        SELECT * FROM waiting UNION ALL SELECT * FROM late UNION ALL SELECT * FROM fresh
    ) AS c
    ORDER BY c.run_after, c.id
    LIMIT :batch
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
         WHERE o.destination = :destination AND o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at AND o.id > :cursor::bigint
           AND o.id NOT IN (SELECT c.id FROM chosen AS c)),
        (SELECT max(c.id) FROM chosen AS c WHERE c.id > :cursor::bigint),
        :cursor::bigint) AS cursor
)
SELECT * FROM claimed
UNION ALL
SELECT -1, NULL, n.cursor::text,
       NULL, least(:top::bigint, n.cursor, coalesce(
           (SELECT min(o.id) - 1 FROM {table} AS o
            WHERE o.destination = :destination AND o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at
              AND o.id > :recheck::bigint AND o.id <= :cursor::bigint
              AND o.id NOT IN (SELECT c.id FROM chosen AS c)),
           n.cursor))::text,
       NULL, 0, NULL, 0, NULL
FROM next_cursor AS n

-- name: claim_fresh
-- params: destination, batch, relay, lease, cursor, top
-- claim when the late commits' range (:recheck, :cursor] is empty, as it is on a drain (every
-- row was visible before the claim began): the same answer without two of its reads (the CTE
-- late, and the least() of the marker row's next :recheck), whose planning is a tenth of the
-- claim's cost (force_custom_plan plans each claim anew). :recheck is not passed. Written
-- alike: tests/test_sql_files.py checks that it is claim without those reads.

WITH waiting AS (
    SELECT id, run_after FROM {table}
    WHERE destination = :destination AND status = 'pending' AND (claims <> 0 OR run_after > created_at)
      AND run_after <= now()
    ORDER BY run_after, id
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
),
fresh AS (
    SELECT id, run_after FROM {table}
    WHERE destination = :destination AND status = 'pending' AND claims = 0 AND run_after <= created_at AND id > :cursor::bigint AND run_after <= now()
    ORDER BY id
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
),
chosen AS (
    SELECT c.id FROM (
        SELECT * FROM waiting UNION ALL SELECT * FROM fresh
    ) AS c
    ORDER BY c.run_after, c.id
    LIMIT :batch
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
         WHERE o.destination = :destination AND o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at AND o.id > :cursor::bigint
           AND o.id NOT IN (SELECT c.id FROM chosen AS c)),
        (SELECT max(c.id) FROM chosen AS c WHERE c.id > :cursor::bigint),
        :cursor::bigint) AS cursor
)
SELECT * FROM claimed
UNION ALL
SELECT -1, NULL, n.cursor::text,
       NULL, least(:top::bigint, n.cursor)::text,
       NULL, 0, NULL, 0, NULL
FROM next_cursor AS n

-- name: fresh_below
-- params: destination, recheck
-- Fresh rows of a destination at or below where its claims have seen every one (:recheck):
-- none, but for ids handed out again (a sequence set back by hand; a table truncated, or a
-- failover, are noticed by fence's epoch). The relay looks now and then, off the claim's path:
-- under a held snapshot this reads every dead entry below :recheck.

SELECT min(id) FROM {table} WHERE destination = :destination AND status = 'pending' AND claims = 0 AND run_after <= created_at AND id <= :recheck

-- name: fence
-- params: table, top
-- The visibility fence (see migrations/0003), read in a statement of its own *before* the
-- claims, whose snapshot must be younger than this reading (an unordered claim that follows a
-- full batch at once may go on the previous reading, older still: see relay/db/claims.py): a
-- transaction that commits between a claim's snapshot and its reading of pg_locks would release
-- its lock while its rows stay invisible to that claim. Every id up to the result belongs to a
-- transaction that had finished when it was read: the smallest fence key still held (taken
-- before its holder drew any id), capped at the highest id then visible (ids are drawn in
-- increasing order, so a row at or below it was drawn before this reading, and so were all
-- lower ids). Only this table's keys count (:table; see migrations/0004 for the key's layout),
-- and untagged keys of inserts that began under the trigger of migration 0003: an untagged key
-- is ignored only when its transaction holds a tagged key of the same value (the pair the new
-- trigger takes together). A tagged key counts only when its transaction also holds a lock
-- on this table: an insert takes one before its trigger takes the key, and keeps both to its
-- end, while another schema's outbox whose tag collides takes a key of its own sequence's
-- value, which would hold this table's fence back for as long as that insert stays open
-- (tests/test_batch_past_fence_review.py). pg_locks lists the backends' fast-path locks
-- (a table lock such as an insert's) before the main lock table: a key seen without its
-- transaction's table lock was taken after this statement's snapshot, so its value is above
-- every id this reading counts as visible, and ignoring it lowers nothing. :top: a highest id
-- seen before, or 0.

WITH locks AS MATERIALIZED (
    -- One read of pg_locks: the fence keys, and the locks on this table.
    SELECT l.locktype, l.virtualtransaction AS vxid,
           ((l.classid::bigint << 32) | l.objid::bigint) - 4611686018427387904 AS k
    FROM pg_locks AS l
    WHERE l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND ((l.locktype = 'advisory' AND l.objsubid = 1
            AND l.classid::bigint >= 1073741824 AND l.classid::bigint < 2147483648)
           OR (l.locktype = 'relation' AND l.relation = :table::regclass))
),
fence_keys AS (
    SELECT vxid, k >> 48 AS tag, k & 281474976710655 AS v FROM locks WHERE locktype = 'advisory'
),
mine AS MATERIALIZED (
    SELECT a.vxid, a.v FROM fence_keys AS a
    WHERE (a.tag = 1 + mod(:table::regclass::oid::bigint, 16383)
           AND EXISTS (SELECT 1 FROM locks AS t WHERE t.locktype = 'relation' AND t.vxid = a.vxid))
       OR (a.tag = 0 AND NOT EXISTS (SELECT 1 FROM fence_keys AS b
                                     WHERE b.vxid = a.vxid AND b.tag > 0 AND b.v = a.v))
),
top AS MATERIALIZED (
    -- From a highest id seen before (top, or 0), which stays a valid cap (those ids were drawn
    -- before), so that the walk back from the end of the primary key stops there: with
    -- retention = 0 and a held snapshot, every deleted row's entry lies on that walk.
    SELECT coalesce(max(id), :top::bigint) AS id FROM {table} WHERE id > :top::bigint
)
SELECT least((SELECT coalesce(min(v), 9223372036854775807) FROM mine), (SELECT id FROM top)),
-- The table's epoch: a TRUNCATE gives it a new file, a restart or a failover a new server
-- start; either may hand out ids again that the fresh lane's cursor has passed (see CLAIM).
pg_relation_filenode(:table::regclass)::bigint,
extract(epoch FROM pg_postmaster_start_time())::float8,
-- For the unordered claim (see CLAIM): the highest id visible, and the keys held, each with its
-- transaction ("<virtual transaction id>/<key>": two inserts that began together hold the same
-- key, and one of them ending is news while the other is still open). A transaction's ids
-- are above its key.
(SELECT id FROM top),
ARRAY(SELECT DISTINCT vxid || '/' || v FROM mine),
-- For batch leases (batches.sql): the epoch of the ids, the file of the id column's sequence.
-- It changes only when ids may be handed out again from the start (TRUNCATE ... RESTART
-- IDENTITY, ALTER SEQUENCE), not when the table is rewritten (VACUUM FULL, CLUSTER) or
-- truncated without RESTART IDENTITY, which hand out no id again; nor on a setval, which
-- batches.sql's sweep_batches is for. Read with the row's type for the table's name, as
-- batches.sql reads it (a schema's name in a string literal could break the statement).
(SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{table})::text, 'id')::regclass)::bigint)
