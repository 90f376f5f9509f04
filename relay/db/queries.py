"""Every statement the relay runs, in one place: the claim, outcomes, leases, the registry,
pauses, retention and gauges. The commands' statements (status, retry, purge, …) are in
relay/ops/queries.py.

Statements name the outbox table ``{table}``, outbox_paused ``{paused}`` and outbox_relays
``{relays}``; :func:`render_ops` fills them in for a schema once, when the store is created.
Values are always bound parameters, never formatted in.
"""

from __future__ import annotations

# Statements of the outbox library the relay runs too.
from outbox.queries import NOTIFY as NOTIFY
from outbox.queries import SERVER_ENCODING as SERVER_ENCODING
from outbox.queries import TABLE_EXISTS as TABLE_EXISTS
from outbox.queries import qualified_table as qualified_table
from outbox.queries import render_endpoints


def render_ops(sql: str, schema: str) -> str:
    """Fill in ``{table}`` (the outbox), ``{paused}`` (outbox_paused), ``{relays}``
    (outbox_relays), and ``{endpoints}``, ``{deliveries}``, ``{attempts}`` of ``schema``."""
    return render_endpoints(
        sql.replace("{table}", qualified_table(schema))
        .replace("{paused}", qualified_table(schema, PAUSED_TABLE))
        .replace("{relays}", qualified_table(schema, RELAYS_TABLE)),
        schema,
    )


# The claim: one statement per destination ($1), after FENCE (see below). Pick
# its claimable rows, skip rows other relays are locking, mark them running under this relay's
# lease, return them. The index ranges are the destination's own, so other destinations'
# backlogs cost nothing.
#
# Two lanes (migration 0012). Fresh rows (never claimed, due when written: nearly all of them)
# are read in id order from outbox_fresh_idx, after the cursor $5: where the previous claim of
# this relay ended. A held snapshot (a pg_dump, a report, an idle transaction) keeps every
# claimed row's dead entry in the index; a walk from the start of the range would pass all of
# them, claim after claim (the claim's cost grew by 0.1 ms per thousand rows delivered while a
# snapshot was held: docs/performance.md). From the cursor it passes only those claimed since
# the last claim. Rows due again (retried, reaped, released, replayed, or written with a later
# run_after) are read in run_after order from outbox_waiting_idx. Up to $2 rows are locked in
# each lane, and the $2 first in run_after order are claimed: neither lane can starve the other.
#
# Ids are drawn at insert and seen at commit, so the cursor passes ids of transactions still
# open, whose rows may commit later. Each claim also reads the fresh rows after $7 up to the
# cursor: those that may have committed late since the previous claim. The relay computes $7
# from what FENCE read before this claim and the one before (see Store.claim): the keys of the
# inserting transactions that were open then and have ended since (each one's ids are above
# its key), the highest id visible at the previous reading ($6 now: a transaction that began
# after a reading takes a key above it) and the first row the previous claim left in that
# range. A transaction left open after an insert holds back none of this: its rows are read
# once, when it ends.
#
# The last row of the result (id -1) carries the next cursor in `key` (below the first fresh row
# this claim saw pending and did not claim: rows other relays are claiming at this moment are
# seen pending, so a claim that rolls back leaves its rows ahead of the cursor) and the next
# $7 in `content_type`. tests/test_claim_lanes.py holds these rules and the plans.
_FRESH = "status = 'pending' AND claims = 0 AND run_after <= created_at"
_FRESH_O = "o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at"


def _mark_running(rows: str) -> str:
    """Every claim's last step: the rows of CTE ``rows`` marked running under this relay's
    lease ($3 the relay, $4 the lease in seconds), the fencing token taken, and returned as
    Store._envelopes reads them."""
    return f"""claimed AS (
    UPDATE {{table}} AS o
    SET status = 'running', locked_by = $3, locked_until = now() + make_interval(secs => $4),
        claims = o.claims + 1
    WHERE o.id = ANY(ARRAY(SELECT id FROM {rows}))
    RETURNING o.id, o.destination, o.key, o.payload, o.content_type, o.headers::text AS headers,
              o.attempts, extract(epoch FROM o.created_at)::float8 AS created_at, o.claims,
              o.event_type
)"""


def _claim(late: bool) -> str:
    """CLAIM, or CLAIM_FRESH without the read of late commits (see below)."""
    late_cte = f"""
late AS (
    SELECT id, run_after FROM {{table}}
    WHERE destination = $1 AND {_FRESH} AND id > $7::bigint AND id <= $5::bigint
      AND run_after <= now()
    ORDER BY id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),"""
    late_union = "SELECT * FROM late UNION ALL "
    late_rest = f"""coalesce(
           (SELECT min(o.id) - 1 FROM {{table}} AS o
            WHERE o.destination = $1 AND {_FRESH_O}
              AND o.id > $7::bigint AND o.id <= $5::bigint
              AND o.id NOT IN (SELECT c.id FROM chosen AS c)),
           n.cursor)"""
    return f"""
WITH waiting AS (
    SELECT id, run_after FROM {{table}}
    WHERE destination = $1 AND status = 'pending' AND (claims <> 0 OR run_after > created_at)
      AND run_after <= now()
    ORDER BY run_after, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),{late_cte if late else ""}
fresh AS (
    SELECT id, run_after FROM {{table}}
    WHERE destination = $1 AND {_FRESH} AND id > $5::bigint AND run_after <= now()
    ORDER BY id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
chosen AS (
    SELECT c.id FROM (
        SELECT * FROM waiting UNION ALL {late_union if late else ""}SELECT * FROM fresh
    ) AS c
    ORDER BY c.run_after, c.id
    LIMIT $2
),
{_mark_running("chosen")},
next_cursor AS MATERIALIZED (
    SELECT coalesce(
        (SELECT min(o.id) - 1 FROM {{table}} AS o
         WHERE o.destination = $1 AND {_FRESH_O} AND o.id > $5::bigint
           AND o.id NOT IN (SELECT c.id FROM chosen AS c)),
        (SELECT max(c.id) FROM chosen AS c WHERE c.id > $5::bigint),
        $5::bigint) AS cursor
)
SELECT * FROM claimed
UNION ALL
SELECT -1, NULL, n.cursor::text,
       NULL, least($6::bigint, n.cursor{", " + late_rest if late else ""})::text,
       NULL, 0, NULL, 0, NULL
FROM next_cursor AS n
"""


CLAIM = _claim(late=True)
# CLAIM when the late commits' range ($7, $5] is empty, as it is on a drain (every row was
# visible before the claim began): the same answer without two of its reads, whose planning
# is a tenth of the claim's cost (force_custom_plan plans each claim anew). $7 is not passed.
CLAIM_FRESH = _claim(late=False)

# Fresh rows of a destination at or below where its claims have seen every one ($2): none, but
# for ids handed out again (a sequence set back by hand; a table truncated, or a failover, are
# noticed by FENCE's epoch). The relay looks now and then, off the claim's path: under a held
# snapshot this reads every dead entry below $2.
FRESH_BELOW = f"""
SELECT min(id) FROM {{table}} WHERE destination = $1 AND {_FRESH} AND id <= $2
"""


def _held(row: str, pairs: str, relay: str) -> str:
    """The fence of every outcome, heartbeat and release: row ``row`` matched to its (id, token)
    pair in ``pairs``, still running under this relay (``relay``) and that very claim."""
    return (
        f"{row}.id = {pairs}.id AND {row}.claims = {pairs}.token AND {row}.status = 'running' "
        f"AND {row}.locked_by = {relay}"
    )


def _outcome_set(claims: str) -> str:
    """RECORD's SET list, but for its ``claims`` line (with what it says of it)."""
    return f"""status = u.status,
    attempts = o.attempts + u.counted,
    run_after = CASE WHEN u.status = 'pending'
                     THEN now() + make_interval(secs => u.delay) ELSE o.run_after END,
    last_error = COALESCE(u.error, o.last_error),
    delivered_at = CASE WHEN u.status = 'delivered' THEN now() END,
    finished_at = CASE WHEN u.status <> 'pending' THEN now() END,
    {claims}
    locked_by = NULL,
    locked_until = NULL"""


def _delivered_set(extra: str = "") -> str:
    """RECORD_DELIVERED's SET list; ``extra``: lines to add before its ``claims`` line."""
    return f"""status = 'delivered',
    attempts = o.attempts + 1,
    delivered_at = now(),
    finished_at = now(),
    {extra}claims = u.token,  -- unchanged; see RECORD
    locked_by = NULL,
    locked_until = NULL"""


def _indented(text: str) -> str:
    """``text`` four more spaces in, but for its first line (it follows a keyword)."""
    return text.replace("\n", "\n    ")


# The outcomes and their text, as RECORD writes them: every outcome, $1-$6.
_OUTCOMES = """unnest($1::bigint[], $2::int[], $3::text[], $4::int[], $5::float8[], $6::text[])
     AS u(id, token, status, counted, delay, error)"""

# RECORD's claims line: it says why it is there.
_RECORD_CLAIMS = """\
-- Unchanged (the WHERE demands it), and written so that a trigger auditing the table can
    -- tell which claim an outcome belongs to (the fault suite counts outcomes recorded over a
    -- newer claim that way).
    claims = u.token,"""

# All outcomes of a batch in one statement. Only rows this relay still holds under the claim
# that produced the outcome are touched ($2: each row's fencing token, the `claims` value its
# claim returned): if the lease expired and the row was claimed again, by another relay or by
# this one, the newer claim's outcome wins. Returns the (id, token) pairs it recorded.
RECORD = f"""
UPDATE {{table}} AS o
SET {_outcome_set(_RECORD_CLAIMS)}
FROM {_OUTCOMES}
WHERE {_held("o", "u", "$7")}
RETURNING o.id, o.claims
"""

# RECORD for a batch whose outcomes are all plain deliveries (one attempt counted, no error
# text): most batches. Only the (id, token) pairs travel; encoding the four other arrays of
# RECORD was an eighth of the relay's CPU per Kafka event. The same fencing as RECORD.
RECORD_DELIVERED = f"""
UPDATE {{table}} AS o
SET {_delivered_set()}
FROM unnest($1::bigint[], $2::int[]) AS u(id, token)
WHERE {_held("o", "u", "$3")}
RETURNING o.id, o.claims
"""


def _heartbeat(table: str, row: str) -> str:
    """HEARTBEAT for ``table`` (its rows called ``row``): the events' or the deliveries'."""
    return f"""
UPDATE {table} AS {row} SET locked_until = now() + make_interval(secs => $4)
FROM unnest($1::bigint[], $2::int[]) AS u(id, token)
WHERE {_held(row, "u", "$3")}
RETURNING {row}.id
"""


# Extends the lease of the rows this relay still holds under its claims' tokens; returns their
# ids. A row missing from the answer was lost (reaped after a stall, and maybe claimed again).
HEARTBEAT = _heartbeat("{table}", "o")

# Of (id, token) pairs a heartbeat could not renew, those recorded as delivered under that very
# claim: a sink that records in its own statement (the endpoints sink's FAN_OUT) did so before
# the relay handed the outcome over. They are settled, not lost. (A reaped row is pending, or
# failed, or claimed again under a newer token.) Rare: only rows the heartbeat missed.
SETTLED = """
SELECT o.id FROM {table} AS o
JOIN unnest($1::bigint[], $2::int[]) AS u(id, token) ON o.id = u.id AND o.claims = u.token
WHERE o.status = 'delivered'
"""

# The attempt limits by destination ($3/$4) of REAP and DELIVERY_REAP.
_LIMITS = """limits AS (
    SELECT * FROM unnest($3::text[], $4::int[]) AS l(destination, max_attempts)
)"""


def _reaped(row: str) -> str:
    """What REAP and DELIVERY_REAP set on a row (``row``) whose lease expired: an attempt
    counted (the request may have been sent), due at once, and why."""
    return f"""attempts = {row}.attempts + 1,
    run_after = now(),
    last_error = 'lease expired: relay ' || coalesce({row}.locked_by, '?')
                 || ' stopped before recording an outcome',"""


# Rows whose relay stopped heartbeating go back to pending (or to failed once they have used
# every attempt: a row that crashes its relay each time must not loop for ever). $3/$4 give
# per-destination attempt limits; $1 is the limit for any other destination.
# $5: only these rows (NULL: any); $6: never these (rows the database refused to reap).
# $7: only leases that ended in the last $7 seconds, of the destinations this relay ($3) or
# any registered relay serves (NULL: all of them): the reaper's earlier pass took the older
# ones. A held snapshot keeps the dead entry of every row ever claimed in outbox_lease_idx,
# each with the time its lease would have ended; a pass over all of them, every second, grew
# with every row delivered (docs/performance.md). Within each destination the bounded pass
# reads the index from the bound on. The reaper passes over all of them now and then, for what
# a bounded pass cannot see (see relay/maintenance/reaper.py).
REAP = """
WITH expired AS (
    SELECT id FROM {table}
    WHERE status = 'running' AND locked_until < now()
      AND ($7::float8 IS NULL OR (
          locked_until >= now() - make_interval(secs => $7::float8)
          AND destination = ANY(ARRAY(
              SELECT DISTINCT d FROM {relays} AS r CROSS JOIN LATERAL unnest(r.destinations) AS d
              UNION SELECT unnest($3::text[])))))
      AND ($5::bigint[] IS NULL OR id = ANY($5::bigint[]))
      AND NOT (id = ANY($6::bigint[]))
    ORDER BY locked_until
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
{limits}
UPDATE {table} AS o
SET status = CASE WHEN o.attempts + 1 >= coalesce(
                      (SELECT l.max_attempts FROM limits AS l WHERE l.destination = o.destination),
                      $1)
                  THEN 'failed' ELSE 'pending' END,
    {reaped}
    finished_at = CASE WHEN o.attempts + 1 >= coalesce(
                      (SELECT l.max_attempts FROM limits AS l WHERE l.destination = o.destination),
                      $1)
                  THEN now() END,
    locked_by = NULL,
    locked_until = NULL
FROM expired
WHERE o.id = expired.id
RETURNING o.id, o.status, o.destination
""".replace("{limits}", _LIMITS).replace("{reaped}", _reaped("o"))

# Rows whose lease expired, for reaping them one at a time when the database refuses to reap
# them together (a trigger that refuses one row must not keep every dead relay's rows).
EXPIRED = """
SELECT id FROM {table}
WHERE status = 'running' AND locked_until < now() AND NOT (id = ANY($2::bigint[]))
ORDER BY locked_until
LIMIT $1
"""


# On clean shutdown: rows claimed but not attempted go back untouched (no attempt counted),
# if this relay still holds them under the same claim.
def _release(table: str, row: str) -> str:
    """RELEASE for ``table`` (its rows called ``row``): the events' or the deliveries'."""
    return f"""
UPDATE {table} AS {row}
SET status = 'pending', locked_by = NULL, locked_until = NULL, run_after = now()
FROM unnest($2::bigint[], $3::int[]) AS u(id, token)
WHERE {_held(row, "u", "$1")}
"""


RELEASE = _release("{table}", "o")

# Pending rows of destinations that neither this relay ($1) nor any relay seen in the last $2
# seconds serves (see the relay registry): nobody will deliver them until a config changes.
# Failing them ($3) spares rows younger than a grace period, so a relay that serves them has
# time to start (a new deployment, a relay added for a new destination).
_UNSERVED = """
WHERE status = 'pending' AND NOT (destination = ANY($1::text[]))
  AND NOT EXISTS (SELECT 1 FROM {relays} AS r
                  WHERE r.seen_at > now() - make_interval(secs => $2)
                    AND {table}.destination = ANY(r.destinations))
"""

UNKNOWN_DESTINATIONS = (
    """
SELECT destination, count(*) AS rows, min(created_at) AS oldest
FROM {table}
"""
    + _UNSERVED
    + """
GROUP BY destination
ORDER BY destination
"""
)

FAIL_UNKNOWN_DESTINATIONS = (
    """
UPDATE {table}
SET status = 'failed',
    finished_at = now(),
    last_error = 'unknown destination ' || quote_literal(destination)
                 || ': no running relay serves it; add it to a relay config, then run '
                 || 'outbox-relay retry'
"""
    + _UNSERVED
    + """
  AND created_at < now() - make_interval(secs => $3)
  AND attempts = 0  -- a row some relay already tried is served (maybe by one not registered)
RETURNING destination
"""
)

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


def _record_deleting(pairs: str, relay: str, set_list: str, outcomes: str, kept: str) -> str:
    """A statement that records outcomes with retention = 0: it deletes the rows of
    ``pairs`` (the delivered ones' (id, token) arrays) that no open delivery needs and updates
    the rest with ``set_list`` from ``outcomes`` where ``kept``; ``relay``: this relay."""
    return f"""
WITH gone AS (
    DELETE FROM {{table}} AS o
    USING unnest({pairs}) AS g(id, token)
    WHERE {_held("o", "g", relay)}
      AND NOT {_OPEN_DELIVERY}
    RETURNING o.id, o.claims
),
kept AS (
    UPDATE {{table}} AS o
    SET {_indented(set_list)}
    FROM {_indented(outcomes)}
    WHERE {kept}
    RETURNING o.id, o.claims
)
SELECT id, claims FROM gone UNION ALL SELECT id, claims FROM kept
"""


# With retention = 0: delivered rows are deleted by the statement that records them, the rest
# updated as in RECORD. An event fanned out to endpoints whose deliveries are still open is
# kept (recorded as delivered, like a row of RECORD): the deliveries read its payload, and
# retention deletes it once they have ended. Still one statement; the two parts touch
# disjoint rows (their EXISTS tests read one snapshot). Its UPDATE sets what RECORD sets
# (_outcome_set): the two cannot drift apart.
#
# $1-$6 are every outcome, as for RECORD; $8/$9 the (id, token) pairs of the delivered ones
# again. Each part reads its pairs straight from unnest, as RECORD does: the planner then
# knows how many there are. A filtered list (a CTE of $1-$6 with status = 'delivered') looks
# to it like two or three rows, and beside the running rows that statistics taken while rows
# were pending put at one, it chose to loop over the batch once per running row: 80-160 ms
# for 500 outcomes instead of 5 (tests/test_batch_plans.py).
RECORD_DELETING = _record_deleting(
    "$8::bigint[], $9::int[]",
    "$7",
    _outcome_set("claims = u.token,  -- unchanged; see RECORD"),
    _OUTCOMES,
    f"""o.id = u.id
      AND (u.status <> 'delivered'
           OR {_OPEN_DELIVERY})
      AND o.claims = u.token AND o.status = 'running' AND o.locked_by = $7""",
)

# RECORD_DELIVERED with retention = 0: RECORD_DELETING for a batch of plain deliveries.
RECORD_DELIVERED_DELETING = _record_deleting(
    "$1::bigint[], $2::int[]",
    "$3",
    _delivered_set(),
    "unnest($1::bigint[], $2::int[]) AS u(id, token)",
    f"""{_held("o", "u", "$3")}
      AND {_OPEN_DELIVERY}""",
)

PAUSED_TABLE = "outbox_paused"

RELAYS_TABLE = "outbox_relays"

PAUSED = "SELECT destination FROM {paused}"

# Jobs that one relay at a time should run take this lock in their own short transaction. It
# is released at commit or when the connection dies, so a crashed relay never holds it.
TRY_JOB_LOCK = "SELECT pg_try_advisory_xact_lock(hashtextextended('outbox-relay:' || $1, 0))"

# Pending rows per destination, for the gauges: the partial claim index holds exactly them.
# The pending gauges: rows and the oldest one's age per destination, read lane by lane (see
# CLAIM). A held snapshot keeps a dead entry in outbox_fresh_idx for every row claimed since,
# and counting a destination's pending rows from the start of its range read all of them every
# stats_interval. Each destination's fresh rows are counted from its floor ($1/$2: what the
# previous count found, the lowest fresh row then or the fence $3 past it: no fresh row can
# appear below it, since every id up to the fence belongs to a finished transaction; a fence
# that falls, as it does when retention deletes every row, leaves the floor where it was; a
# truncated table is a new epoch, and the relay counts from the start). The destinations counted:
# those with a floor, and those of the relay registry; the others (rows of a destination nobody
# serves, which nobody claims and which so leave no dead entries) are found in the gaps of the
# index between them. Each destination's lowest fresh row comes back as its next floor.
# tests/test_claim_lanes.py holds the floors.
PENDING_BY_DESTINATION = """
WITH known AS (
    SELECT k.destination, max(k.floor) AS floor FROM (
        SELECT f.destination, f.floor FROM unnest($1::text[], $2::bigint[]) AS f(destination, floor)
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
       least(min(a.lowest), greatest($3::bigint + 1, max(a.floor))) AS floor
FROM (SELECT destination, n, lowest, oldest, floor FROM fresh
      UNION ALL
      SELECT destination, n, NULL, oldest, 0 FROM waiting) AS a
GROUP BY a.destination
"""

# The oldest holder of the xmin horizon VACUUM of this database's tables must keep to: dead
# row versions of the outbox newer than it stay until it lets go, and the claim reads past
# them. Holders, and what of them the horizon of this database's tables depends on:
# - backends of this database: their snapshot (backend_xmin) and their transaction's xid;
# - backends of other databases: only their xid (every snapshot taken here counts it as
#   running, so it drags back the xmin of this database's own snapshots); since PostgreSQL 14
#   a snapshot alone in another database holds back only that database;
# - backends of no database (a walsender with hot_standby_feedback and no slot);
# - prepared transactions, of any database, for their xid (as any transaction's xid);
# - replication slots' xmin (a standby's hot_standby_feedback); their catalog_xmin (logical
#   decoding) holds back only the system catalogs, not the outbox, and is left out.
# Not this statement's own backend, nor autovacuum's VACUUM (PostgreSQL leaves a vacuuming
# backend's xmin out of the horizon). The holder with the oldest xid wins (it is the
# horizon); age_s is known for a visible backend (its transaction's start) and a prepared
# transaction, never for a slot. Without pg_read_all_stats, another role's backends show
# their pid, user, application name and xids but not their state, times or query: visible
# is false. Of the query, only its first word (COPY, SELECT) is read: its text may hold
# literals with secrets, and the relay prints and logs what it reads.
SNAPSHOT_HOLDER = r"""
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
"""

PING = "SELECT 1"

# pg_attribute, not information_schema: the latter hides columns the role has no privilege
# on, and a role granted before a migration must hear "grant", not "migrate".
COLUMN_EXISTS = """
SELECT EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = to_regclass($1) AND attname = $2 AND NOT attisdropped)
"""

# A usable index (an interrupted CREATE INDEX CONCURRENTLY leaves an invalid one behind) and
# its predicate, as PostgreSQL prints it.
INDEX_VALID = """
SELECT (SELECT pg_get_expr(indpred, indrelid) FROM pg_index
        WHERE indexrelid = to_regclass($1) AND indisvalid)
"""

TABLE_PRIVILEGE = "SELECT has_table_privilege(to_regclass($1), $2)"

# A relay says it is alive, and what it serves, every few seconds (one row per relay).
REGISTER = """
INSERT INTO {relays}
    (relay_id, host, pid, version, destinations, circuits, features, features_at)
VALUES ($1, $2, $3, $4, $5::text[], $6::jsonb, ARRAY['ordered-owner'], now())
ON CONFLICT (relay_id) DO UPDATE
SET host = EXCLUDED.host, pid = EXCLUDED.pid, version = EXCLUDED.version,
    destinations = EXCLUDED.destinations, circuits = EXCLUDED.circuits,
    features = EXCLUDED.features, features_at = now(), seen_at = now(), stopped_at = NULL
"""

# On a clean stop. The row stays: its destinations still count as served for a while, so a
# rolling restart does not make another relay fail their rows as unknown.
UNREGISTER = """
UPDATE {relays} SET stopped_at = now(), seen_at = now(), circuits = '{}' WHERE relay_id = $1
"""

FORGET_RELAYS = "DELETE FROM {relays} WHERE seen_at < now() - make_interval(secs => $1)"

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


# The visibility fence (see migrations/0003), read in a statement of its own *before* the claims,
# whose snapshot must be younger than this reading (an unordered claim that follows a full batch at
# once may go on the previous reading, older still: see Store.claim): a transaction that commits
# between a claim's snapshot and its reading of pg_locks would release its lock while its rows stay
# invisible to that claim. Every id up to the result belongs to a transaction that had finished
# when it was read: the smallest fence key still held (taken before its holder drew any id), capped
# at the highest id then visible (ids are drawn in increasing order, so a row at or below it was
# drawn before this reading, and so were all lower ids). Only this table's keys count ($1: the
# table; see migrations/0004 for the key's layout), and untagged keys of inserts that began under
# the trigger of migration 0003: an untagged key is ignored only when its transaction holds a
# tagged key of the same value (the pair the new trigger takes together).
FENCE = """
WITH held AS (
    SELECT l.virtualtransaction AS vxid,
           ((l.classid::bigint << 32) | l.objid::bigint) - 4611686018427387904 AS k
    FROM pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.objsubid = 1
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid::bigint >= 1073741824 AND l.classid::bigint < 2147483648
),
fence_keys AS (
    SELECT vxid, k >> 48 AS tag, k & 281474976710655 AS v FROM held
),
mine AS MATERIALIZED (
    SELECT a.vxid, a.v FROM fence_keys AS a
    WHERE a.tag = 1 + mod($1::regclass::oid::bigint, 16383)
       OR (a.tag = 0 AND NOT EXISTS (SELECT 1 FROM fence_keys AS b
                                     WHERE b.vxid = a.vxid AND b.tag > 0 AND b.v = a.v))
),
top AS MATERIALIZED (
    -- From a highest id seen before ($2, or 0), which stays a valid cap (those ids were drawn
    -- before), so that the walk back from the end of the primary key stops there: with
    -- retention = 0 and a held snapshot, every deleted row's entry lies on that walk.
    SELECT coalesce(max(id), $2::bigint) AS id FROM {table} WHERE id > $2::bigint
)
SELECT least((SELECT coalesce(min(v), 9223372036854775807) FROM mine), (SELECT id FROM top)),
-- The table's epoch: a TRUNCATE gives it a new file, a restart or a failover a new server
-- start; either may hand out ids again that the fresh lane's cursor has passed (see CLAIM).
pg_relation_filenode($1::regclass)::bigint,
extract(epoch FROM pg_postmaster_start_time())::float8,
-- For the unordered claim (see CLAIM): the highest id visible, and the keys held, each with its
-- transaction ("<virtual transaction id>/<key>": two inserts that began together hold the same
-- key, and one of them ending is news while the other is still open). A transaction's ids
-- are above its key.
(SELECT id FROM top),
ARRAY(SELECT DISTINCT vxid || '/' || v FROM mine)
"""


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

# --- An ordered destination's owner (relay/pipeline/ordered.py) -----------------------------

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


# --- Endpoints (kind = "endpoints"): fan-out, then one delivery per (event, endpoint) -------

# Fan-out of a claimed batch of events and their outcome, in one statement: one delivery per
# matching endpoint (enabled, of the event's destination, of its tenant or of every tenant,
# taking its type or every type), and each event recorded as delivered (with $4 as last_error
# when no endpoint matched), for the events this relay still holds under their claim ($1 ids,
# $2 fencing tokens, $3 this relay), as RECORD_DELIVERED fences them. A relay that dies at any
# point has either fanned a batch out and recorded it, or done neither: an event is never
# fanned out twice, even when retention has deleted the deliveries of a first fan-out (the
# UNIQUE pair alone made a second fan-out harmless only while they were kept). Returns each
# event recorded with how many endpoints it matched; an event missing from the answer was no
# longer this relay's (its lease ran out): nothing was fanned out for it.
FAN_OUT = """
WITH matched AS (
    SELECT o.id AS event_id, e.id AS endpoint_id, o.destination
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
    WHERE o.id = ANY($1::bigint[])
),
counted AS (
    SELECT event_id, count(*)::int AS n FROM matched GROUP BY event_id
),
recorded AS (
    UPDATE {table} AS o
    SET {recorded}
    FROM unnest($1::bigint[], $2::int[]) AS u(id, token)
    LEFT JOIN counted AS c ON c.event_id = u.id
    WHERE {held}
    RETURNING o.id, coalesce(c.n, 0) AS endpoints
),
added AS (
    INSERT INTO {deliveries} (event_id, endpoint_id, destination)
    SELECT m.event_id, m.endpoint_id, m.destination
    FROM matched AS m JOIN recorded AS r ON r.id = m.event_id
    ORDER BY m.event_id, m.endpoint_id
    ON CONFLICT (event_id, endpoint_id) DO NOTHING
    RETURNING 1
)
SELECT id, endpoints, (SELECT count(*) FROM added)::int AS added FROM recorded
""".replace(
    "{recorded}",
    _indented(
        _delivered_set(
            "last_error = CASE WHEN c.n IS NULL THEN $4::text ELSE o.last_error END,\n    "
        )
    ),
).replace("{held}", _held("o", "u", "$3"))

# The delivery claim. It walks the endpoints that have pending deliveries, in id order from
# the cursor $7 (NULL: from the first), at most $6 of them, with a loose index scan of the
# claim index. From each enabled endpoint of this relay's destinations ($1, with each one's
# max_concurrency in $2) but those of the tenants it skips ($9: at their fair share, see
# relay/sinks/endpoints/fairness.py), it takes due deliveries of the endpoint's own
# destination, oldest first: as many as the endpoint has room for, fewer for a rate-limited
# one. Its room is its max_concurrency, or the cap this relay gives it ($5, a JSON object of
# endpoint id to cap: 0 for one it skips, circuit open, answered 410 or at its fair share; a
# slow endpoint's slow_concurrency; one this relay knows nothing of starts at its
# destination's slow_concurrency, $10), less its deliveries in flight claimed by ANY relay
# under a live lease (the running index: one probe), so that max_concurrency holds across
# relays; a rate-limited endpoint's is also at most its limit less its attempts in the last
# second. A dead endpoint's backlog is never scanned past: the claim reads one endpoint's due
# rows at a time. At most $3 rows in all, marked running under this relay's lease ($4 relay,
# $8 seconds). The rows come with what sending needs: the event (NULL if it was deleted),
# with its tenant and type, and the endpoint's URL, secrets, tenant and event types, all of
# one snapshot, so that the relay checks the endpoint still takes the event before it sends
# it to that URL. Pending deliveries of an endpoint met on the walk that no longer exists
# (deleted while its events were being fanned out) or that now belongs to another
# destination are cancelled, saying so. The last row (id -1) carries the cursor for the next
# claim in endpoint_id: the last endpoint examined when the scan limit cut the walk short,
# the last one claimed from when the batch filled up, NULL when the walk reached the end.
DELIVERY_CLAIM = """
WITH RECURSIVE eps AS (
    (SELECT d.endpoint_id, 1 AS n FROM {deliveries} AS d
     WHERE d.status = 'pending' AND d.endpoint_id > coalesce($7::bigint, -1)
     ORDER BY d.endpoint_id
     LIMIT 1)
    UNION ALL
    SELECT nxt.endpoint_id, eps.n + 1
    FROM eps CROSS JOIN LATERAL (
        SELECT d.endpoint_id FROM {deliveries} AS d
        WHERE d.status = 'pending' AND d.endpoint_id > eps.endpoint_id
        ORDER BY d.endpoint_id
        LIMIT 1
    ) AS nxt
    WHERE eps.n < $6
),
conc AS (
    SELECT * FROM unnest($1::text[], $2::int[], $10::int[])
        AS c(destination, max_concurrency, start_cap)
),
picked AS (
    SELECT d.id, e.id AS endpoint_id
    FROM eps
    -- OFFSET 0 keeps the walk driving: one probe per endpoint found, never a scan of all
    -- the endpoints registered.
    CROSS JOIN LATERAL (
        SELECT e.id, e.destination, e.rate_limit,
               -- The caps are a JSON object, a lookup by key in it a binary search: an
               -- array of thousands of endpoints would be scanned for each one walked.
               least(c.max_concurrency,
                     coalesce(($5::jsonb ->> e.id::text)::int, c.start_cap)) AS limit_,
               -- Leases expired count no more: a dead relay's rows wait for the reaper,
               -- and must not hold the endpoint meanwhile.
               (SELECT count(*) FROM {deliveries} AS r
                WHERE r.endpoint_id = e.id AND r.status = 'running'
                  AND r.locked_until > now()) AS running
        FROM {endpoints} AS e
        JOIN conc AS c ON c.destination = e.destination
        WHERE e.id = eps.endpoint_id AND e.enabled
          AND (e.tenant IS NULL OR NOT (e.tenant = ANY($9::text[])))
        OFFSET 0
    ) AS e
    CROSS JOIN LATERAL (
        SELECT d.id FROM {deliveries} AS d
        WHERE d.endpoint_id = e.id AND d.destination = e.destination
          AND d.status = 'pending' AND d.run_after <= now()
        ORDER BY d.run_after, d.id
        LIMIT greatest(0, CASE WHEN e.rate_limit IS NULL THEN e.limit_ - e.running
                   ELSE least(e.limit_, e.rate_limit
                       - (SELECT count(*) FROM {attempts} AS a
                          WHERE a.endpoint_id = e.id AND a.at > now() - interval '1 second'))
                        - e.running
              END)
    ) AS d
    LIMIT $3
),
stale AS (
    -- Endpoints met on the walk that are gone, or whose oldest pending delivery is of
    -- another destination than theirs (moved with SQL): one probe each.
    SELECT eps.endpoint_id, x.destination
    FROM eps LEFT JOIN {endpoints} AS x ON x.id = eps.endpoint_id
    WHERE x.id IS NULL
       OR x.destination <> (SELECT d.destination FROM {deliveries} AS d
                            WHERE d.endpoint_id = eps.endpoint_id AND d.status = 'pending'
                            ORDER BY d.run_after, d.id LIMIT 1)
),
orphaned AS (
    UPDATE {deliveries} AS d
    SET status = 'cancelled', finished_at = now(), locked_by = NULL, locked_until = NULL,
        last_error = CASE WHEN s.destination IS NULL
                          THEN 'endpoint ' || d.endpoint_id || ' was deleted'
                          ELSE 'endpoint ' || d.endpoint_id || ' moved to destination '
                               || quote_literal(s.destination) END
    FROM stale AS s
    -- Uncorrelated, so evaluated once: without a stale endpoint nothing below is read.
    WHERE EXISTS (SELECT 1 FROM stale)
      AND d.endpoint_id = s.endpoint_id AND d.status = 'pending'
      AND (s.destination IS NULL OR s.destination <> d.destination)
    RETURNING d.id
),
locked AS (
    -- Another relay may have claimed a row since this statement's snapshot: the lock
    -- re-reads it and the status check drops it. Written so that the planner finds the rows
    -- by id (the primary key) rather than through the partial claim index, which it would
    -- otherwise read whole for the ids.
    SELECT d.id FROM {deliveries} AS d
    WHERE d.id = ANY(ARRAY(SELECT id FROM picked)) AND (d.status = 'pending') IS TRUE
    ORDER BY d.id
    FOR UPDATE SKIP LOCKED
),
claimed AS (
    UPDATE {deliveries} AS d
    SET status = 'running', locked_by = $4, locked_until = now() + make_interval(secs => $8),
        claims = d.claims + 1
    WHERE d.id = ANY(ARRAY(SELECT id FROM locked))
    RETURNING d.id, d.event_id, d.endpoint_id, d.destination, d.attempts, d.claims, d.replay
)
SELECT c.id, c.event_id, c.endpoint_id, c.destination, c.attempts, c.claims, c.replay,
       o.id IS NOT NULL AS found, o.payload, o.content_type, o.headers::text AS headers,
       extract(epoch FROM o.created_at)::float8 AS created_at,
       e.url, e.secret, CASE WHEN e.previous_secret_until > now() THEN e.previous_secret END
           AS previous_secret, e.rate_limit, o.event_type, e.tenant, e.event_types,
       o.tenant AS event_tenant
FROM claimed AS c
JOIN {endpoints} AS e ON e.id = c.endpoint_id
LEFT JOIN {table} AS o ON o.id = c.event_id
UNION ALL
SELECT -1, (SELECT count(*) FROM orphaned), CASE
           WHEN (SELECT count(*) FROM picked) >= $3 THEN (SELECT max(endpoint_id) FROM picked)
           WHEN (SELECT count(*) FROM eps) >= $6
               THEN (SELECT endpoint_id FROM eps ORDER BY n DESC LIMIT 1)
       END,
       NULL, 0, 0, false, false, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL
"""

# The outcomes of deliveries, in one statement: each delivery still held under its claim's
# token ($2) is recorded, as RECORD does for events, and every attempt made ($4 counted = 1)
# is logged, whether or not its delivery was still held: the request was sent. A try that
# sent nothing ($4 = 2: the relay could not open the endpoint's secret) is logged too, but
# not counted among the delivery's attempts. Returns the
# (id, token) pairs recorded.
DELIVERY_RECORD = """
WITH u AS (
    SELECT * FROM unnest($1::bigint[], $2::int[], $3::text[], $4::int[], $5::float8[],
                         $6::text[], $7::int[], $8::bigint[], $9::bigint[], $10::float8[],
                         $11::text[], $12::bool[])
         AS u(id, token, status, counted, delay, error, http_status, event_id, endpoint_id,
              duration_ms, response, replay)
),
done AS (
    UPDATE {deliveries} AS d
    SET status = u.status,
        attempts = d.attempts + CASE WHEN u.counted = 1 THEN 1 ELSE 0 END,
        run_after = CASE WHEN u.status = 'pending'
                         THEN now() + make_interval(secs => u.delay) ELSE d.run_after END,
        last_error = CASE WHEN u.status = 'delivered' THEN NULL
                          ELSE COALESCE(u.error, d.last_error) END,
        last_status = COALESCE(u.http_status, d.last_status),
        finished_at = CASE WHEN u.status <> 'pending' THEN now() END,
        replay = u.status = 'pending' AND u.counted <> 1 AND d.replay,
        locked_by = NULL,
        locked_until = NULL
    FROM u
    WHERE d.id = u.id AND d.claims = u.token AND d.status = 'running' AND d.locked_by = $13
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
"""

DELIVERY_HEARTBEAT = _heartbeat("{deliveries}", "d")

DELIVERY_RELEASE = _release("{deliveries}", "d")

# Deliveries whose relay stopped heartbeating: back to pending, an attempt counted (the request
# may have been sent), or failed at their destination's attempt limit ($3/$4; $1 otherwise).
DELIVERY_REAP = """
WITH expired AS (
    SELECT id FROM {deliveries}
    WHERE status = 'running' AND locked_until < now()
    ORDER BY locked_until
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
{limits},
judged AS (
    SELECT d.id, d.attempts + 1 >= coalesce(
               (SELECT l.max_attempts FROM limits AS l WHERE l.destination = d.destination), $1)
           AS spent
    FROM {deliveries} AS d JOIN expired USING (id)
)
UPDATE {deliveries} AS d
SET status = CASE WHEN j.spent THEN 'failed' ELSE 'pending' END,
    {reaped}
    finished_at = CASE WHEN j.spent THEN now() END,
    locked_by = NULL,
    locked_until = NULL
FROM judged AS j
WHERE d.id = j.id
RETURNING d.id, d.status
""".replace("{limits}", _LIMITS).replace("{reaped}", _reaped("d"))

# An endpoint's health after a batch of attempts ($2: whether any succeeded): the first failure
# after a success starts failing_since, a success clears it. Returns for how long each endpoint
# has been failing (NULL: it is not).
ENDPOINT_HEALTH = """
UPDATE {endpoints} AS e
SET last_success_at = CASE WHEN h.ok THEN now() ELSE e.last_success_at END,
    failing_since = CASE WHEN h.ok THEN NULL ELSE coalesce(e.failing_since, now()) END
FROM (SELECT * FROM unnest($1::bigint[], $2::bool[]) AS h(id, ok) ORDER BY id) AS h
WHERE e.id = h.id
RETURNING e.id, extract(epoch FROM now() - e.failing_since)::float8 AS failing_for
"""

# Disables an endpoint ($1) with a reason ($2): at once ($3 NULL, a 410 Gone), or if it has
# been failing for at least $3 seconds. Only an enabled endpoint; returns its id if it did.
ENDPOINT_DISABLE = """
UPDATE {endpoints}
SET enabled = false, disabled_at = now(), disabled_reason = $2, updated_at = now()
WHERE id = $1 AND enabled
  AND ($3::float8 IS NULL OR failing_since <= now() - make_interval(secs => $3))
RETURNING id
"""

# An endpoint's circuit as this relay's breaker sees it ($2: open; $3 seconds until its
# probe), for `status`: written when it opens and when it closes again.
ENDPOINT_CIRCUIT = """
UPDATE {endpoints} AS e
SET circuit_open_until = CASE WHEN c.open THEN now() + make_interval(secs => c.secs) END
FROM (SELECT * FROM unnest($1::bigint[], $2::bool[], $3::float8[]) AS c(id, open, secs)
      ORDER BY id) AS c
WHERE e.id = c.id
"""

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
