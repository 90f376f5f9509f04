-- Endpoints (kind = "endpoints"): the fan-out of events to one delivery per (event, endpoint),
-- then the deliveries' claim, outcomes, heartbeat, release and reap, and the endpoints'
-- health. relay/db/queries/deliveries.py names them, relay/sinks/endpoints/store.py runs them;
-- they are asyncpg's (:name binds handed out as $1, $2, … in their params' order:
-- outbox/sql.py).
--
-- Written alike with other files' statements (tests/test_sql_files.py checks it): fan_out's
-- SET list is outcomes.sql's record_delivered's, and its fence of held rows theirs;
-- delivery_heartbeat and delivery_release are leases.sql's heartbeat and release on the
-- deliveries; delivery_reap's limits and what it sets on a reaped row are leases.sql's reap's.

-- name: fan_out_lock
-- params: serial
-- The in-flight lock (:serial, 2), taken alone in a fan-out's transaction before a FAN_OUT
-- that sends deliveries at once (:room_ids), so that FAN_OUT's snapshot is taken once it is
-- held: it then sees every delivery claim that committed before (a claim takes it shared:
-- delivery_claim_lock), and no claim that began before it commits sees a snapshot without
-- its deliveries in flight. Either way each counts the other's against max_concurrency.
-- Another key than the fan-outs' own (:serial, 1), which replays take too, and taken after
-- it (the CTE is read first): a replay in an application's open transaction holds up
-- fan-outs, never claims (a fan-out holding this lock while it waited for that one would).
-- The statements after it write leases from statement_timestamp(), not now(): now() is the
-- transaction's start, before the wait, and a wait longer than the lease would write them
-- expired.
WITH fan_outs AS MATERIALIZED (SELECT pg_advisory_xact_lock(:serial::int, 1))
SELECT pg_advisory_xact_lock(:serial::int, 2) FROM fan_outs

-- name: delivery_claim_lock
-- params: serial
-- The delivery claim's share of the in-flight lock (see fan_out_lock), taken alone in the
-- claim's transaction before DELIVERY_CLAIM: claims run beside each other, never beside a
-- fan-out that sends deliveries at once.
SELECT pg_advisory_xact_lock_shared(:serial::int, 2)

-- name: fan_out
-- params: ids, tokens, relay, no_match, serial, room_ids, room_n, room_floors, lease
-- Fan-out of a claimed batch of events and their outcome, in one statement: one delivery per
-- matching endpoint (enabled, of the event's destination, of its tenant or of every tenant,
-- taking its type or every type), and each event recorded as delivered (with :no_match as
-- last_error when no endpoint matched), for the events this relay still holds under their
-- claim (:ids, :tokens their fencing tokens, :relay this relay), as record_delivered fences
-- them. A relay that dies at any point has either fanned a batch out and recorded it, or done
-- neither: an event is never fanned out twice, even when retention has deleted the deliveries
-- of a first fan-out (the UNIQUE pair alone made a second fan-out harmless only while they
-- were kept). Returns each event recorded with how many endpoints it matched; an event missing
-- from the answer was no longer this relay's (its lease ran out): nothing was fanned out for
-- it.
--
-- Fan-outs write their deliveries one at a time (:serial, the deliveries table's key: see
-- relay/db/queries/deliveries.py): each takes a transaction lock before it draws its first id,
-- and holds it to its commit, so fan-outs commit in the order of their ids. A claim that sees
-- a fresh delivery then sees every fresh delivery of a lower id that will ever be: the floors
-- of the claim's fresh lane (delivery_claim) are never passed by a fan-out committing late.
-- The lock is a gate of both the events' UPDATE and the INSERT (a one-time filter, read before
-- either reads a row), so no fan-out waits for it holding an event's row lock.

WITH serial AS MATERIALIZED (
    SELECT 1 AS one FROM (SELECT pg_advisory_xact_lock(:serial::int, 1)) AS l
),
matched AS (
    SELECT o.id AS event_id, e.id AS endpoint_id, o.destination, o.tenant
    FROM {table} AS o
    CROSS JOIN LATERAL (
        SELECT e.id FROM {endpoints} AS e
        WHERE e.enabled AND e.destination = o.destination AND e.tenant = o.tenant
          AND (cardinality(e.event_types) = 0 OR o.event_type = ANY(e.event_types))
        UNION ALL
        SELECT e.id FROM {endpoints} AS e
        WHERE e.enabled AND e.destination = o.destination AND e.tenant IS NULL
          AND (cardinality(e.event_types) = 0 OR o.event_type = ANY(e.event_types))
    ) AS e
    WHERE o.id = ANY(:ids::bigint[]) AND (SELECT one FROM serial) = 1
),
counted AS (
    SELECT event_id, count(*)::int AS n FROM matched GROUP BY event_id
),
recorded AS (
    UPDATE {table} AS o
    SET status = 'delivered',
        attempts = o.attempts + 1,
        delivered_at = now(),
        finished_at = now(),
        last_error = CASE WHEN c.n IS NULL THEN :no_match::text ELSE o.last_error END,
        claims = u.token,  -- unchanged; see record
        locked_by = NULL,
        locked_until = NULL
    FROM unnest(:ids::bigint[], :tokens::int[]) AS u(id, token)
    LEFT JOIN counted AS c ON c.event_id = u.id
    WHERE o.id = u.id AND CASE WHEN o.claims = u.token AND o.status = 'running' AND o.locked_by = :relay THEN true END
      AND (SELECT one FROM serial) = 1
    RETURNING o.id, coalesce(c.n, 0) AS endpoints
),
asked AS MATERIALIZED (
    -- The endpoints asked for (:room_ids, each taking its first :room_n of this fan-out, its
    -- floor :room_floors) that this fan-out writes deliveries of, enabled and with no rate
    -- limit. :room_ids holds every fast endpoint the relay knows (10,000 registered in the
    -- scale bench); the probes below are run for these few only, once each (put in one
    -- query, the planner ran them per endpoint at every step of a loop over the endpoints
    -- table: 95,000 probes for 300 endpoints asked; tests/test_fan_out_plan.py).
    SELECT g.endpoint_id, g.n, g.floor
    FROM unnest(:room_ids::bigint[], :room_n::int[], :room_floors::bigint[]) AS g(endpoint_id, n, floor)
    JOIN (SELECT DISTINCT endpoint_id FROM matched) AS mine ON mine.endpoint_id = g.endpoint_id
    JOIN {endpoints} AS e ON e.id = g.endpoint_id
    WHERE e.enabled AND e.rate_limit IS NULL AND (SELECT one FROM serial) = 1
),
room AS MATERIALIZED (
    -- The endpoints whose deliveries this relay sends at once, where none has to go first
    -- and no limit is passed: no other relay holds a delivery of it under a live lease
    -- (counted as the claim counts them; its room is this relay's alone), and none of its
    -- deliveries is pending and due, in the fresh lane from its floor (as the claim's) or in
    -- the waiting lane: an endpoint with a backlog is served oldest first, by the claim.
    -- Each check is a probe of one endpoint's entries (OFFSET 0 keeps it a subplan run per
    -- endpoint with the endpoint's id in its index condition): flattened into an anti join,
    -- statistics taken with the lanes empty let the planner read the fresh lane's index whole
    -- once per endpoint, a slow endpoint's backlog 8 times a fan-out (tests/test_fan_out_plan.py).
    SELECT g.endpoint_id, g.n
    FROM asked AS g
    WHERE NOT EXISTS (SELECT 1 FROM {deliveries} AS r
                      WHERE r.endpoint_id = g.endpoint_id AND r.status = 'running'
                        AND r.locked_until > statement_timestamp() AND r.locked_by < :relay OFFSET 0)
      AND NOT EXISTS (SELECT 1 FROM {deliveries} AS r
                      WHERE r.endpoint_id = g.endpoint_id AND r.status = 'running'
                        AND r.locked_until > statement_timestamp() AND r.locked_by > :relay OFFSET 0)
      AND NOT EXISTS (SELECT 1 FROM {deliveries} AS d
                      WHERE d.endpoint_id = g.endpoint_id
                        AND d.status = 'pending' AND d.claims = 0 AND NOT d.replay AND d.run_after <= d.created_at
                        AND d.id > g.floor AND d.run_after <= statement_timestamp() OFFSET 0)
      AND NOT EXISTS (SELECT 1 FROM {deliveries} AS d
                      WHERE d.endpoint_id = g.endpoint_id
                        AND d.status = 'pending' AND (d.claims <> 0 OR d.replay OR d.run_after > d.created_at)
                        AND d.run_after <= statement_timestamp() OFFSET 0)
),
ranked AS (
    SELECT m.event_id, m.endpoint_id, m.destination,
           row_number() OVER (PARTITION BY m.endpoint_id ORDER BY m.event_id) <= coalesce(g.n, 0) AS sent
    FROM matched AS m JOIN recorded AS r ON r.id = m.event_id
    LEFT JOIN room AS g ON g.endpoint_id = m.endpoint_id
),
added AS (
    -- Those sent at once are written claimed by this relay (running under its lease, its
    -- first claim): they never wait in the claim's lanes.
    INSERT INTO {deliveries} (event_id, endpoint_id, destination, status, locked_by, locked_until, claims)
    SELECT k.event_id, k.endpoint_id, k.destination,
           CASE WHEN k.sent THEN 'running' ELSE 'pending' END,
           CASE WHEN k.sent THEN :relay END,
           CASE WHEN k.sent THEN statement_timestamp() + make_interval(secs => :lease) END,
           CASE WHEN k.sent THEN 1 ELSE 0 END
    FROM ranked AS k
    ORDER BY k.event_id, k.endpoint_id
    ON CONFLICT (event_id, endpoint_id) DO NOTHING
    RETURNING id, event_id, endpoint_id, status
)
SELECT id, endpoints, (SELECT count(*) FROM added)::int AS added,
       NULL::bigint AS event_id, NULL::bigint AS endpoint_id, NULL::text AS url,
       NULL::text AS secret, NULL::text AS previous_secret, NULL::text AS tenant,
       NULL::text[] AS event_types, NULL::text AS event_tenant
FROM recorded
UNION ALL
-- Then the deliveries sent at once (endpoints = -1), with what sending needs of their
-- endpoint (the event is the caller's), all of this statement's snapshot.
SELECT a.id, -1, 0, a.event_id, a.endpoint_id, e.url, e.secret,
       CASE WHEN e.previous_secret_until > statement_timestamp() THEN e.previous_secret END,
       e.tenant, e.event_types, m.tenant
FROM added AS a
JOIN {endpoints} AS e ON e.id = a.endpoint_id
JOIN matched AS m ON m.event_id = a.event_id AND m.endpoint_id = a.endpoint_id
WHERE a.status = 'running'

-- name: delivery_claim
-- params: destinations, max_concurrency, batch, relay, caps, scan, cursor, lease, skip_tenants, start_caps, ahead, uncapped, ahead_room, sweep, floors, seen, chunk, held
-- The delivery claim. It walks the endpoints that have pending deliveries, in id order from
-- the cursor :cursor (NULL: from the first), at most :scan of them. From each enabled endpoint
-- of this relay's destinations (:destinations, with each one's max_concurrency in
-- :max_concurrency) but those of the tenants it skips (:skip_tenants: at their fair share, see
-- relay/sinks/endpoints/fairness.py), it takes due deliveries of the endpoint's own
-- destination, oldest first: as many as the endpoint has room for, fewer for a rate-limited
-- one. Its room is its max_concurrency, or the cap this relay gives it (:caps, a JSON object of
-- endpoint id to cap: 0 for one it skips, circuit open, answered 410 or at its fair share; a
-- slow endpoint's slow_concurrency; one this relay knows nothing of starts at its
-- destination's slow_concurrency, :start_caps), less its deliveries in flight claimed by ANY
-- relay under a live lease (this relay's in :held, a JSON object of endpoint id to how many
-- it holds; the others' read from outbox_deliveries_in_flight_idx from now() on: under a held
-- snapshot, their lease's worth of dead versions, not every one since), so that
-- max_concurrency holds across relays; a rate-limited endpoint's is also at most its limit less its attempts
-- in the last second. An endpoint known to be fast (its cap :uncapped or more), not
-- rate-limited, with no delivery in flight under another relay's live lease, is claimed ahead:
-- :ahead times its room, so that its next requests wait in this relay's request slots (which
-- hold it to max_concurrency) rather than for a claim each time one ends; another relay then
-- sees those rows running and takes none of it, and a slow, new or rate-limited endpoint never
-- is. Rows claimed ahead are kept only where none of the endpoint's picked rows was skipped as
-- locked (or no longer pending): such a row is another relay's claim in progress, not yet seen
-- running, whose rows would come on top of this claim's. A dead endpoint's backlog is never
-- scanned past: the claim reads one endpoint's due rows at a time. At most :batch rows in all,
-- each endpoint's room before any row ahead (a small batch is shared, not given whole to the
-- first endpoint walked), marked running under this relay's lease (:relay, :lease seconds).
-- The rows come with what sending needs: the event (NULL if it was deleted), with its tenant
-- and type, and the endpoint's URL, secrets, tenant and event types, all of one snapshot, so
-- that the relay checks the endpoint still takes the event before it sends it to that URL.
--
-- Two lanes (migration 0018), so that a held snapshot (a pg_dump, a report, an idle
-- transaction), which keeps the dead pending version of every delivery claimed since, costs
-- the claim only those claimed since its relay last looked. Fresh deliveries (never claimed,
-- due when written, not replays: nearly all of them) are read in id order from each endpoint's
-- floor: :floors, a JSON object of endpoint id to floor kept by this relay, below which the
-- endpoint has no fresh delivery pending. Fresh deliveries of endpoints it keeps no floor for
-- are above :seen: the claim reads those written since (of the next :chunk ids, from the
-- primary key) and gives their endpoints floors. Deliveries due again (retried, reaped,
-- released, replayed, or written with a later run_after) are read in run_after order from the
-- waiting lane, whose endpoints the walk finds with a loose index scan. Fan-outs commit in the
-- order of their ids (fan_out), so a floor or :seen is never passed by one committing late.
--
-- With :sweep, pending deliveries of an endpoint met on the walk that no longer exists
-- (deleted while its events were being fanned out) or that now belongs to another destination
-- are cancelled, saying so (they are never claimed: the claim reads enabled endpoints of their
-- own destination only; the relay sweeps every few seconds). The last rows carry what the
-- relay keeps: rows of id -2 an endpoint's next floor (in endpoint_id; its floor in event_id,
-- NULL: none of its fresh deliveries is pending), for every endpoint walked and every one
-- found above :seen; the last row (id -1) the cursor for the next claim in endpoint_id (the
-- last endpoint examined when the scan limit cut the walk short, the last one claimed from
-- when the batch filled up, NULL when the walk reached the end), the deliveries cancelled in
-- event_id, the next :seen and the highest id (as text in content_type, "seen:top"), the ids'
-- epoch (in headers: the deliveries' id sequence's file, new at a TRUNCATE … RESTART IDENTITY
-- or a restore, and the server's start, new at a failover that may hand ids out again), and
-- in found whether this claim swept (with :sweep, only when it picked less than :batch: a
-- full batch stops the walk early).

WITH RECURSIVE waits AS (
    -- The endpoints with deliveries due again, from the cursor: a loose scan of the waiting
    -- lane, whose dead entries are only those of deliveries retried since the snapshot.
    (SELECT d.endpoint_id, 1 AS n FROM {deliveries} AS d
     WHERE d.status = 'pending' AND (d.claims <> 0 OR d.replay OR d.run_after > d.created_at)
       AND d.endpoint_id > coalesce(:cursor::bigint, -1)
     ORDER BY d.endpoint_id, d.run_after, d.id
     LIMIT 1)
    UNION ALL
    SELECT nxt.endpoint_id, waits.n + 1
    FROM waits CROSS JOIN LATERAL (
        SELECT d.endpoint_id FROM {deliveries} AS d
        WHERE d.status = 'pending' AND (d.claims <> 0 OR d.replay OR d.run_after > d.created_at)
          AND d.endpoint_id > waits.endpoint_id
        ORDER BY d.endpoint_id, d.run_after, d.id
        LIMIT 1
    ) AS nxt
    WHERE waits.n < :scan
),
past AS MATERIALIZED (
    -- Where the read of fresh deliveries past :seen starts: before the first id there is past
    -- it, so that a gap in the ids (a sequence set ahead, a table emptied by retention) is
    -- stepped over at once, not a chunk a claim.
    SELECT coalesce((SELECT min(d.id) FROM {deliveries} AS d WHERE d.id > :seen::bigint),
                    :seen::bigint + 1) - 1 AS start
),
found AS MATERIALIZED (
    -- Fresh deliveries written since :seen, of the next :chunk ids at most: a claim after a
    -- fan-out of a large backlog reads a chunk of it, not all of it (the planner reads such
    -- a range whole, then sorts it). IS TRUE keeps it on the primary key: by the fresh
    -- lane's index it would read every endpoint's range whole.
    SELECT d.id, d.endpoint_id FROM {deliveries} AS d
    WHERE d.id > (SELECT start FROM past) AND d.id <= (SELECT start FROM past) + :chunk
      AND (d.status = 'pending' AND d.claims = 0 AND NOT d.replay AND d.run_after <= d.created_at) IS TRUE
),
seen AS MATERIALIZED (
    -- Up to where the next claim's read of fresh deliveries starts: the chunk's end, or the
    -- highest id there is (every delivery up to it is seen: fan_out). Below the highest id,
    -- the relay claims again at once.
    SELECT least((SELECT start FROM past) + :chunk, t.top) AS seen, t.top
    FROM (SELECT coalesce((SELECT max(id) FROM {deliveries}), 0) AS top) AS t
),
floors AS MATERIALIZED (
    -- Each endpoint's floor: the one kept, or below the first found, or (an endpoint with
    -- deliveries due again only) the next :seen.
    SELECT f.endpoint_id, min(f.floor) AS floor
    FROM (
        SELECT k.key::bigint AS endpoint_id, k.value::bigint AS floor
        FROM jsonb_each_text(:floors::jsonb) AS k
        UNION ALL
        SELECT endpoint_id, min(id) - 1 FROM found GROUP BY endpoint_id
        UNION ALL
        SELECT endpoint_id, (SELECT seen FROM seen) FROM waits
    ) AS f
    GROUP BY f.endpoint_id
),
eps AS MATERIALIZED (
    SELECT f.endpoint_id, f.floor, row_number() OVER (ORDER BY f.endpoint_id) AS n
    FROM floors AS f
    WHERE f.endpoint_id > coalesce(:cursor::bigint, -1)
    ORDER BY f.endpoint_id
    LIMIT :scan
),
conc AS (
    SELECT * FROM unnest(:destinations::text[], :max_concurrency::int[], :start_caps::int[])
        AS c(destination, max_concurrency, start_cap)
),
ends AS (
    -- The endpoints walked, each with its room (its cap less its deliveries in flight), how
    -- many of its rows this claim may take (limit_ - running: more than its room when it is
    -- claimed ahead) and how many within its room (take). Read in walk order, as far as the
    -- claim needs.
    SELECT e.*, eps.n, eps.floor
    FROM eps
    -- OFFSET 0 keeps the walk driving: one probe per endpoint found, never a scan of all
    -- the endpoints registered.
    CROSS JOIN LATERAL (
        SELECT e.id, e.destination, e.rate_limit,
               least(c.max_concurrency, k.cap)
                   * CASE WHEN k.cap >= :uncapped AND e.rate_limit IS NULL AND r.others = 0
                          THEN greatest(:ahead, 1) ELSE 1 END AS limit_,
               greatest(0, least(c.max_concurrency, k.cap) - r.running) AS room,
               r.running
        FROM {endpoints} AS e
        JOIN conc AS c ON c.destination = e.destination
        -- The caps are a JSON object, a lookup by key in it a binary search: an array of
        -- thousands of endpoints would be scanned for each one walked.
        CROSS JOIN LATERAL (
            SELECT coalesce((:caps::jsonb ->> e.id::text)::int, c.start_cap) AS cap
        ) AS k
        -- Leases expired count no more: a dead relay's rows wait for the reaper, and must
        -- not hold the endpoint meanwhile. This relay's own come from :held (what it holds
        -- of each endpoint); the others' from the in-flight index, by two ranges of its
        -- locked_by key around this relay's, so that this relay's entries (live, or the
        -- dead version of each delivery it recorded under a held snapshot) are stepped
        -- over in the index, never read in the table.
        CROSS JOIN LATERAL (
            SELECT (SELECT count(*) FROM {deliveries} AS r
                    WHERE r.endpoint_id = e.id AND r.status = 'running' AND r.locked_until > statement_timestamp()
                      AND r.locked_by < :relay)
                   + (SELECT count(*) FROM {deliveries} AS r
                      WHERE r.endpoint_id = e.id AND r.status = 'running' AND r.locked_until > statement_timestamp()
                        AND r.locked_by > :relay) AS others
            -- OFFSET 0: counted once, not again for each column below that reads it.
            OFFSET 0
        ) AS o
        CROSS JOIN LATERAL (
            SELECT coalesce((:held::jsonb ->> e.id::text)::int, 0) + o.others AS running,
                   o.others
        ) AS r
        WHERE e.id = eps.endpoint_id AND e.enabled
          AND (e.tenant IS NULL OR NOT (e.tenant = ANY(:skip_tenants::text[])))
        OFFSET 0
    ) AS e
),
within AS (
    -- Each endpoint's room, in walk order: the LIMIT ends the walk's reads once the batch
    -- is full. Each lane gives its oldest, and the oldest of both are taken.
    SELECT d.id, ends.id AS endpoint_id
    FROM ends
    CROSS JOIN LATERAL (
        SELECT CASE WHEN ends.rate_limit IS NULL THEN ends.room
                    ELSE greatest(0, least(ends.limit_, ends.rate_limit
                        - (SELECT count(*) FROM {attempts} AS a
                           WHERE a.endpoint_id = ends.id
                             AND a.at > statement_timestamp() - interval '1 second'))
                         - ends.running)
               END AS take
    ) AS t
    CROSS JOIN LATERAL (
        SELECT c.id FROM (
            (SELECT d.id, d.run_after FROM {deliveries} AS d
             WHERE d.endpoint_id = ends.id AND d.destination = ends.destination
               AND d.status = 'pending' AND d.claims = 0 AND NOT d.replay AND d.run_after <= d.created_at
               AND d.id > ends.floor AND d.run_after <= statement_timestamp()
             ORDER BY d.id
             LIMIT t.take)
            UNION ALL
            (SELECT d.id, d.run_after FROM {deliveries} AS d
             WHERE d.endpoint_id = ends.id AND d.destination = ends.destination
               AND d.status = 'pending' AND (d.claims <> 0 OR d.replay OR d.run_after > d.created_at)
               AND d.run_after <= statement_timestamp()
             ORDER BY d.run_after, d.id
             LIMIT t.take)
        ) AS c
        ORDER BY c.run_after, c.id
        LIMIT t.take
    ) AS d
    LIMIT :batch
),
ahead AS (
    -- Then the rows claimed ahead (the next ones of each endpoint past its room), only if
    -- every endpoint's room left the batch room to spare: a small batch is shared, not given
    -- whole to the first endpoint walked.
    SELECT d.id, ends.id AS endpoint_id
    FROM ends
    CROSS JOIN LATERAL (
        SELECT c.id FROM (
            (SELECT d.id, d.run_after FROM {deliveries} AS d
             WHERE d.endpoint_id = ends.id AND d.destination = ends.destination
               AND d.status = 'pending' AND d.claims = 0 AND NOT d.replay AND d.run_after <= d.created_at
               AND d.id > ends.floor AND d.run_after <= statement_timestamp()
             ORDER BY d.id
             LIMIT ends.limit_ - ends.running)
            UNION ALL
            (SELECT d.id, d.run_after FROM {deliveries} AS d
             WHERE d.endpoint_id = ends.id AND d.destination = ends.destination
               AND d.status = 'pending' AND (d.claims <> 0 OR d.replay OR d.run_after > d.created_at)
               AND d.run_after <= statement_timestamp()
             ORDER BY d.run_after, d.id
             LIMIT ends.limit_ - ends.running)
        ) AS c
        ORDER BY c.run_after, c.id
        OFFSET ends.room
        LIMIT ends.limit_ - ends.running - ends.room
    ) AS d
    WHERE ends.rate_limit IS NULL AND ends.limit_ - ends.running > ends.room
      AND (SELECT count(*) FROM within) < :batch
    -- Rows ahead only up to :ahead_room rows claimed in all: rows queued behind request
    -- slots count in the relay's max_in_flight, and may take only the free half of it.
    LIMIT greatest(0, least(:batch, :ahead_room) - (SELECT count(*) FROM within))
),
picked AS (
    SELECT id, endpoint_id, false AS ahead FROM within
    UNION ALL
    SELECT id, endpoint_id, true FROM ahead
),
stale AS MATERIALIZED (
    -- Endpoints met on the walk that are gone, or whose first pending delivery of either
    -- lane is of another destination than theirs (moved with SQL): a probe of each lane.
    -- Only when the claim did not fill its batch: the walk was then read to its end anyway,
    -- where a full batch stops it early (read here, every claim would walk :scan endpoints).
    -- MATERIALIZED: folded into strays, the planner read every walked endpoint's lanes whole
    -- before it looked whether the endpoint was stale (under a held snapshot, the dead entry
    -- of every delivery claimed since: tests/test_held_snapshot_deliveries.py).
    SELECT eps.endpoint_id, x.destination
    FROM eps LEFT JOIN {endpoints} AS x ON x.id = eps.endpoint_id
    WHERE :sweep AND (SELECT count(*) FROM picked) < :batch
      AND (x.id IS NULL
           OR (x.destination <> ANY(ARRAY[
                  (SELECT d.destination FROM {deliveries} AS d
                   WHERE d.endpoint_id = eps.endpoint_id
                     AND d.status = 'pending' AND d.claims = 0 AND NOT d.replay AND d.run_after <= d.created_at
                     AND d.id > eps.floor
                   ORDER BY d.id LIMIT 1),
                  (SELECT d.destination FROM {deliveries} AS d
                   WHERE d.endpoint_id = eps.endpoint_id
                     AND d.status = 'pending' AND (d.claims <> 0 OR d.replay OR d.run_after > d.created_at)
                   ORDER BY d.run_after, d.id LIMIT 1)])) IS TRUE)
),
strays AS (
    -- Each stale endpoint's pending deliveries of another destination than its own (all of
    -- them, if it is gone), read from both lanes (which together hold every pending delivery)
    -- by the endpoint: without a stale endpoint nothing is read.
    SELECT l.id, s.destination
    FROM stale AS s
    CROSS JOIN LATERAL (
        SELECT f.id, f.destination FROM {deliveries} AS f
        WHERE f.endpoint_id = s.endpoint_id
          AND f.status = 'pending' AND f.claims = 0 AND NOT f.replay AND f.run_after <= f.created_at
        UNION ALL
        SELECT w.id, w.destination FROM {deliveries} AS w
        WHERE w.endpoint_id = s.endpoint_id
          AND w.status = 'pending' AND (w.claims <> 0 OR w.replay OR w.run_after > w.created_at)
    ) AS l
    WHERE s.destination IS NULL OR s.destination <> l.destination
),
orphans AS (
    -- Skipped if locked (a replay of its event in an application's open transaction): the
    -- claim holds the in-flight lock, and a wait here would hold up every claim and fan-out.
    -- The next sweep takes it. Found by id (the primary key), as locked below.
    SELECT d.id FROM {deliveries} AS d
    WHERE d.id = ANY(ARRAY(SELECT id FROM strays)) AND (d.status = 'pending') IS TRUE
    FOR UPDATE SKIP LOCKED
),
orphaned AS (
    UPDATE {deliveries} AS d
    SET status = 'cancelled', finished_at = statement_timestamp(), locked_by = NULL, locked_until = NULL,
        last_error = CASE WHEN s.destination IS NULL
                          THEN 'endpoint ' || d.endpoint_id || ' was deleted'
                          ELSE 'endpoint ' || d.endpoint_id || ' moved to destination '
                               || quote_literal(s.destination) END
    FROM strays AS s
    WHERE d.id = ANY(ARRAY(SELECT id FROM orphans)) AND d.id = s.id AND d.status = 'pending'
    RETURNING d.id
),
locked AS (
    -- Another relay may have claimed a row since this statement's snapshot: the lock
    -- re-reads it and the status check drops it. Written so that the planner finds the rows
    -- by id (the primary key) rather than through a partial index, which it would otherwise
    -- read whole for the ids.
    SELECT d.id FROM {deliveries} AS d
    WHERE d.id = ANY(ARRAY(SELECT id FROM picked)) AND (d.status = 'pending') IS TRUE
    ORDER BY d.id
    FOR UPDATE SKIP LOCKED
),
kept AS (
    -- A row ahead goes only with an endpoint none of whose picked rows another claim holds.
    SELECT p.id FROM picked AS p
    WHERE p.id = ANY(ARRAY(SELECT id FROM locked))
      AND (NOT p.ahead OR NOT EXISTS (
          SELECT 1 FROM picked AS q
          WHERE q.endpoint_id = p.endpoint_id AND q.id <> ALL(ARRAY(SELECT id FROM locked))))
),
claimed AS (
    UPDATE {deliveries} AS d
    SET status = 'running', locked_by = :relay, locked_until = statement_timestamp() + make_interval(secs => :lease),
        claims = d.claims + 1
    WHERE d.id = ANY(ARRAY(SELECT id FROM kept))
    RETURNING d.id, d.event_id, d.endpoint_id, d.destination, d.attempts, d.claims, d.replay
),
next_cursor AS MATERIALIZED (
    SELECT CASE
               WHEN (SELECT count(*) FROM picked) >= :batch THEN (SELECT max(endpoint_id) FROM picked)
               WHEN (SELECT count(*) FROM eps) >= :scan
                   THEN (SELECT endpoint_id FROM eps ORDER BY n DESC LIMIT 1)
           END AS cursor
),
next_floors AS (
    -- Each endpoint walked (up to the next cursor), below its first fresh delivery this claim
    -- did not take: those taken are passed, those another claim is taking (seen pending) are
    -- not. Then those found above :seen and not walked, below the first found.
    SELECT eps.endpoint_id,
           (SELECT min(d.id) - 1 FROM {deliveries} AS d
            WHERE d.endpoint_id = eps.endpoint_id
              AND d.status = 'pending' AND d.claims = 0 AND NOT d.replay AND d.run_after <= d.created_at
              AND d.id > eps.floor AND d.id <> ALL(ARRAY(SELECT id FROM kept))) AS floor
    FROM eps
    WHERE eps.endpoint_id <= coalesce((SELECT cursor FROM next_cursor), eps.endpoint_id)
    UNION ALL
    SELECT f.endpoint_id, f.floor FROM floors AS f
    WHERE f.endpoint_id IN (SELECT endpoint_id FROM found)
      AND NOT (f.endpoint_id IN (SELECT endpoint_id FROM eps)
               AND f.endpoint_id <= coalesce((SELECT cursor FROM next_cursor), f.endpoint_id))
)
SELECT c.id, c.event_id, c.endpoint_id, c.destination, c.attempts, c.claims, c.replay,
       o.id IS NOT NULL AS found, o.payload, o.content_type, o.headers::text AS headers,
       extract(epoch FROM o.created_at)::float8 AS created_at,
       e.url, e.secret, CASE WHEN e.previous_secret_until > statement_timestamp() THEN e.previous_secret END
           AS previous_secret, e.rate_limit, o.event_type, e.tenant, e.event_types,
       o.tenant AS event_tenant
FROM claimed AS c
JOIN {endpoints} AS e ON e.id = c.endpoint_id
LEFT JOIN {table} AS o ON o.id = c.event_id
UNION ALL
SELECT -2, n.floor, n.endpoint_id, NULL, 0, 0, false, false,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM next_floors AS n
UNION ALL
SELECT -1, (SELECT count(*) FROM orphaned), (SELECT cursor FROM next_cursor),
       NULL, 0, 0, false,
       -- Whether the sweep ran: the check reads the walk only when the claim picked less
       -- than its batch (a claim may pick a full batch and still claim less: rows locked).
       :sweep AND (SELECT count(*) FROM picked) < :batch,
       NULL, (SELECT seen || ':' || top FROM seen), (SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{deliveries})::text, 'id')::regclass)::text
        || '@' || extract(epoch FROM pg_postmaster_start_time())::text), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL

-- name: delivery_look
-- params: seen, chunk
-- A look for fresh deliveries pending that no floor of this relay's tells of, written by
-- another relay's fan-out (relay/sinks/endpoints/base.py, LOOK_EVERY): delivery_claim's read
-- of those written since :seen (its past, found and seen, written alike), without its walk.
-- Returns the endpoints of those found and, in the last row (endpoint -1), the next :seen with
-- the highest id ("seen:top") and the ids' epoch, as delivery_claim's last row: a look that
-- found none moves :seen on, as the claim would. It costs a few index probes to plan and run
-- where the claim took 5 ms to plan, and finished deliveries look every LOOK_EVERY (in `bench
-- fanout`, 10 claims a second, nearly all finding nothing, were a sixth of PostgreSQL's time).

WITH past AS MATERIALIZED (
    -- Where the read of fresh deliveries past :seen starts: before the first id there is past
    -- it, so that a gap in the ids (a sequence set ahead, a table emptied by retention) is
    -- stepped over at once, not a chunk a claim.
    SELECT coalesce((SELECT min(d.id) FROM {deliveries} AS d WHERE d.id > :seen::bigint),
                    :seen::bigint + 1) - 1 AS start
),
found AS MATERIALIZED (
    -- Fresh deliveries written since :seen, of the next :chunk ids at most: a claim after a
    -- fan-out of a large backlog reads a chunk of it, not all of it (the planner reads such
    -- a range whole, then sorts it). IS TRUE keeps it on the primary key: by the fresh
    -- lane's index it would read every endpoint's range whole.
    SELECT d.id, d.endpoint_id FROM {deliveries} AS d
    WHERE d.id > (SELECT start FROM past) AND d.id <= (SELECT start FROM past) + :chunk
      AND (d.status = 'pending' AND d.claims = 0 AND NOT d.replay AND d.run_after <= d.created_at) IS TRUE
),
seen AS MATERIALIZED (
    -- Up to where the next claim's read of fresh deliveries starts: the chunk's end, or the
    -- highest id there is (every delivery up to it is seen: fan_out). Below the highest id,
    -- the relay claims again at once.
    SELECT least((SELECT start FROM past) + :chunk, t.top) AS seen, t.top
    FROM (SELECT coalesce((SELECT max(id) FROM {deliveries}), 0) AS top) AS t
)
SELECT DISTINCT f.endpoint_id, NULL::text AS seen, NULL::text AS epoch FROM found AS f
UNION ALL
SELECT -1, (SELECT seen || ':' || top FROM seen), (SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{deliveries})::text, 'id')::regclass)::text
        || '@' || extract(epoch FROM pg_postmaster_start_time())::text)

-- name: delivery_floors
-- Every endpoint's first fresh delivery still pending (a loose scan of the fresh lane), and the
-- highest id there is with the ids' epoch (id -1; see delivery_claim), read in one snapshot: the floors and :seen a relay's delivery
-- claims start from, and check now and then (a delivery written by hand in a transaction
-- that committed late, ids handed out again). Under a held snapshot it reads every dead entry
-- of the lane: off the claim's path, once at a start and every few minutes.

WITH RECURSIVE firsts AS (
    (SELECT d.endpoint_id, d.id FROM {deliveries} AS d
     WHERE d.status = 'pending' AND d.claims = 0 AND NOT d.replay AND d.run_after <= d.created_at
     ORDER BY d.endpoint_id, d.id
     LIMIT 1)
    UNION ALL
    SELECT nxt.endpoint_id, nxt.id
    FROM firsts CROSS JOIN LATERAL (
        SELECT d.endpoint_id, d.id FROM {deliveries} AS d
        WHERE d.status = 'pending' AND d.claims = 0 AND NOT d.replay AND d.run_after <= d.created_at
          AND d.endpoint_id > firsts.endpoint_id
        ORDER BY d.endpoint_id, d.id
        LIMIT 1
    ) AS nxt
)
SELECT endpoint_id, id, NULL FROM firsts
UNION ALL
SELECT -1, coalesce((SELECT max(id) FROM {deliveries}), 0), (SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{deliveries})::text, 'id')::regclass)::text
        || '@' || extract(epoch FROM pg_postmaster_start_time())::text)

-- name: delivery_record
-- params: ids, tokens, statuses, counted, delays, errors, http_statuses, event_ids, endpoint_ids, durations_ms, responses, replays, relay
-- The outcomes of deliveries, in one statement: each delivery still held under its claim's
-- token (:tokens) is recorded, as outcomes.sql's record does for events, and every attempt made
-- (:counted = 1) is logged, whether or not its delivery was still held: the request was sent. A
-- try that sent nothing (:counted = 2: the relay could not open the endpoint's secret) is
-- logged too, but not counted among the delivery's attempts. A pending outcome with a negative
-- delay (:delays) keeps its run_after: a delivery put back unattempted keeps its place in its
-- endpoint's queue. Returns the (id, token) pairs recorded.

WITH u AS (
    SELECT * FROM unnest(:ids::bigint[], :tokens::int[], :statuses::text[], :counted::int[], :delays::float8[],
                         :errors::text[], :http_statuses::int[], :event_ids::bigint[], :endpoint_ids::bigint[], :durations_ms::float8[],
                         :responses::text[], :replays::bool[])
         AS u(id, token, status, counted, delay, error, http_status, event_id, endpoint_id,
              duration_ms, response, replay)
),
done AS (
    UPDATE {deliveries} AS d
    SET status = u.status,
        attempts = d.attempts + CASE WHEN u.counted = 1 THEN 1 ELSE 0 END,
        run_after = CASE WHEN u.status = 'pending' AND u.delay >= 0
                         THEN now() + make_interval(secs => u.delay) ELSE d.run_after END,
        last_error = CASE WHEN u.status = 'delivered' THEN NULL
                          ELSE COALESCE(u.error, d.last_error) END,
        last_status = COALESCE(u.http_status, d.last_status),
        finished_at = CASE WHEN u.status <> 'pending' THEN now() END,
        replay = u.status = 'pending' AND u.counted <> 1 AND d.replay,
        locked_by = NULL,
        locked_until = NULL
    FROM u
    WHERE d.id = u.id AND CASE WHEN d.claims = u.token AND d.status = 'running' AND d.locked_by = :relay THEN true END
    RETURNING d.id, d.claims
),
logged AS (
    INSERT INTO {attempts} (delivery_id, event_id, endpoint_id, http_status, duration_ms,
                            response, error, replay)
    SELECT u.id, u.event_id, u.endpoint_id, u.http_status, u.duration_ms, u.response,
           u.error, u.replay
    FROM u
    WHERE u.counted > 0
)
SELECT id, claims FROM done

-- name: delivery_heartbeat
-- params: ids, tokens, relay, lease
-- leases.sql's heartbeat, for the deliveries.

UPDATE {deliveries} AS d SET locked_until = now() + make_interval(secs => :lease)
FROM unnest(:ids::bigint[], :tokens::int[]) AS u(id, token)
WHERE d.id = u.id AND CASE WHEN d.claims = u.token AND d.status = 'running' AND d.locked_by = :relay THEN true END
RETURNING d.id

-- name: delivery_release
-- params: relay, ids, tokens
-- leases.sql's release, for the deliveries. A released delivery was never attempted: it keeps
-- its run_after, and so its place in its endpoint's queue (rows claimed ahead and still queued
-- at a stop would otherwise go behind every delivery of their endpoint not claimed yet).

UPDATE {deliveries} AS d
SET status = 'pending', locked_by = NULL, locked_until = NULL
FROM unnest(:ids::bigint[], :tokens::int[]) AS u(id, token)
WHERE d.id = u.id AND CASE WHEN d.claims = u.token AND d.status = 'running' AND d.locked_by = :relay THEN true END

-- name: endpoints_enabled
-- params: destinations
-- The enabled endpoints of these destinations, each with whether it takes a rate limit: the
-- events' claim is paced by the fast endpoints' room only while every other one is slow or
-- down (relay/sinks/endpoints/fan_outs.py), so none is read every claim. With the tenant and
-- event types each takes now: deliveries queued in the relay are held to them before they
-- are sent, not to what their endpoint's last claim read (relay/sinks/endpoints/source.py).

SELECT e.id, e.destination, e.rate_limit IS NOT NULL AS limited, e.tenant, e.event_types
FROM {endpoints} AS e
WHERE e.enabled AND e.destination = ANY(:destinations::text[])

-- name: endpoints_ahead
-- params: destination, after, n
-- The endpoints that the destination's next :n waiting events would reach, in the order the
-- events' claim takes them (fresh ones after :after, the last event this relay fanned out, in
-- outbox_fresh_idx; and those due again, in outbox_waiting_idx), matched as fan_out matches
-- them, and how many of each lane it read: fewer than :n in both, it saw every event that
-- waits, and only then may an enabled endpoint that none of them reaches be left out of what
-- keeps the claim from being paced by the fast endpoints' room (FanOuts._paceable): none of
-- its events waits behind theirs. 10,000 endpoints registered, 10 matching: it reads the
-- events' few (tenant, type) pairs, and matches those.

WITH fresh AS MATERIALIZED (
    SELECT o.tenant, o.event_type FROM {table} AS o
    WHERE o.destination = :destination AND o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at AND o.id > :after::bigint
    ORDER BY o.id
    LIMIT :n
),
due AS MATERIALIZED (
    SELECT o.tenant, o.event_type FROM {table} AS o
    WHERE o.destination = :destination AND o.status = 'pending' AND (o.claims <> 0 OR o.run_after > o.created_at)
      AND o.run_after <= now()
    ORDER BY o.run_after, o.id
    LIMIT :n
),
kinds AS (
    SELECT DISTINCT tenant, event_type FROM (SELECT * FROM fresh UNION ALL SELECT * FROM due) AS a
)
SELECT (SELECT count(*) FROM fresh)::int AS fresh, (SELECT count(*) FROM due)::int AS due,
    ARRAY(
        SELECT DISTINCT e.id FROM kinds AS k
        CROSS JOIN LATERAL (
            SELECT e.id FROM {endpoints} AS e
            WHERE e.enabled AND e.destination = :destination AND e.tenant = k.tenant
              AND (cardinality(e.event_types) = 0 OR k.event_type = ANY(e.event_types))
            UNION ALL
            SELECT e.id FROM {endpoints} AS e
            WHERE e.enabled AND e.destination = :destination AND e.tenant IS NULL
              AND (cardinality(e.event_types) = 0 OR k.event_type = ANY(e.event_types))
        ) AS e
    ) AS endpoints

-- name: fan_out_settle
-- params: event_ids, relay, held
-- After a fan-out whose answer was lost (its connection failed, after the commit or before):
-- the deliveries of its events it claimed as it wrote them (running under this relay's first
-- claim, never attempted) that this relay does not hold (:held, the ids it holds) are put back
-- to pending, unattempted, as delivery_release does, for the claim to send. Left to the
-- reaper, they would count an attempt never made. Nothing, if the fan-out did not commit.
-- Returns their ids. Read by event id (the unique key): written as one condition, the status
-- and the relay would let the planner read the in-flight index by this relay's name instead,
-- every delivery it holds and, under a held snapshot, every one it recorded since
-- (tests/test_fan_out_plan.py).

UPDATE {deliveries} AS d
SET status = 'pending', locked_by = NULL, locked_until = NULL
WHERE d.event_id = ANY(:event_ids::bigint[]) AND (d.status = 'running' AND d.locked_by = :relay) IS TRUE
  AND d.claims = 1 AND d.attempts = 0 AND NOT (d.id = ANY(:held::bigint[]))
RETURNING d.id

-- name: delivery_reap
-- params: default_max_attempts, batch, destinations, max_attempts, within
-- Deliveries whose relay stopped heartbeating: back to pending, an attempt counted (the
-- request may have been sent), or failed at their destination's attempt limit
-- (:destinations/:max_attempts; :default_max_attempts otherwise). At most :batch. :within:
-- only leases that ended in the last :within seconds (NULL: all), as leases.sql's reap: a
-- held snapshot keeps the dead running version of every delivery recorded since, each with
-- the end its lease would have had, and a pass over all of them grew with every delivery;
-- the reaper's full pass, now and then, takes what a bounded one cannot see.

WITH expired AS (
    SELECT id FROM {deliveries}
    WHERE status = 'running' AND locked_until < now()
      AND (:within::float8 IS NULL OR locked_until >= now() - make_interval(secs => :within::float8))
    ORDER BY locked_until
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
),
limits AS (
    SELECT * FROM unnest(:destinations::text[], :max_attempts::int[]) AS l(destination, max_attempts)
),
judged AS (
    SELECT d.id, d.attempts + 1 >= coalesce(
               (SELECT l.max_attempts FROM limits AS l WHERE l.destination = d.destination), :default_max_attempts)
           AS spent
    FROM {deliveries} AS d JOIN expired USING (id)
)
UPDATE {deliveries} AS d
SET status = CASE WHEN j.spent THEN 'failed' ELSE 'pending' END,
    attempts = d.attempts + 1,
    run_after = now(),
    last_error = 'lease expired: relay ' || coalesce(d.locked_by, '?')
                 || ' stopped before recording an outcome',
    finished_at = CASE WHEN j.spent THEN now() END,
    locked_by = NULL,
    locked_until = NULL
FROM judged AS j
WHERE d.id = j.id
RETURNING d.id, d.status

-- name: endpoint_health
-- params: ids, ok
-- An endpoint's health after a batch of attempts (:ok: whether any succeeded): the first
-- failure after a success starts failing_since, a success clears it. Returns for how long each
-- endpoint has been failing (NULL: it is not).

UPDATE {endpoints} AS e
SET last_success_at = CASE WHEN h.ok THEN now() ELSE e.last_success_at END,
    failing_since = CASE WHEN h.ok THEN NULL ELSE coalesce(e.failing_since, now()) END
FROM (SELECT * FROM unnest(:ids::bigint[], :ok::bool[]) AS h(id, ok) ORDER BY id) AS h
WHERE e.id = h.id
RETURNING e.id, extract(epoch FROM now() - e.failing_since)::float8 AS failing_for

-- name: endpoint_disable
-- params: endpoint, reason, failing_for
-- Disables an endpoint (:endpoint) with a reason (:reason): at once (:failing_for NULL, a 410
-- Gone), or if it has been failing for at least :failing_for seconds. Only an enabled endpoint;
-- returns its id if it did.

UPDATE {endpoints}
SET enabled = false, disabled_at = now(), disabled_reason = :reason, updated_at = now()
WHERE id = :endpoint AND enabled
  AND (:failing_for::float8 IS NULL OR failing_since <= now() - make_interval(secs => :failing_for))
RETURNING id

-- name: endpoint_circuit
-- params: ids, open, seconds
-- An endpoint's circuit as this relay's breaker sees it (:open: open; :seconds until its
-- probe), for `status`: written when it opens and when it closes again.

UPDATE {endpoints} AS e
SET circuit_open_until = CASE WHEN c.open THEN now() + make_interval(secs => c.secs) END
FROM (SELECT * FROM unnest(:ids::bigint[], :open::bool[], :seconds::float8[]) AS c(id, open, secs)
      ORDER BY id) AS c
WHERE e.id = c.id
