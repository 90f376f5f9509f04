"""Recording the outcomes of a batch of events in one statement: every kind of outcome, or plain
deliveries only, and each of these with retention = 0 (delivered rows deleted as recorded)."""

from __future__ import annotations

from relay.db.queries.leases import _held
from relay.db.queries.retention import _OPEN_DELIVERY


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
