"""The statements of ordered destinations: the claim that walks their keys, the owner's claim
and its session lock (relay/pipeline/ordered.py), and the keys held up by a failed row."""

from __future__ import annotations

from relay.db.queries.claim import _mark_running


# The ordered claim, one statement per ordered destination ($1). It walks the destination's keys
# that have waiting rows in key order with a loose index scan (a recursive CTE that jumps from key
# to key on outbox_key_idx), at most $5 keys, as one part of a round: from after the cursor $7
# (NULL: from the first key) to the round's own key $9, past the last key round to the first ones
# when the round's key is not ahead of the cursor ($9 NULL: the round ends at the last key; $9 = $7:
# once round every key). The claimer carries a round on to its end and then lets the destination
# rest until a wake-up or a poll interval, so keys that are all busy, backing off or blocked are
# walked once per wake-up, not claim after claim; a wake-up (an outcome recorded, a NOTIFY) starts a
# new round at the cursor, once round every key, so a key freed behind the cursor is claimed by the
# next statement (see relay/pipeline/claimer.py). A key with a row in flight (running) is passed
# over whatever else it holds; otherwise its head is its lowest waiting row: pending, or failed
# unless the destination parks poison rows ($6). A head is claimed if it is pending, due, and inside
# the fence ($8, read by FENCE just before); a key whose head is backing off, blocked or too new is
# passed over, and nothing behind a head is ever looked at, so no state has to be kept for waiting
# rows. Rows without a key are not ordered and are claimed as they come. The last row of the result
# (id -1) carries the cursor for the next claim in `key`: the key of the last head selected (in walk
# order) when the batch filled up, the last key examined when the scan limit cut the walk short,
# NULL when the round is over (the walk reached the round's key, or found no key left before it).
# Each step of the walk reads the next key's lowest waiting row, which is most often its head: one
# index probe per key.
#
# Running rows are not in outbox_key_idx (a claim would add an entry at a random place in it
# and a dead one behind: about a third of the database's work on a drain), so the keys in
# flight are read once per claim from the destination's running rows (outbox_lease_idx: at
# most the relays' in-flight rows) and the walk passes them over.
def _walk_step(wrapped: str, where: str) -> str:
    """One branch of CLAIM_ORDERED's walk: the lowest waiting row (pending or failed) of the
    first key ``where`` allows, with whether the walk has wrapped round (``wrapped``)."""
    return f"""(SELECT o.key, o.id, o.status, o.run_after, {wrapped} FROM {{table}} AS o
         WHERE {where}
           AND o.status IN ('pending', 'failed')
         ORDER BY o.key, o.id
         LIMIT 1)"""


# The walk's first step: the round's first key after the cursor, or the first key.
_FIRST_KEY = "\n        UNION ALL\n        ".join(
    (
        _walk_step(
            "false AS wrapped",
            """($9::text IS NULL OR $9::text <= $7::text)
           AND o.destination = $1 AND o.key > $7::text""",
        ),
        _walk_step(
            "false",
            """$9::text > $7::text
           AND o.destination = $1 AND o.key > $7::text AND o.key <= $9::text""",
        ),
        _walk_step("false", "$7::text IS NULL AND o.destination = $1 AND o.key IS NOT NULL"),
        _walk_step("true", "$9::text <= $7::text AND o.destination = $1 AND o.key <= $9::text"),
    )
)

# Each further step: the round's next key after k.key.
_NEXT_KEY = "\n        UNION ALL\n        ".join(
    (
        _walk_step(
            "false AS wrapped",
            """NOT k.wrapped AND ($9::text IS NULL OR $9::text <= $7::text)
           AND o.destination = $1 AND o.key > k.key""",
        ),
        _walk_step(
            "false",
            """NOT k.wrapped AND $9::text > $7::text
           AND o.destination = $1 AND o.key > k.key AND o.key <= $9::text""",
        ),
        _walk_step(
            "true",
            """NOT k.wrapped AND $9::text <= $7::text
           AND o.destination = $1 AND o.key <= $9::text""",
        ),
        _walk_step(
            "true", "k.wrapped AND o.destination = $1 AND o.key > k.key AND o.key <= $9::text"
        ),
    )
)

CLAIM_ORDERED = f"""
WITH RECURSIVE k AS (
    -- The first key of the round after the cursor; with no cursor, the first key.
    (SELECT s.key, s.id, s.status, s.run_after, 1 AS n, s.wrapped FROM (
        {_FIRST_KEY}
     ) AS s
     LIMIT 1)
    UNION ALL
    -- Each step: the next key of the round. One branch runs per step (the others' conditions
    -- are constants of the step): each keeps its bounds inside the index scan, where a
    -- condition that changes with the step would become a filter reading every row past
    -- the bound.
    SELECT nxt.key, nxt.id, nxt.status, nxt.run_after, k.n + 1, nxt.wrapped
    FROM k CROSS JOIN LATERAL (
        {_NEXT_KEY}
        LIMIT 1
    ) AS nxt
    WHERE k.n < $5
),
busy AS MATERIALIZED (
    -- Keys with a row in flight, whatever its place in the key.
    SELECT DISTINCT o.key FROM {{table}} AS o
    WHERE o.status = 'running' AND o.destination = $1 AND o.key IS NOT NULL
),
heads AS (
    -- The walk lands on each key's lowest waiting row: its head, unless that row is failed
    -- and the destination parks poison rows; then the head is the key's lowest pending row,
    -- looked up.
    SELECT h.id, k.key, k.n FROM k
    CROSS JOIN LATERAL (
        SELECT k.id, k.status, k.run_after WHERE NOT ($6::bool AND k.status = 'failed')
        UNION ALL
        (SELECT o.id, o.status, o.run_after FROM {{table}} AS o
         WHERE $6::bool AND k.status = 'failed'
           AND o.destination = $1 AND o.key = k.key AND o.status = 'pending'
         ORDER BY o.id
         LIMIT 1)
    ) AS h
    WHERE h.status = 'pending' AND h.run_after <= now()
      AND h.id <= $8
      -- NOT IN, not NOT EXISTS: a hashed lookup, not a join the planner may run as a loop
      -- over the keys in flight for each key walked (it did, expecting few running rows).
      -- Hashed while the keys in flight it expects fit work_mem x hash_mem_multiplier (about
      -- 100,000 keys at the defaults); past that, each key walked reads the list again.
      -- NULL-safe: busy holds no NULL.
      AND k.key NOT IN (SELECT b.key FROM busy AS b)
    LIMIT $2
),
unkeyed AS (
    SELECT o.id FROM {{table}} AS o
    WHERE o.destination = $1 AND o.status = 'pending' AND o.key IS NULL
      AND o.run_after <= now()
    ORDER BY o.run_after, o.id
    LIMIT $2
),
locked AS (
    -- Another relay may have claimed a head since this statement's snapshot: the lock
    -- re-reads the row and the status check drops it. IS TRUE: read by id, never through
    -- a partial index of pending rows (see CLAIM_OWNED).
    SELECT o.id FROM {{table}} AS o
    WHERE o.id = ANY(ARRAY(SELECT id FROM heads UNION ALL SELECT id FROM unkeyed))
      AND (o.status = 'pending') IS TRUE
    ORDER BY o.id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
{_mark_running("locked")}
SELECT * FROM claimed
UNION ALL
SELECT -1, NULL, CASE
           WHEN (SELECT count(*) FROM heads) >= $2
               THEN NULLIF((SELECT key FROM heads ORDER BY n DESC LIMIT 1), $9::text)
           WHEN (SELECT count(*) FROM k) >= $5
               THEN NULLIF((SELECT key FROM k ORDER BY n DESC LIMIT 1), $9::text)
       END,
       NULL, NULL, NULL, 0, NULL, 0, NULL
"""

# One relay at a time claims an ordered destination as its owner, on the connection that holds
# this session lock: its claims stop with that connection, and the next owner takes the lock only
# once no claim of the previous one can still commit. $1: the table, $2: the destination.
OWN_ORDERED = """
SELECT pg_try_advisory_lock(hashtextextended('outbox-relay:ordered:' || $1 || ':' || $2, 0))
"""

# Keyed rows of the destination in flight when a relay becomes its owner (claimed by the owner
# before it, or by a relay of an earlier release): their keys wait until they are not running.
# Read once per ownership (outbox_lease_idx: under a held snapshot, every dead entry of it).
RUNNING_KEYED = """
SELECT id, claims, key FROM {table}
WHERE destination = $1 AND status = 'running' AND key IS NOT NULL
"""

# Of (id, token) pairs read by RUNNING_KEYED, those still running under that claim.
STILL_RUNNING = """
SELECT o.id FROM {table} AS o
JOIN unnest($1::bigint[], $2::int[]) AS u(id, token) ON o.id = u.id
WHERE o.claims = u.token AND o.status = 'running'
"""

# A relay that claims ordered destinations as their owner: it says so at each registration,
# with the time of that registration (features_at = seen_at). A relay of an earlier release
# writes no feature, and one rolled back under the same relay_id updates seen_at but not
# features_at: either way it counts as a relay of an earlier release.
_OWNER_CAPABLE = "('ordered-owner' = ANY(features) AND features_at IS NOT DISTINCT FROM seen_at)"

# Whether a relay other than $1, seen within $3 seconds and not stopped, serves destination $2
# without claiming ordered destinations as their owner (a relay of an earlier release).
UNOWNED_PEERS = """
SELECT EXISTS (
    SELECT 1 FROM {relays}
    WHERE relay_id <> $1 AND $2 = ANY(destinations) AND stopped_at IS NULL
      AND seen_at > now() - make_interval(secs => $3)
      AND NOT {owner_capable}
)
""".replace("{owner_capable}", _OWNER_CAPABLE)

# The owner's claim of an ordered destination ($1). Its cost does not grow with rows already
# delivered, whether or not VACUUM can remove them: fresh rows are read once each, in id order
# from where the owner's reading stopped ($5) up to the fence ($6, read by FENCE just before),
# at most $7 of them; the owner keeps those it cannot claim yet in memory, and passes each key's
# lowest such row back ($9 ids, $10 keys: one per key not in flight). The other rows a key's
# order depends on are read whole at each claim, from indexes that hold only them: the waiting
# rows (retried, reaped, replayed, enqueued for later) and, where they block their keys ($8),
# the failed ones. A key's head is its lowest row of these; it is claimed when it is pending and
# due and no row of its key is in flight ($11: the owner's rows in flight, and those of the
# owner before it still running). Rows without a key are claimed as they come ($12: those kept
# in memory). Returns the claimed rows, then marker rows: id -2 for a row chosen from memory that
# is no longer pending (skipped, purged: its id in content_type; the owner forgets it), id -3
# for each fresh row read (its key in `key`, its id in content_type: the owner keeps those it
# did not claim), id -4 when a relay of an earlier release serves the destination ($13: seen
# within so many seconds), and nothing was claimed.
CLAIM_OWNED = """
WITH peers AS MATERIALIZED (
    -- A relay of an earlier release that began to serve the destination (it registers before
    -- its first claim): it cannot see the owner's memory, so the owner claims nothing here
    -- and walks the keys from now on, as that relay does.
    SELECT EXISTS (
        SELECT 1 FROM {relays}
        WHERE relay_id <> $3 AND $1 = ANY(destinations) AND stopped_at IS NULL
          AND seen_at > now() - make_interval(secs => $13)
          AND NOT {owner_capable}
    ) AS serving
),
scanned AS MATERIALIZED (
    SELECT id, key FROM {table}
    WHERE destination = $1 AND status = 'pending' AND claims = 0 AND run_after <= created_at
      AND id > $5::bigint AND id <= $6::bigint
    ORDER BY id
    LIMIT $7
),
reach AS MATERIALIZED (
    -- Up to where every fresh row has now been read, the memory's ($5) or this reading's. A
    -- waiting or failed row above it may have a lower fresh row of its key not read yet, or
    -- not yet committed (above the fence): it cannot be its key's head yet.
    SELECT CASE WHEN $7 = 0 THEN $5::bigint
                WHEN (SELECT count(*) FROM scanned) >= $7 THEN (SELECT max(id) FROM scanned)
                ELSE $6::bigint END AS id
),
waiting AS MATERIALIZED (
    SELECT id, key, run_after <= now() AS due FROM {table}
    WHERE destination = $1 AND status = 'pending' AND (claims <> 0 OR run_after > created_at)
    UNION ALL
    SELECT id, key, false FROM {table}
    WHERE $8::bool AND destination = $1 AND status = 'failed' AND key IS NOT NULL
),
blocking AS (
    SELECT DISTINCT ON (w.key) w.key, w.id, w.due FROM waiting AS w
    WHERE w.key IS NOT NULL
    ORDER BY w.key, w.id
),
fresh AS (
    SELECT DISTINCT ON (f.key) f.key, f.id FROM (
        SELECT m.id, m.key FROM unnest($9::bigint[], $10::text[]) AS m(id, key)
        UNION ALL
        SELECT s.id, s.key FROM scanned AS s WHERE s.key IS NOT NULL
    ) AS f
    ORDER BY f.key, f.id
),
heads AS (
    SELECT CASE WHEN b.id IS NULL OR f.id < b.id THEN f.id ELSE b.id END AS id
    FROM fresh AS f FULL JOIN blocking AS b ON b.key = f.key
    WHERE coalesce(f.key, b.key) <> ALL($11::text[])
      AND (b.id IS NULL OR f.id < b.id OR (b.due AND b.id <= (SELECT id FROM reach)))
),
chosen AS (
    SELECT c.id FROM (
        SELECT id FROM heads
        UNION ALL SELECT m.id FROM unnest($12::bigint[]) AS m(id)
        UNION ALL SELECT s.id FROM scanned AS s WHERE s.key IS NULL
        UNION ALL SELECT w.id FROM waiting AS w WHERE w.key IS NULL AND w.due
    ) AS c
    ORDER BY c.id
    LIMIT $2
),
locked AS (
    SELECT o.id FROM {table} AS o
    -- IS TRUE: a condition the planner cannot match to a partial index's predicate, so
    -- that it reads these rows by their ids. Estimating few pending rows, it chose to read
    -- every entry of outbox_claim_idx for the destination instead, dead ones included: a
    -- claim grew to 140 ms in two minutes of a held snapshot.
    WHERE o.id = ANY(ARRAY(SELECT id FROM chosen)) AND o.destination = $1
      AND (o.status = 'pending') IS TRUE AND NOT (SELECT serving FROM peers)
    FOR UPDATE SKIP LOCKED
),
{mark_running}
SELECT * FROM claimed
UNION ALL
SELECT -2, NULL, NULL, NULL, c.id::text, NULL, 0, NULL, 0, NULL
FROM chosen AS c
WHERE c.id <= $5::bigint
  AND NOT EXISTS (SELECT 1 FROM {table} AS o
                  WHERE o.id = c.id AND o.destination = $1 AND (o.status = 'pending') IS TRUE)
UNION ALL
SELECT -3, NULL, s.key, NULL, s.id::text, NULL, 0, NULL, 0, NULL
FROM scanned AS s
UNION ALL
SELECT -4, NULL, NULL, NULL, NULL, NULL, 0, NULL, 0, NULL
FROM peers WHERE serving
""".replace("{owner_capable}", _OWNER_CAPABLE).replace("{mark_running}", _mark_running("locked"))

# Keys held up by a failed row: a key's first failed row with later rows of the key pending
# behind it. For a destination with ordering = "key" and poison_policy = "block" those rows
# wait; elsewhere they flow anyway. $1: destinations, or NULL for all.
BLOCKED_KEYS = """
SELECT f.destination, f.key, f.id AS failed_id, f.last_error, count(n.id) AS waiting
FROM {table} AS f
JOIN {table} AS n
  ON n.destination = f.destination AND n.key = f.key AND n.id > f.id AND n.status = 'pending'
WHERE f.status = 'failed' AND f.key IS NOT NULL
  AND ($1::text[] IS NULL OR f.destination = ANY($1::text[]))
  AND NOT EXISTS (SELECT 1 FROM {table} AS e
                  WHERE e.destination = f.destination AND e.key = f.key AND e.id < f.id
                    AND e.status = 'failed')
GROUP BY f.destination, f.key, f.id, f.last_error
ORDER BY f.destination, f.key
"""
