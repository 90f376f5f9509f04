"""Deleting what is no longer needed: purges of delivered, failed and skipped events (never one
a delivery still needs), retention's batches, and the ended deliveries and the message log."""

from __future__ import annotations

# An event (o) whose payload a delivery still needs: one of its deliveries is open (pending or
# running), whether its endpoint is enabled or not. A disabled endpoint keeps its queue: an
# endpoint that answered 410 once (a bad deploy), was disabled after disable_after or by an
# operator gets everything queued for it once it is enabled again, and `replay --endpoint
# --since` finds its backlog's events. Deleting the endpoint cancels its deliveries, and
# lets their events go. One probe of the deliveries' unique index (event_id, endpoint_id).
#
# Written as a scalar subquery, evaluated row by row: a bare EXISTS may be turned into a join,
# and with the endpoint tables analysed while empty (any Kafka-only deployment) the planner
# nested that join under the running rows it believed were one, reading the whole batch once
# per running row (tests/test_batch_plans).
_OPEN_DELIVERY = """(SELECT EXISTS (
          SELECT 1 FROM {deliveries} AS d
          WHERE d.event_id = o.id AND d.status IN ('pending', 'running')))"""

# Purging is two statements in one transaction, for every purge (retention, `outbox-relay
# purge`, the console): one locks a batch of candidates (FOR UPDATE SKIP LOCKED, passing over
# rows a delivery still needs as the statement's snapshot shows them), then DELETE_LOCKED
# deletes those of them no delivery needs, in a snapshot of its own. In one statement a replay
# that committed after the snapshot, adding or reopening a delivery of an event, would go
# unseen, and the event be deleted under it: a replay locks the event first (FOR KEY SHARE),
# so once the candidates are locked no replay of them can begin, and one that committed
# before is seen by the DELETE.
PURGE_DELIVERED = (
    """
SELECT id FROM {table} AS o
WHERE status = 'delivered' AND delivered_at < now() - make_interval(secs => $1)
  AND ($2::text[] IS NULL OR destination = ANY($2::text[]))
  AND NOT """
    + _OPEN_DELIVERY
    + """
ORDER BY delivered_at
LIMIT $3
FOR UPDATE SKIP LOCKED
"""
)

# Failed or skipped rows ($4: which of the two) that ended more than $1 seconds ago, but
# those a delivery still needs (an event fanned out, then failed by the reaper): the first
# statement of a purge, as PURGE_DELIVERED.
PURGE_FINISHED = (
    """
SELECT id FROM {table} AS o
WHERE status IN ('failed', 'skipped') AND status = ANY($4::text[])
  AND coalesce(finished_at, created_at) < now() - make_interval(secs => $1)
  AND ($2::text[] IS NULL OR destination = ANY($2::text[]))
  AND NOT """
    + _OPEN_DELIVERY
    + """
ORDER BY coalesce(finished_at, created_at)
LIMIT $3
FOR UPDATE SKIP LOCKED
"""
)

# The second statement of a purge: of the rows ($1) the first locked, those still of a status
# of $2 and needed by no delivery, seen afresh.
DELETE_LOCKED = (
    """
DELETE FROM {table} AS o
WHERE o.id = ANY($1::bigint[]) AND o.status = ANY($2::text[])
  AND NOT """
    + _OPEN_DELIVERY
    + """
"""
)

# Retention's batch of delivered rows older than $1 seconds, the first statement of its purge
# (then DELETE_LOCKED): it examines at most $2 of them, oldest first, resuming after the last
# row the previous batch of the same run examined ($3 and $4, its delivered_at and id; NULL:
# from the oldest), and locks those no open delivery needs (_OPEN_DELIVERY). An event kept
# for a delivery (its endpoint failing or disabled) is examined once per retention run, not
# once per batch: PURGE_DELIVERED's filter walks every kept event again in each batch.
# Returns the ids locked, how many it examined (fewer than $2: the run is over) and where it
# stopped.
RETENTION_DELIVERED = (
    """
WITH examined AS MATERIALIZED (
    SELECT o.id, o.delivered_at, """
    + _OPEN_DELIVERY
    + """ AS kept
    FROM {table} AS o
    WHERE o.status = 'delivered' AND o.delivered_at < now() - make_interval(secs => $1)
      AND ($3::timestamptz IS NULL
           OR (o.delivered_at >= $3::timestamptz
               AND (o.delivered_at, o.id) > ($3::timestamptz, $4::bigint)))
    ORDER BY o.delivered_at, o.id
    LIMIT $2
),
locked AS (
    SELECT o.id FROM {table} AS o
    WHERE o.id = ANY(ARRAY(SELECT id FROM examined WHERE NOT kept)) AND o.status = 'delivered'
    FOR UPDATE SKIP LOCKED
),
last AS (
    SELECT delivered_at, id FROM examined ORDER BY delivered_at DESC, id DESC LIMIT 1
)
SELECT ARRAY(SELECT id FROM locked) AS ids,
       (SELECT count(*) FROM examined)::int AS examined,
       (SELECT delivered_at FROM last) AS at, (SELECT id FROM last) AS id
"""
)

# Retention of the message log and of ended deliveries, a batch at a time.
PURGE_DELIVERIES = """
WITH doomed AS (
    SELECT id FROM {deliveries}
    WHERE status IN ('delivered', 'failed', 'cancelled')
      AND finished_at < now() - make_interval(secs => $1)
    ORDER BY finished_at
    LIMIT $2
    -- A delivery a replay holds is left for the next run, never waited for.
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {deliveries} AS d USING doomed
-- Re-checked on the row itself: a delivery replayed since the snapshot is pending again.
WHERE d.id = doomed.id AND d.status IN ('delivered', 'failed', 'cancelled')
"""

PURGE_ATTEMPTS = """
WITH doomed AS (
    SELECT id FROM {attempts}
    WHERE at < now() - make_interval(secs => $1)
    ORDER BY at
    LIMIT $2
)
DELETE FROM {attempts} AS a USING doomed WHERE a.id = doomed.id
"""
