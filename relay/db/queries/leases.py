"""The leases of claimed rows: the fence every outcome, heartbeat and release goes through, the
heartbeat, the release on a clean stop, and the reaper's statements for leases that expired."""

from __future__ import annotations


def _held(row: str, pairs: str, relay: str) -> str:
    """The fence of every outcome, heartbeat and release: row ``row`` matched to its (id, token)
    pair in ``pairs``, still running under this relay (``relay``) and that very claim."""
    return (
        f"{row}.id = {pairs}.id AND {row}.claims = {pairs}.token AND {row}.status = 'running' "
        f"AND {row}.locked_by = {relay}"
    )


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
