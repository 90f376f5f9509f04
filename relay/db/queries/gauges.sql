-- What the relay measures for its gauges: pending rows by destination, read lane by lane, and
-- the oldest holder of the xmin horizon (the snapshot that keeps dead rows).
-- relay/db/queries/gauges.py names them; they are asyncpg's (:name binds handed out as $1,
-- $2, … in their params' order: outbox/sql.py).

-- name: pending_by_destination
-- params: destinations, floors, fence
-- The pending gauges: rows and the oldest one's age per destination, read lane by lane (see
-- claim.sql's claim). A held snapshot keeps a dead entry in outbox_fresh_idx for every row
-- claimed since, and counting a destination's pending rows from the start of its range read all
-- of them every stats_interval. Each destination's fresh rows are counted from its floor
-- (:destinations/:floors: what the previous count found, the lowest fresh row then or the fence
-- :fence past it: no fresh row can appear below it, since every id up to the fence belongs to a
-- finished transaction; a fence that falls, as it does when retention deletes every row, leaves
-- the floor where it was; a truncated table is a new epoch, and the relay counts from the
-- start). The destinations counted: those with a floor, and those of the relay registry; the
-- others (rows of a destination nobody serves, which nobody claims and which so leave no dead
-- entries) are found in the gaps of the index between them. Each destination's lowest fresh row
-- comes back as its next floor. tests/test_claim_lanes.py holds the floors.

WITH known AS (
    SELECT k.destination, max(k.floor) AS floor FROM (
        SELECT f.destination, f.floor FROM unnest(:destinations::text[], :floors::bigint[]) AS f(destination, floor)
        UNION ALL
        SELECT d, 0 FROM {relays} AS r CROSS JOIN LATERAL unnest(r.destinations) AS d
    ) AS k
    GROUP BY k.destination
),
gaps AS (
    -- Between known destinations; past the last one, the last part of `fresh`.
    SELECT lag(destination, 1, '') OVER (ORDER BY destination) AS lo, destination AS hi FROM known
),
fresh AS (
    SELECT k.destination, s.n, s.lowest, s.oldest, k.floor FROM known AS k
    CROSS JOIN LATERAL (
        SELECT count(*) AS n, min(o.id) AS lowest, min(o.created_at) AS oldest FROM {table} AS o
        WHERE o.destination = k.destination AND o.status = 'pending' AND o.claims = 0
          AND o.run_after <= o.created_at
          AND o.id >= k.floor
    ) AS s
    UNION ALL
    -- Aggregated inside each gap's LATERAL, so that each gap is a range of the index (the
    -- planner flattens a plain subquery into one scan of the whole index).
    SELECT s.*, 0 FROM gaps AS g
    CROSS JOIN LATERAL (
        SELECT o.destination, count(*) AS n, min(o.id) AS lowest, min(o.created_at) AS oldest
        FROM {table} AS o
        WHERE o.destination > g.lo AND o.destination < g.hi
          AND o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at
        GROUP BY o.destination
    ) AS s
    UNION ALL
    SELECT o.destination, count(*), min(o.id), min(o.created_at), 0 FROM {table} AS o
    WHERE o.destination > (SELECT coalesce(max(destination), '') FROM known)
      AND o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at
    GROUP BY o.destination
),
waiting AS (
    SELECT destination, count(*) AS n, min(created_at) AS oldest FROM {table}
    WHERE status = 'pending' AND (claims <> 0 OR run_after > created_at)
    GROUP BY destination
)
SELECT a.destination, sum(a.n)::bigint AS rows,
       coalesce(extract(epoch FROM now() - min(a.oldest))::float8, 0) AS oldest_age,
       least(min(a.lowest), greatest(:fence::bigint + 1, max(a.floor))) AS floor
FROM (SELECT destination, n, lowest, oldest, floor FROM fresh
      UNION ALL
      SELECT destination, n, NULL, oldest, 0 FROM waiting) AS a
GROUP BY a.destination

-- name: snapshot_holder
-- The oldest holder of the xmin horizon VACUUM of this database's tables must keep to: dead
-- row versions of the outbox newer than it stay until it lets go, and the claim reads past
-- them. Holders, and what of them the horizon of this database's tables depends on:
-- - backends of this database: their snapshot (backend_xmin) and their transaction's xid;
-- - backends of other databases: only their xid (every snapshot taken here counts it as
--   running, so it drags back the xmin of this database's own snapshots); since PostgreSQL 14
--   a snapshot alone in another database holds back only that database;
-- - backends of no database (a walsender with hot_standby_feedback and no slot);
-- - prepared transactions, of any database, for their xid (as any transaction's xid);
-- - replication slots' xmin (a standby's hot_standby_feedback); their catalog_xmin (logical
--   decoding) holds back only the system catalogs, not the outbox, and is left out.
-- Not this statement's own backend, nor autovacuum's VACUUM (PostgreSQL leaves a vacuuming
-- backend's xmin out of the horizon). The holder with the oldest xid wins (it is the
-- horizon); age_s is known for a visible backend (its transaction's start) and a prepared
-- transaction, never for a slot. Without pg_read_all_stats, another role's backends show
-- their pid, user, application name and xids but not their state, times or query: visible
-- is false. Of the query, only its first word (COPY, SELECT) is read: its text may hold
-- literals with secrets, and the relay prints and logs what it reads. The pattern's \s is
-- sent as written (a raw string in Python once).

WITH holders AS (
    SELECT 'backend' AS kind, a.pid, NULL::text AS name, a.datname::text AS database,
           a.application_name, a.usename::text AS "user", host(a.client_addr) AS client_addr,
           a.state, a.backend_type, a.xact_start, a.query_start,
           upper(substring(a.query FROM '^\s*([A-Za-z]+)')) AS command,
           extract(epoch FROM now() - a.xact_start)::float8 AS age_s,
           CASE WHEN a.datname = current_database() OR a.datid IS NULL
                THEN greatest(age(a.backend_xmin), age(a.backend_xid))
                ELSE age(a.backend_xid) END AS xid_age,
           CASE WHEN a.datname = current_database() OR a.datid IS NULL
                THEN coalesce(a.backend_xid, a.backend_xmin)
                ELSE a.backend_xid END::text AS horizon,
           a.backend_type IS NOT NULL AS visible
    FROM pg_stat_activity AS a
    WHERE a.pid <> pg_backend_pid()
      AND NOT (a.backend_type = 'autovacuum worker' AND a.query LIKE 'autovacuum: VACUUM%')
      AND (a.backend_xid IS NOT NULL
           OR (a.backend_xmin IS NOT NULL
               AND (a.datname = current_database() OR a.datid IS NULL)))
    UNION ALL
    SELECT 'prepared transaction', NULL, p.gid, p.database::text, NULL, p.owner::text, NULL,
           NULL, NULL, p.prepared, NULL, NULL, extract(epoch FROM now() - p.prepared)::float8,
           age(p.transaction), p.transaction::text, true
    FROM pg_prepared_xacts AS p
    UNION ALL
    SELECT 'replication slot', s.active_pid, s.slot_name::text, s.database::text, NULL, NULL,
           NULL, CASE WHEN s.active THEN 'active' ELSE 'inactive' END, NULL, NULL, NULL, NULL,
           NULL, age(s.xmin), s.xmin::text, true
    FROM pg_replication_slots AS s
    WHERE s.xmin IS NOT NULL
)
SELECT * FROM holders ORDER BY xid_age DESC, age_s DESC NULLS LAST LIMIT 1
