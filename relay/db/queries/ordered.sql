-- The statements of ordered destinations: the claim that walks their keys, the owner's claim
-- and its session lock (relay/pipeline/ordered.py), and the keys held up by a failed row.
-- relay/db/queries/ordered.py names them; they are asyncpg's (:name binds handed out as $1,
-- $2, … in their params' order: outbox/sql.py).
--
-- Written alike (tests/test_sql_files.py checks it): the claims end with claim.sql's CTE
-- claimed; a relay that claims ordered destinations as their owner is
-- "('ordered-owner' = ANY(features) AND features_at IS NOT DISTINCT FROM seen_at)" in
-- unowned_peers and claim_owned: it says so at each registration, with the time of that
-- registration (features_at = seen_at). A relay of an earlier release writes no feature, and
-- one rolled back under the same relay_id updates seen_at but not features_at: either way it
-- counts as a relay of an earlier release.

-- name: claim_ordered
-- params: destination, batch, relay, lease, scan, parks_poison, cursor, fence, origin
-- The ordered claim, one statement per ordered destination (:destination). It walks the
-- destination's keys that have waiting rows in key order with a loose index scan (a recursive
-- CTE that jumps from key to key on outbox_key_idx), at most :scan keys, as one part of a
-- round: from after the cursor :cursor (NULL: from the first key) to the round's own key
-- :origin, past the last key round to the first ones when the round's key is not ahead of the
-- cursor (:origin NULL: the round ends at the last key; :origin = :cursor: once round every
-- key). The claimer carries a round on to its end and then lets the destination rest until a
-- wake-up or a poll interval, so keys that are all busy, backing off or blocked are walked once
-- per wake-up, not claim after claim; a wake-up (an outcome recorded, a NOTIFY) starts a new
-- round at the cursor, once round every key, so a key freed behind the cursor is claimed by the
-- next statement (see relay/pipeline/claimer.py). A key with a row in flight (running) is passed
-- over whatever else it holds; otherwise its head is its lowest waiting row: pending, or failed
-- unless the destination parks poison rows (:parks_poison). A head is claimed if it is pending,
-- due, and inside the fence (:fence, read by claim.sql's fence just before); a key whose head is
-- backing off, blocked or too new is passed over, and nothing behind a head is ever looked at,
-- so no state has to be kept for waiting rows. Rows without a key are not ordered and are
-- claimed as they come. At most :batch rows, marked running under this relay's lease (:relay,
-- :lease seconds). The last row of the result (id -1) carries the cursor for the next claim in
-- `key`: the key of the last head selected (in walk order) when the batch filled up, the last
-- key examined when the scan limit cut the walk short, NULL when the round is over (the walk
-- reached the round's key, or found no key left before it). Each step of the walk reads the
-- next key's lowest waiting row, which is most often its head: one index probe per key.
--
-- Running rows are not in outbox_key_idx (a claim would add an entry at a random place in it
-- and a dead one behind: about a third of the database's work on a drain), so the keys in
-- flight are read once per claim from the destination's running rows (outbox_lease_idx: at
-- most the relays' in-flight rows) and the walk passes them over.
--
-- Each branch of the walk is written alike (tests/test_sql_files.py checks it): the lowest
-- waiting row (pending or failed) of the first key its WHERE allows, with whether the walk has
-- wrapped round. The walk's first step: the round's first key after the cursor, or the first
-- key; each further step: the round's next key after k.key.

WITH RECURSIVE k AS (
    -- The first key of the round after the cursor; with no cursor, the first key.
    (SELECT s.key, s.id, s.status, s.run_after, 1 AS n, s.wrapped FROM (
        (SELECT o.key, o.id, o.status, o.run_after, false AS wrapped FROM {table} AS o
         WHERE (:origin::text IS NULL OR :origin::text <= :cursor::text)
           AND o.destination = :destination AND o.key > :cursor::text
           AND o.status IN ('pending', 'failed')
         ORDER BY o.key, o.id
         LIMIT 1)
        UNION ALL
        (SELECT o.key, o.id, o.status, o.run_after, false FROM {table} AS o
         WHERE :origin::text > :cursor::text
           AND o.destination = :destination AND o.key > :cursor::text AND o.key <= :origin::text
           AND o.status IN ('pending', 'failed')
         ORDER BY o.key, o.id
         LIMIT 1)
        UNION ALL
        (SELECT o.key, o.id, o.status, o.run_after, false FROM {table} AS o
         WHERE :cursor::text IS NULL AND o.destination = :destination AND o.key IS NOT NULL
           AND o.status IN ('pending', 'failed')
         ORDER BY o.key, o.id
         LIMIT 1)
        UNION ALL
        (SELECT o.key, o.id, o.status, o.run_after, true FROM {table} AS o
         WHERE :origin::text <= :cursor::text AND o.destination = :destination AND o.key <= :origin::text
           AND o.status IN ('pending', 'failed')
         ORDER BY o.key, o.id
         LIMIT 1)
     ) AS s
     LIMIT 1)
    UNION ALL
    -- Each step: the next key of the round. One branch runs per step (the others' conditions
    -- are constants of the step): each keeps its bounds inside the index scan, where a
    -- condition that changes with the step would become a filter reading every row past
    -- the bound.
    SELECT nxt.key, nxt.id, nxt.status, nxt.run_after, k.n + 1, nxt.wrapped
    FROM k CROSS JOIN LATERAL (
        (SELECT o.key, o.id, o.status, o.run_after, false AS wrapped FROM {table} AS o
         WHERE NOT k.wrapped AND (:origin::text IS NULL OR :origin::text <= :cursor::text)
           AND o.destination = :destination AND o.key > k.key
           AND o.status IN ('pending', 'failed')
         ORDER BY o.key, o.id
         LIMIT 1)
        UNION ALL
        (SELECT o.key, o.id, o.status, o.run_after, false FROM {table} AS o
         WHERE NOT k.wrapped AND :origin::text > :cursor::text
           AND o.destination = :destination AND o.key > k.key AND o.key <= :origin::text
           AND o.status IN ('pending', 'failed')
         ORDER BY o.key, o.id
         LIMIT 1)
        UNION ALL
        (SELECT o.key, o.id, o.status, o.run_after, true FROM {table} AS o
         WHERE NOT k.wrapped AND :origin::text <= :cursor::text
           AND o.destination = :destination AND o.key <= :origin::text
           AND o.status IN ('pending', 'failed')
         ORDER BY o.key, o.id
         LIMIT 1)
        UNION ALL
        (SELECT o.key, o.id, o.status, o.run_after, true FROM {table} AS o
         WHERE k.wrapped AND o.destination = :destination AND o.key > k.key AND o.key <= :origin::text
           AND o.status IN ('pending', 'failed')
         ORDER BY o.key, o.id
         LIMIT 1)
        LIMIT 1
    ) AS nxt
    WHERE k.n < :scan
),
busy AS MATERIALIZED (
    -- Keys with a row in flight, whatever its place in the key.
    SELECT DISTINCT o.key FROM {table} AS o
    WHERE o.status = 'running' AND o.destination = :destination AND o.key IS NOT NULL
),
heads AS (
    -- The walk lands on each key's lowest waiting row: its head, unless that row is failed
    -- and the destination parks poison rows; then the head is the key's lowest pending row,
    -- looked up.
    SELECT h.id, k.key, k.n FROM k
    CROSS JOIN LATERAL (
        SELECT k.id, k.status, k.run_after WHERE NOT (:parks_poison::bool AND k.status = 'failed')
        UNION ALL
        (SELECT o.id, o.status, o.run_after FROM {table} AS o
         WHERE :parks_poison::bool AND k.status = 'failed'
           AND o.destination = :destination AND o.key = k.key AND o.status = 'pending'
         ORDER BY o.id
         LIMIT 1)
    ) AS h
    WHERE h.status = 'pending' AND h.run_after <= now()
      AND h.id <= :fence
      -- NOT IN, not NOT EXISTS: a hashed lookup, not a join the planner may run as a loop
      -- over the keys in flight for each key walked (it did, expecting few running rows).
      -- Hashed while the keys in flight it expects fit work_mem x hash_mem_multiplier (about
      -- 100,000 keys at the defaults); past that, each key walked reads the list again.
      -- NULL-safe: busy holds no NULL.
      AND k.key NOT IN (SELECT b.key FROM busy AS b)
    LIMIT :batch
),
unkeyed AS (
    SELECT o.id FROM {table} AS o
    WHERE o.destination = :destination AND o.status = 'pending' AND o.key IS NULL
      AND o.run_after <= now()
    ORDER BY o.run_after, o.id
    LIMIT :batch
),
locked AS (
    -- Another relay may have claimed a head since this statement's snapshot: the lock
    -- re-reads the row and the status check drops it. IS TRUE: read by id, never through
    -- a partial index of pending rows (see claim_owned).
    SELECT o.id FROM {table} AS o
    WHERE o.id = ANY(ARRAY(SELECT id FROM heads UNION ALL SELECT id FROM unkeyed))
      AND (o.status = 'pending') IS TRUE
    ORDER BY o.id
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
),
claimed AS (
    UPDATE {table} AS o
    SET status = 'running', locked_by = :relay, locked_until = now() + make_interval(secs => :lease),
        claims = o.claims + 1
    WHERE o.id = ANY(ARRAY(SELECT id FROM locked))
    RETURNING o.id, o.destination, o.key, o.payload, o.content_type, o.headers::text AS headers,
              o.attempts, extract(epoch FROM o.created_at)::float8 AS created_at, o.claims,
              o.event_type
)
SELECT * FROM claimed
UNION ALL
SELECT -1, NULL, CASE
           WHEN (SELECT count(*) FROM heads) >= :batch
               THEN NULLIF((SELECT key FROM heads ORDER BY n DESC LIMIT 1), :origin::text)
           WHEN (SELECT count(*) FROM k) >= :scan
               THEN NULLIF((SELECT key FROM k ORDER BY n DESC LIMIT 1), :origin::text)
       END,
       NULL, NULL, NULL, 0, NULL, 0, NULL

-- name: own_ordered
-- params: table, destination
-- One relay at a time claims an ordered destination as its owner, on the connection that holds
-- this session lock: its claims stop with that connection, and the next owner takes the lock
-- only once no claim of the previous one can still commit. :table: the table, :destination:
-- the destination.

SELECT pg_try_advisory_lock(hashtextextended('outbox-relay:ordered:' || :table || ':' || :destination, 0))

-- name: running_keyed
-- params: destination
-- Keyed rows of the destination in flight when a relay becomes its owner (claimed by the owner
-- before it, or by a relay of an earlier release): their keys wait until they are not running.
-- Read once per ownership (outbox_lease_idx: under a held snapshot, every dead entry of it).

SELECT id, claims, key FROM {table}
WHERE destination = :destination AND status = 'running' AND key IS NOT NULL

-- name: still_running
-- params: ids, tokens
-- Of (id, token) pairs read by running_keyed, those still running under that claim.

SELECT o.id FROM {table} AS o
JOIN unnest(:ids::bigint[], :tokens::int[]) AS u(id, token) ON o.id = u.id
WHERE o.claims = u.token AND o.status = 'running'

-- name: unowned_peers
-- params: relay, destination, seen_within
-- Whether a relay other than :relay, seen within :seen_within seconds and not stopped, serves
-- destination :destination without claiming ordered destinations as their owner (a relay of an
-- earlier release).

SELECT EXISTS (
    SELECT 1 FROM {relays}
    WHERE relay_id <> :relay AND :destination = ANY(destinations) AND stopped_at IS NULL
      AND seen_at > now() - make_interval(secs => :seen_within)
      AND NOT ('ordered-owner' = ANY(features) AND features_at IS NOT DISTINCT FROM seen_at)
)

-- name: claim_owned
-- params: destination, batch, relay, lease, read_from, fence, reading, blocks_failed, ids, keys, busy, keyless, peers_within
-- The owner's claim of an ordered destination (:destination). Its cost does not grow with rows
-- already delivered, whether or not VACUUM can remove them: fresh rows are read once each, in id
-- order from where the owner's reading stopped (:read_from) up to the fence (:fence, read by
-- claim.sql's fence just before), at most :reading of them; the owner keeps those it cannot
-- claim yet in memory, and passes each key's lowest such row back (:ids ids, :keys keys: one per
-- key not in flight). The other rows a key's order depends on are read whole at each claim, from
-- indexes that hold only them: the waiting rows (retried, reaped, replayed, enqueued for later)
-- and, where they block their keys (:blocks_failed), the failed ones. A key's head is its lowest
-- row of these; it is claimed when it is pending and due and no row of its key is in flight
-- (:busy: the owner's rows in flight, and those of the owner before it still running). Rows
-- without a key are claimed as they come (:keyless: those kept in memory). At most :batch rows,
-- marked running under this relay's lease (:relay, :lease seconds). Returns the claimed rows,
-- then marker rows: id -2 for a row chosen from memory that is no longer pending (skipped,
-- purged: its id in content_type; the owner forgets it), id -3 for each fresh row read (its key
-- in `key`, its id in content_type: the owner keeps those it did not claim), id -4 when a relay
-- of an earlier release serves the destination (:peers_within: seen within so many seconds),
-- and nothing was claimed.

WITH peers AS MATERIALIZED (
    -- A relay of an earlier release that began to serve the destination (it registers before
    -- its first claim): it cannot see the owner's memory, so the owner claims nothing here
    -- and walks the keys from now on, as that relay does.
    SELECT EXISTS (
        SELECT 1 FROM {relays}
        WHERE relay_id <> :relay AND :destination = ANY(destinations) AND stopped_at IS NULL
          AND seen_at > now() - make_interval(secs => :peers_within)
          AND NOT ('ordered-owner' = ANY(features) AND features_at IS NOT DISTINCT FROM seen_at)
    ) AS serving
),
scanned AS MATERIALIZED (
    SELECT id, key FROM {table}
    WHERE destination = :destination AND status = 'pending' AND claims = 0 AND run_after <= created_at
      AND id > :read_from::bigint AND id <= :fence::bigint
    ORDER BY id
    LIMIT :reading
),
reach AS MATERIALIZED (
    -- Up to where every fresh row has now been read, the memory's (read_from) or this reading's. A
    -- waiting or failed row above it may have a lower fresh row of its key not read yet, or
    -- not yet committed (above the fence): it cannot be its key's head yet.
    SELECT CASE WHEN :reading = 0 THEN :read_from::bigint
                WHEN (SELECT count(*) FROM scanned) >= :reading THEN (SELECT max(id) FROM scanned)
                ELSE :fence::bigint END AS id
),
waiting AS MATERIALIZED (
    SELECT id, key, run_after <= now() AS due FROM {table}
    WHERE destination = :destination AND status = 'pending' AND (claims <> 0 OR run_after > created_at)
    UNION ALL
    SELECT id, key, false FROM {table}
    WHERE :blocks_failed::bool AND destination = :destination AND status = 'failed' AND key IS NOT NULL
),
blocking AS (
    SELECT DISTINCT ON (w.key) w.key, w.id, w.due FROM waiting AS w
    WHERE w.key IS NOT NULL
    ORDER BY w.key, w.id
),
fresh AS (
    SELECT DISTINCT ON (f.key) f.key, f.id FROM (
        SELECT m.id, m.key FROM unnest(:ids::bigint[], :keys::text[]) AS m(id, key)
        UNION ALL
        SELECT s.id, s.key FROM scanned AS s WHERE s.key IS NOT NULL
    ) AS f
    ORDER BY f.key, f.id
),
heads AS (
    SELECT CASE WHEN b.id IS NULL OR f.id < b.id THEN f.id ELSE b.id END AS id
    FROM fresh AS f FULL JOIN blocking AS b ON b.key = f.key
    WHERE coalesce(f.key, b.key) <> ALL(:busy::text[])
      AND (b.id IS NULL OR f.id < b.id OR (b.due AND b.id <= (SELECT id FROM reach)))
),
chosen AS (
    SELECT c.id FROM (
        SELECT id FROM heads
        UNION ALL SELECT m.id FROM unnest(:keyless::bigint[]) AS m(id)
        UNION ALL SELECT s.id FROM scanned AS s WHERE s.key IS NULL
        UNION ALL SELECT w.id FROM waiting AS w WHERE w.key IS NULL AND w.due
    ) AS c
    ORDER BY c.id
    LIMIT :batch
),
locked AS (
    SELECT o.id FROM {table} AS o
    -- IS TRUE: a condition the planner cannot match to a partial index's predicate, so
    -- that it reads these rows by their ids. Estimating few pending rows, it chose to read
    -- every entry of outbox_claim_idx for the destination instead, dead ones included: a
    -- claim grew to 140 ms in two minutes of a held snapshot.
    WHERE o.id = ANY(ARRAY(SELECT id FROM chosen)) AND o.destination = :destination
      AND (o.status = 'pending') IS TRUE AND NOT (SELECT serving FROM peers)
    FOR UPDATE SKIP LOCKED
),
claimed AS (
    UPDATE {table} AS o
    SET status = 'running', locked_by = :relay, locked_until = now() + make_interval(secs => :lease),
        claims = o.claims + 1
    WHERE o.id = ANY(ARRAY(SELECT id FROM locked))
    RETURNING o.id, o.destination, o.key, o.payload, o.content_type, o.headers::text AS headers,
              o.attempts, extract(epoch FROM o.created_at)::float8 AS created_at, o.claims,
              o.event_type
)
SELECT * FROM claimed
UNION ALL
SELECT -2, NULL, NULL, NULL, c.id::text, NULL, 0, NULL, 0, NULL
FROM chosen AS c
WHERE c.id <= :read_from::bigint
  AND NOT EXISTS (SELECT 1 FROM {table} AS o
                  WHERE o.id = c.id AND o.destination = :destination AND (o.status = 'pending') IS TRUE)
UNION ALL
SELECT -3, NULL, s.key, NULL, s.id::text, NULL, 0, NULL, 0, NULL
FROM scanned AS s
UNION ALL
SELECT -4, NULL, NULL, NULL, NULL, NULL, 0, NULL, 0, NULL
FROM peers WHERE serving

-- name: blocked_keys
-- params: destinations
-- Keys held up by a failed row: a key's first failed row with later rows of the key pending
-- behind it. For a destination with ordering = "key" and poison_policy = "block" those rows
-- wait; elsewhere they flow anyway. :destinations: destinations, or NULL for all.

SELECT f.destination, f.key, f.id AS failed_id, f.last_error, count(n.id) AS waiting
FROM {table} AS f
JOIN {table} AS n
  ON n.destination = f.destination AND n.key = f.key AND n.id > f.id AND n.status = 'pending'
WHERE f.status = 'failed' AND f.key IS NOT NULL
  AND (:destinations::text[] IS NULL OR f.destination = ANY(:destinations::text[]))
  AND NOT EXISTS (SELECT 1 FROM {table} AS e
                  WHERE e.destination = f.destination AND e.key = f.key AND e.id < f.id
                    AND e.status = 'failed')
GROUP BY f.destination, f.key, f.id, f.last_error
ORDER BY f.destination, f.key
