"""Statements live in ``.sql`` files beside the code that runs them (issue #28,
docs/development.md): the loader (outbox/sql.py) reads them byte for byte, every file is
loaded by one module that names each of its statements, and no module of `outbox/` or `relay/`
holds an SQL statement, or a piece of one, as a string literal."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import sqlalchemy

from outbox import queries as outbox_queries
from outbox.sql import Binds, SqlFileError, load, parse
from relay.db import queries as relay_queries
from relay.ops import queries, replay_queries

ROOT = Path(__file__).resolve().parents[1]

KEYWORDS = (
    "SELECT|INSERT|UPDATE|DELETE|WITH|CREATE|ALTER|DROP|LOCK|TRUNCATE|VACUUM|ANALYZE|SET|SHOW|"
    "RESET|LISTEN|NOTIFY|BEGIN|COMMIT|ROLLBACK|DO|COPY|EXPLAIN"
)
# A piece of a statement, to be spliced into others (the rule: written out in full).
PIECES = "FROM|WHERE|RETURNING|\\(SELECT"
# A statement or a piece: after blank space and `--` comment lines, an upper-case keyword and
# a space.
STATEMENT = re.compile(r"(?:\s|--[^\n]*(?:\n|$))*(?:" + KEYWORDS + "|" + PIECES + r")\s")


def sources() -> list[Path]:
    return sorted(p for d in ("outbox", "relay") for p in (ROOT / d).rglob("*.py"))


def sql_literals(source: str) -> list[int]:
    """The lines of ``source``'s string literals that are SQL statements, the pieces of
    f-strings included; docstrings are prose."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    # An f-string is one literal: its text up to the first value filled in.
    pieces = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for node in ast.walk(tree):
        head = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
        if (
            isinstance(head, ast.Constant)
            and isinstance(head.value, str)
            and id(node) not in docstrings | pieces
            and STATEMENT.match(head.value)
        ):
            found.append(node.lineno)
    return sorted(found)


def test_no_sql_literal_outside_the_sql_files() -> None:
    found = {
        f"{p.relative_to(ROOT)}:{line}" for p in sources() for line in sql_literals(p.read_text())
    }
    assert not found, f"SQL literals (statements go in a .sql file beside them): {sorted(found)}"


def test_the_check_finds_what_it_is_for() -> None:
    found = sql_literals(
        '"""SELECT the rows: a docstring is prose."""\n'
        'A = "SELECT 1"\n'
        'B = """\n  -- why\nWITH x AS (SELECT 1) SELECT * FROM x\n"""\n'
        'C = f"UPDATE {t} SET a = 1"\n'
        'D = "Select 1"\n'
        'E = "UPDATEs are batched"\n'
        'F = "SELECT"\n'
        "def f():\n"
        '    """DELETE nothing: prose again."""\n'
        '    return "DELETE FROM t"\n'
    )
    assert found == [2, 3, 7, 13]


# --- the files and the modules that load them ----------------------------------------------


def loaders() -> dict[Path, list[tuple[str, Binds]]]:
    """Every ``.sql`` file a module loads (``load("relay.ops", "queries.sql", binds=…)``), and
    that module's name with the binds it asks for."""
    found: dict[Path, list[tuple[str, Binds]]] = {}
    for p in sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "load"
                and all(isinstance(a, ast.Constant) for a in node.args)
            ):
                package, filename = (a.value for a in node.args if isinstance(a, ast.Constant))
                binds = next(k.value for k in node.keywords if k.arg == "binds")
                assert isinstance(binds, ast.Constant), f"{p}: binds= is written out"
                sql_file = ROOT.joinpath(*package.split("."), filename)
                module = p.relative_to(ROOT).with_suffix("")
                found.setdefault(sql_file, []).append((".".join(module.parts), binds.value))
    return found


# A file a module loads both ways (a statement SQLAlchemy and asyncpg run alike but for their
# binds, outbox/inbox.sql) names statement x as X_SA and X_PG, or X where they are alike.
DRIVER = {"named": "_SA", "numbered": "_PG"}


def test_every_sql_file_is_loaded_and_each_statement_named_by_its_module() -> None:
    files = sorted(p for d in ("outbox", "relay") for p in (ROOT / d).rglob("*.sql"))
    loaded = loaders()
    assert sorted(loaded) == files
    for sql_file, modules in loaded.items():
        for module_name, binds in modules:
            module = importlib.import_module(module_name)
            both = {b for m, b in modules if m == module_name} == {"named", "numbered"}
            for name, text in parse(sql_file.read_text(), str(sql_file), binds).items():
                attr = name.upper()
                if both and hasattr(module, attr + DRIVER[binds]):
                    attr += DRIVER[binds]
                assert getattr(module, attr, None) == text, (module_name, name, binds)


# The pieces the statements once were composed of in Python, each now written out in every
# statement that holds it: they must stay alike.
TAKES = (
    "coalesce((e.tenant IS NULL OR e.tenant = o.tenant)\n"
    "             AND (cardinality(e.event_types) = 0 OR o.event_type = ANY(e.event_types)),\n"
    "             false)"
)
WINDOW = (
    "\nWHERE d.endpoint_id = $1 AND d.created_at >= now() - make_interval(secs => $2)\n"
    "  AND d.status = ANY($3::text[])\n"
)
WINDOW_WITHIN = (
    "\nWHERE d.endpoint_id = $1\n"
    "  AND d.created_at >= coalesce($5::timestamptz, now()) - make_interval(secs => $2)\n"
    "  AND d.status = ANY($3::text[])\n"
    "  AND ($4::bigint IS NULL OR d.id <= $4::bigint)\n"
)
FAILED_MATCHING = (
    "\nFROM {table}\nWHERE status = 'failed'\n"
    "  AND ($1::text[] IS NULL OR destination = ANY($1::text[]))\n"
    "  AND ($2::bigint[] IS NULL OR id = ANY($2::bigint[]))\n"
    "  AND ($3::timestamptz IS NULL OR created_at >= $3::timestamptz)\n"
    "  AND ($4::text IS NULL OR last_error ILIKE $4::text)\n"
    "  AND ($5::bigint IS NULL OR id <= $5::bigint)\n"
)
SELECTION = (
    "\nSELECT count(*) AS rows, coalesce(max(id), 0) AS max_id,\n"
    "       coalesce(sum(hashint8extended(id, 0)::numeric), 0)::text AS digest, now() AS at\n"
)


def test_the_pieces_statements_share_are_written_alike() -> None:
    r = replay_queries
    assert [s.count(TAKES) for s in (r.REPLAY_EVENT, r.REPLAY_ENDPOINT_PREVIEW)] == [1, 1]
    assert [s.count(TAKES) for s in (r.REPLAY_ENDPOINT, r.REPLAY_ENDPOINT_WITHIN)] == [2, 2]
    # replay_endpoint_within is replay_endpoint bounded to a preview's selection, nothing more.
    assert r.REPLAY_ENDPOINT.count(WINDOW) == 2 and r.REPLAY_ENDPOINT_PREVIEW.count(WINDOW) == 1
    assert r.REPLAY_ENDPOINT.replace(WINDOW, WINDOW_WITHIN) == r.REPLAY_ENDPOINT_WITHIN
    assert r.REPLAY_ENDPOINT_SELECTION.endswith(WINDOW_WITHIN)
    assert queries.RETRY_SELECTION == SELECTION + FAILED_MATCHING
    assert FAILED_MATCHING in queries.RETRY_PREVIEW and FAILED_MATCHING in queries.RETRY
    assert queries.PURGE_SELECTION.startswith(SELECTION + "\nFROM {table}\n")
    # A confirmed purge keeps what the relay's purge keeps (relay/db/queries/retention.sql).
    for purge in (queries.PURGE_SELECTED_DELIVERED, queries.PURGE_SELECTED_FINISHED):
        assert "  AND NOT " + OPEN_DELIVERY + "\nORDER BY" in purge


# The relay's own statements (relay/db/queries/*.sql), as their pieces were in Python: the test
# of an open delivery (retention.sql), a fresh row and a claim's last step (claim.sql), a step
# of the ordered walk (ordered.sql), the fence of held rows, the heartbeat, the release and what
# a reap sets (leases.sql), the lists recording outcomes (outcomes.sql), the rows nobody serves
# (registry.sql) and a relay that claims as an owner (ordered.sql).
OPEN_DELIVERY = (
    "(SELECT EXISTS (\n"
    "          SELECT 1 FROM {deliveries} AS d\n"
    "          WHERE d.event_id = o.id AND d.status IN ('pending', 'running')))"
)
FRESH = "status = 'pending' AND claims = 0 AND run_after <= created_at"
FRESH_O = "o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at"
LATE = (
    "\nlate AS (\n"
    "    SELECT id, run_after FROM {table}\n"
    f"    WHERE destination = $1 AND {FRESH} AND id > $7::bigint AND id <= $5::bigint\n"
    "      AND run_after <= now()\n"
    "    ORDER BY id\n"
    "    LIMIT $2\n"
    "    FOR UPDATE SKIP LOCKED\n"
    "),"
)
LATE_UNION = "SELECT * FROM late UNION ALL "
LATE_REST = (
    ", coalesce(\n"
    "           (SELECT min(o.id) - 1 FROM {table} AS o\n"
    f"            WHERE o.destination = $1 AND {FRESH_O}\n"
    "              AND o.id > $7::bigint AND o.id <= $5::bigint\n"
    "              AND o.id NOT IN (SELECT c.id FROM chosen AS c)),\n"
    "           n.cursor)"
)
WALK_STEP = re.compile(
    r"\(SELECT o\.key, o\.id, o\.status, o\.run_after, (?:false AS wrapped|false|true) "
    r"FROM \{table\} AS o\n"
    r"         WHERE [^()]*(?:\([^()]*\)[^()]*)*\n"
    r"           AND o\.status IN \('pending', 'failed'\)\n"
    r"         ORDER BY o\.key, o\.id\n"
    r"         LIMIT 1\)"
)
LIMITS = (
    "limits AS (\n"
    "    SELECT * FROM unnest($3::text[], $4::int[]) AS l(destination, max_attempts)\n"
    ")"
)
OUTCOMES = (
    "unnest($1::bigint[], $2::int[], $3::text[], $4::int[], $5::float8[], $6::text[])\n"
    "     AS u(id, token, status, counted, delay, error)"
)
RECORD_CLAIMS = (
    "-- Unchanged (the WHERE demands it), and written so that a trigger auditing the table can\n"
    "    -- tell which claim an outcome belongs to (the fault suite counts outcomes recorded"
    " over a\n"
    "    -- newer claim that way).\n"
    "    claims = u.token,"
)
UNSERVED = (
    "\nWHEN status = 'pending' AND NOT (destination = ANY($1::text[]))\n"
    "  AND NOT EXISTS (SELECT 1 FROM {relays} AS r\n"
    "                  WHERE r.seen_at > now() - make_interval(secs => $2)\n"
    "                    AND {table}.destination = ANY(r.destinations))\n"
)
OWNER_CAPABLE = "('ordered-owner' = ANY(features) AND features_at IS NOT DISTINCT FROM seen_at)"


def mark_running(rows: str) -> str:
    """Every claim's last step: the rows of CTE ``rows`` marked running under this relay's
    lease ($3, $4 seconds), the fencing token taken, returned as relay.db.envelopes reads them."""
    return (
        "claimed AS (\n"
        "    UPDATE {table} AS o\n"
        "    SET status = 'running', locked_by = $3,"
        " locked_until = now() + make_interval(secs => $4),\n"
        "        claims = o.claims + 1\n"
        f"    WHERE o.id = ANY(ARRAY(SELECT id FROM {rows}))\n"
        "    RETURNING o.id, o.destination, o.key, o.payload, o.content_type,"
        " o.headers::text AS headers,\n"
        "              o.attempts, extract(epoch FROM o.created_at)::float8 AS created_at,"
        " o.claims,\n"
        "              o.event_type\n"
        ")"
    )


def held(row: str, pairs: str, relay: str) -> str:
    """The fence of every outcome, heartbeat and release: row ``row`` matched to its (id,
    token) pair in ``pairs``, still running under this relay (``relay``) and that very claim."""
    return (
        f"{row}.id = {pairs}.id AND CASE WHEN {row}.claims = {pairs}.token "
        f"AND {row}.status = 'running' AND {row}.locked_by = {relay} THEN true END"
    )


DELIVERIES = ("{deliveries}", "d")


def heartbeat(table: str, row: str) -> str:
    return (
        f"\nUPDATE {table} AS {row} SET locked_until = now() + make_interval(secs => $4)\n"
        "FROM unnest($1::bigint[], $2::int[]) AS u(id, token)\n"
        f"WHERE {held(row, 'u', '$3')}\n"
        f"RETURNING {row}.id\n"
    )


def release(table: str, row: str, run_after: str = ", run_after = now()") -> str:
    return (
        f"\nUPDATE {table} AS {row}\n"
        f"SET status = 'pending', locked_by = NULL, locked_until = NULL{run_after}\n"
        "FROM unnest($2::bigint[], $3::int[]) AS u(id, token)\n"
        f"WHERE {held(row, 'u', '$1')}\n"
    )


def reaped(row: str) -> str:
    """What reap and delivery_reap set on a row whose lease expired."""
    return (
        f"attempts = {row}.attempts + 1,\n"
        "    run_after = now(),\n"
        f"    last_error = 'lease expired: relay ' || coalesce({row}.locked_by, '?')\n"
        "                 || ' stopped before recording an outcome',"
    )


def outcome_set(claims: str) -> str:
    """record's SET list, but for its ``claims`` line."""
    return (
        "status = u.status,\n"
        "    attempts = o.attempts + u.counted,\n"
        "    run_after = CASE WHEN u.status = 'pending'\n"
        "                     THEN now() + make_interval(secs => u.delay) ELSE o.run_after END,\n"
        "    last_error = COALESCE(u.error, o.last_error),\n"
        "    delivered_at = CASE WHEN u.status = 'delivered' THEN now() END,\n"
        "    finished_at = CASE WHEN u.status <> 'pending' THEN now() END,\n"
        f"    {claims}\n"
        "    locked_by = NULL,\n"
        "    locked_until = NULL"
    )


def delivered_set(extra: str = "") -> str:
    """record_delivered's SET list; ``extra``: lines before its ``claims`` line."""
    return (
        "status = 'delivered',\n"
        "    attempts = o.attempts + 1,\n"
        "    delivered_at = now(),\n"
        "    finished_at = now(),\n"
        f"    {extra}claims = u.token,  -- unchanged; see record\n"
        "    locked_by = NULL,\n"
        "    locked_until = NULL"
    )


def indented(text: str) -> str:
    """``text`` four more spaces in, but for its first line (it follows a keyword)."""
    return text.replace("\n", "\n    ")


def test_the_claims_pieces_are_written_alike() -> None:
    q = relay_queries
    claims = (q.CLAIM, q.CLAIM_FRESH, q.FRESH_BELOW, q.CLAIM_OWNED)
    assert [s.count(FRESH) for s in claims] == [2, 1, 1, 1]
    assert [s.count(FRESH_O) for s in (q.CLAIM, q.CLAIM_FRESH)] == [2, 1]
    assert [s.count(mark_running("chosen")) for s in (q.CLAIM, q.CLAIM_FRESH)] == [1, 1]
    assert [s.count(mark_running("locked")) for s in (q.CLAIM_ORDERED, q.CLAIM_OWNED)] == [1, 1]
    # claim_fresh is claim without the reads of late commits, nothing more.
    assert [q.CLAIM.count(piece) for piece in (LATE, LATE_UNION, LATE_REST)] == [1, 1, 1]
    assert q.CLAIM.replace(LATE, "").replace(LATE_UNION, "").replace(LATE_REST, "") == (
        q.CLAIM_FRESH
    )
    # The ordered walk: its first step's four branches and each further step's four.
    assert len(WALK_STEP.findall(q.CLAIM_ORDERED)) == 8
    assert q.CLAIM_ORDERED.count("(SELECT o.key, o.id, o.status, o.run_after, ") == 8


def test_the_look_reads_past_seen_as_the_delivery_claim_does() -> None:
    """DELIVERY_LOOK stands in for a claim that would find nothing: its read of the fresh
    deliveries past :seen, and the ids' epoch, are the claim's and the floors' own."""
    q = relay_queries

    def unbound(sql: str) -> str:
        return re.sub(r"\$\d+", "$", sql)

    look = unbound(q.DELIVERY_LOOK)
    read = look[look.index("past AS MATERIALIZED (") : look.index("\nSELECT DISTINCT")]
    assert len(read) > 1000 and read + ",\n" in unbound(q.DELIVERY_CLAIM)
    epoch = look[look.index("(SELECT pg_relation_filenode(") :].rstrip()
    assert epoch in q.DELIVERY_FLOORS and epoch in q.DELIVERY_CLAIM


def test_the_lease_fences_are_written_alike() -> None:
    q = relay_queries
    # The events' heartbeat and release and the deliveries', alike but for the table.
    for written, rows in ((q.HEARTBEAT, ("{table}", "o")), (q.DELIVERY_HEARTBEAT, DELIVERIES)):
        assert written == heartbeat(*rows)
    assert release("{table}", "o") == q.RELEASE
    # A released delivery keeps its run_after: its place in its endpoint's queue.
    assert release(*DELIVERIES, run_after="") == q.DELIVERY_RELEASE
    fenced = {
        "FAN_OUT": [("o", "u", "$3")],
        "RECORD": [("o", "u", "$7")],
        "RECORD_DELIVERED": [("o", "u", "$3")],
        "RECORD_DELETING": [("o", "g", "$7")],
        "RECORD_DELIVERED_DELETING": [("o", "g", "$3"), ("o", "u", "$3")],
    }
    for name, fences in fenced.items():
        for fence in fences:
            assert getattr(q, name).count("WHERE " + held(*fence) + "\n") == 1, (name, fence)
    # record_deleting's kept rows: the fence, with the delivered ones an open delivery keeps.
    kept = held("o", "u", "$7").split(" AND ", 1)[1]
    assert q.RECORD_DELETING.count("\n      AND " + kept + "\n") == 1
    for reap, row in ((q.REAP, "o"), (q.DELIVERY_REAP, "d")):
        assert reap.count(LIMITS) == 1 and reap.count("    " + reaped(row) + "\n") == 1


def test_the_outcome_records_are_written_alike() -> None:
    q = relay_queries
    assert q.RECORD.count(f"SET {outcome_set(RECORD_CLAIMS)}\nFROM {OUTCOMES}\nWHERE ") == 1
    deleting = outcome_set("claims = u.token,  -- unchanged; see record")
    assert (
        q.RECORD_DELETING.count(
            f"SET {indented(deleting)}\n    FROM {indented(OUTCOMES)}\n    WHERE "
        )
        == 1
    )
    assert q.RECORD_DELIVERED.count(f"SET {delivered_set()}\nFROM unnest(") == 1
    assert q.RECORD_DELIVERED_DELETING.count(f"SET {indented(delivered_set())}\n") == 1
    no_match = "last_error = CASE WHEN c.n IS NULL THEN $4::text ELSE o.last_error END,\n    "
    assert q.FAN_OUT.count(f"SET {indented(delivered_set(no_match))}\n") == 1
    # Never an event a delivery still needs: whoever deletes events keeps those.
    # The records read the event's id from its (id, token) pair (outcomes.sql says why).
    for name in ("RECORD_DELETING", "RECORD_DELIVERED_DELETING"):
        written = getattr(q, name)
        assert written.count(OPEN_DELIVERY.replace("o.id", "g.id")) == 1, name
        assert written.count(OPEN_DELIVERY.replace("o.id", "u.id")) == 1, name
    deleting_events = {
        "PURGE_DELIVERED": 1,
        "PURGE_FINISHED": 1,
        "DELETE_LOCKED": 1,
        "RETENTION_DELIVERED": 1,
    }
    assert {name: getattr(q, name).count(OPEN_DELIVERY) for name in deleting_events} == (
        deleting_events
    )
    for purge in (q.PURGE_DELIVERED, q.PURGE_FINISHED):
        assert "  AND NOT " + OPEN_DELIVERY + "\nORDER BY" in purge


def test_the_registrys_pieces_are_written_alike() -> None:
    q = relay_queries
    assert q.FAIL_UNKNOWN_DESTINATIONS.count(UNSERVED) == 1
    assert [s.count("AND NOT " + OWNER_CAPABLE) for s in (q.UNOWNED_PEERS, q.CLAIM_OWNED)] == [
        1,
        1,
    ]


# The endpoints API's pieces (outbox/endpoints.sql): the columns its statements return, and
# whether a secret is stored encrypted, which a secret in clear is tested against.
ENDPOINT_COLUMNS = (
    "\nid, destination, url, tenant, event_types, secret, previous_secret, previous_secret_until,\n"
    "rate_limit, description, enabled, disabled_reason, disabled_at, failing_since,\n"
    "last_success_at, created_at, updated_at\n"
)
HOLDS_SEALED = (
    "EXISTS (SELECT 1 FROM {endpoints}\n"
    "        WHERE secret LIKE 'enc:%' OR previous_secret LIKE 'enc:%')"
)


def test_the_endpoint_statements_write_their_pieces_alike() -> None:
    q = outbox_queries
    for returning in (
        q.ENDPOINT_CREATE,
        q.ENDPOINT_UPDATE,
        q.ENDPOINT_DISABLE,
        q.ENDPOINT_ENABLE,
        q.ENDPOINT_ROTATE,
    ):
        assert returning.endswith("\nRETURNING" + ENDPOINT_COLUMNS)
    assert q.ENDPOINT_GET.startswith("SELECT" + ENDPOINT_COLUMNS + "FROM {endpoints} ")
    assert q.ENDPOINT_LIST.startswith("SELECT" + ENDPOINT_COLUMNS + "FROM {endpoints}\n")
    assert q.ENDPOINT_HOLDS_SEALED == "SELECT " + HOLDS_SEALED
    assert "\nWHERE CAST(:secret AS text) LIKE 'enc:%' OR NOT " + HOLDS_SEALED in q.ENDPOINT_CREATE
    assert "           AND NOT " + HOLDS_SEALED + "))\n" in q.ENDPOINT_ROTATE


# --- the loader -------------------------------------------------------------------------------


def test_a_statement_is_the_text_under_its_name_and_comments() -> None:
    text = (
        "-- The file's header: comments only.\n"
        "\n"
        "-- name: wrapped\n"
        "-- Why it is written so.\n"
        "-- More of why.\n"
        "\n"
        "SELECT a\n"
        "\n"
        "FROM t  -- the blank line above is the statement's\n"
        "\n"
        "\n"
        "-- name: bare\n"
        "SELECT now()\n"
        "-- name: bare_uncommented\n"
        "-- Why.\n"
        "DELETE FROM t\n"
        "\n"
        "-- name: last\n"
        "-- params: id\n"
        "\n"
        "    -- a comment inside the statement\n"
        "SELECT {table}.x FROM {table} WHERE id = :id"
    )
    assert parse(text) == {
        "wrapped": "\nSELECT a\n\nFROM t  -- the blank line above is the statement's\n",
        "bare": "SELECT now()",
        "bare_uncommented": "DELETE FROM t",
        "last": "\n    -- a comment inside the statement\n"
        "SELECT {table}.x FROM {table} WHERE id = $1\n",
    }
    assert list(parse(text)) == ["wrapped", "bare", "bare_uncommented", "last"]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            "-- name: a\nSELECT 1\n-- name: b\nSELECT 2\n-- name: a\nSELECT 3\n",
            "f.sql:5: statement 'a' is named twice (first at line 1)",
        ),
        ("SELECT 1\n-- name: a\nSELECT 1\n", "f.sql:1: SQL before the first '-- name:' line"),
        ("-- name: a\n-- why\n\n\n-- name: b\nSELECT 1\n", "f.sql:1: statement 'a' has no text"),
        ("-- name: Bad-Name\nSELECT 1\n", "f.sql:1: a name is '-- name: ' then lower-case"),
    ],
)
def test_a_file_that_is_not_statements_is_an_error_saying_where(text: str, error: str) -> None:
    with pytest.raises(SqlFileError, match="^" + re.escape(error)):
        parse(text, "f.sql")


def test_a_file_is_loaded_once_and_a_missing_name_names_the_file() -> None:
    statements = load("relay.ops", "endpoints.sql", binds="numbered")
    assert load("relay.ops", "endpoints.sql", binds="numbered") is statements
    assert sorted(statements) == ["endpoint_deliveries", "endpoint_recent_attempts"]
    with pytest.raises(KeyError, match=r"relay/ops/endpoints.sql has no statement 'nope' \(it"):
        statements["nope"]


# --- found by the review of the first step (each failed before its fix) ---------------------


@pytest.mark.parametrize("char", ["\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u2029"])
def test_a_statement_keeps_every_character_but_the_newlines(char: str) -> None:
    text = f"-- name: a\n\nSELECT 'x{char}y' AS s\n"
    assert parse(text, "f.sql") == {"a": f"\nSELECT 'x{char}y' AS s\n"}


@pytest.mark.parametrize("text", ["", "\n", "-- a header only\n"])
def test_a_file_without_statements_is_said_so(text: str) -> None:
    with pytest.raises(SqlFileError, match=r"f\.sql: no statement"):
        parse(text, "f.sql")


def test_comments_after_a_statement_are_refused() -> None:
    text = (
        "-- name: reset_search_path\nRESET search_path\n-- The migrations':\n\n"
        "-- name: b\nSELECT 1\n"
    )
    with pytest.raises(SqlFileError, match="comment lines after statement 'reset_search_path'"):
        parse(text, "f.sql")


def test_a_file_with_a_byte_order_mark_reads_as_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "bom_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "q.sql").write_bytes("\ufeff-- name: a\nSELECT 1\n".encode())
    monkeypatch.syspath_prepend(str(tmp_path))
    assert dict(load("bom_package", "q.sql", binds="named")) == {"a": "SELECT 1"}


def test_the_check_finds_reset_and_the_pieces_of_statements() -> None:
    source = (
        'RESET_SEARCH_PATH = "RESET search_path"\n'
        '_FAILED_MATCHING = """\nFROM {table}\nWHERE status = \'failed\'\n"""\n'
        '_OPEN_DELIVERY = """(SELECT EXISTS (\n  SELECT 1 FROM {deliveries} AS d))"""\n'
    )
    assert sql_literals(source) == [1, 2, 6]


# --- binds: one style in every file (:name), handed out as asyncpg's $n or as written -------


PARAMS_FILE = (
    "-- name: claim\n"
    "-- params: destination, batch, cursor\n"
    "-- Why: the params line says the order the caller passes values in, whatever the order\n"
    "-- the statement uses them in (:not_a_bind in a comment).\n"
    "\n"
    "SELECT id, ':no' AS \"a:b\", E'\\' :no', $$ :no $$, $q$ :no $q$, x::text /* :no */\n"
    "FROM {table} WHERE id > :cursor::bigint AND destination = :destination -- :no\n"
    "  AND :cursor IS NOT NULL\n"
    "LIMIT :batch\n"
)


def test_binds_are_numbered_in_their_declared_order_and_nothing_else_is_a_bind() -> None:
    assert parse(PARAMS_FILE, "f.sql", "numbered")["claim"] == (
        "\nSELECT id, ':no' AS \"a:b\", E'\\' :no', $$ :no $$, $q$ :no $q$, x::text /* :no */\n"
        "FROM {table} WHERE id > $3::bigint AND destination = $1 -- :no\n"
        "  AND $3 IS NOT NULL\n"
        "LIMIT $2\n"
    )


def test_named_binds_are_left_as_written_for_sqlalchemy() -> None:
    text = "-- name: a\n-- params: id, key\nSELECT CAST(:id AS bigint), :key"
    assert parse(text, "f.sql", "named") == {"a": "SELECT CAST(:id AS bigint), :key"}
    assert parse(text, "f.sql", "numbered") == {"a": "SELECT CAST($1 AS bigint), $2"}


@pytest.mark.parametrize(
    ("text", "binds", "error"),
    [
        ("-- name: a\nSELECT $1", "numbered", "f.sql:1: statement 'a': $1 is a numbered bind"),
        ("-- name: a\nSELECT :x", "named", "f.sql:1: statement 'a' uses :x without declaring"),
        (
            "-- name: a\n-- params: x, y\nSELECT :x",
            "numbered",
            "f.sql:1: statement 'a' declares y in its '-- params:' line but never uses it",
        ),
        (
            "-- name: a\n-- params: x, x\nSELECT :x",
            "named",
            "f.sql:1: statement 'a' declares x twice",
        ),
        ("-- name: a\n-- params: x y\nSELECT :x", "named", "f.sql:1: statement 'a': 'x y' in"),
        (
            "-- name: a\n-- params: x\n-- params: x\nSELECT :x",
            "named",
            "f.sql:1: statement 'a' has two '-- params:' lines",
        ),
        (
            "-- name: a\n-- params: x\nSELECT :x::int",
            "named",
            "f.sql:1: statement 'a': :x:: is not a bind for SQLAlchemy; write CAST(:x AS",
        ),
    ],
)
def test_binds_that_do_not_add_up_are_an_error_saying_where(
    text: str, binds: Binds, error: str
) -> None:
    with pytest.raises(SqlFileError, match="^" + re.escape(error)):
        parse(text, "f.sql", binds)


def test_every_file_declares_its_binds() -> None:
    for sql_file, modules in loaders().items():
        for _, binds in modules:
            parse(sql_file.read_text(), str(sql_file), binds)
        assert not re.search(r"^[^-\n]*\$[0-9]", sql_file.read_text(), re.M), sql_file


# --- where the loader must read a statement as PostgreSQL and text() do (found by a review) ---


def test_a_nested_block_comment_is_one_comment() -> None:
    # PostgreSQL's block comments nest: everything from the first /* to the last */ is one
    # comment. _TOKEN's (?P<block>/\*.*?\*/) ends at the first */, so the rest of the comment
    # is read as SQL: its apostrophe opens a "string" that swallows the first :id, which is
    # left as ":id" in the text asyncpg prepares (a syntax error), while the load passes
    # because :id is used again further on.
    sql = (
        "-- name: a\n"
        "-- params: id\n"
        "SELECT 1 /* see /* the note */ in claim's comment */ FROM t WHERE id = :id\n"
        "   AND note <> 'x' AND other = :id"
    )
    assert parse(sql, "f.sql", "numbered") == {
        "a": "SELECT 1 /* see /* the note */ in claim's comment */ FROM t WHERE id = $1\n"
        "   AND note <> 'x' AND other = $1"
    }


def test_a_nested_block_comment_may_name_a_bind() -> None:
    sql = "-- name: a\nSELECT 1 /* outer /* inner */ about :x */"
    assert parse(sql, "f.sql", "numbered") == {"a": "SELECT 1 /* outer /* inner */ about :x */"}


def test_a_dollar_sign_inside_an_identifier_is_neither_a_bind_nor_a_dollar_quote() -> None:
    # PostgreSQL allows $ in an identifier after its first character (col$1, x$q$): neither
    # is a positional parameter or the start of a dollar-quoted string there.
    assert parse("-- name: a\nSELECT col$1 FROM t", "f.sql") == {"a": "SELECT col$1 FROM t"}
    sql = "-- name: a\n-- params: id\nSELECT x$q$, :id FROM t WHERE y$q$ = :id"
    assert parse(sql, "f.sql", "numbered") == {"a": "SELECT x$q$, $1 FROM t WHERE y$q$ = $1"}


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT 'at :noon' AS s",  # a string literal
        "SELECT 1 AS s  -- see :note",  # a comment inside the text (sent with it)
    ],
)
def test_a_named_statement_is_checked_as_sqlalchemys_text_reads_it(statement: str) -> None:
    # binds="named" promises a statement whose binds do not add up fails the load, and models
    # text()'s reading for :name::type; but text() knows neither strings nor comments: it takes
    # ':noon' and '-- see :note' for binds, and the statement, loaded without an error, fails
    # when run ("A value is required for bind parameter 'noon'").
    sql = f"-- name: a\n{statement}"
    try:
        loaded = parse(sql, "f.sql", "named")["a"]
    except SqlFileError:
        return  # refused at load: what the loader promises
    params = sqlalchemy.text(loaded).compile().params
    assert not params, params


@pytest.mark.parametrize(
    ("statement", "params"),
    [
        ("SELECT (ARRAY[1,2,3])[:lo: :hi]", "lo, hi"),  # :lo followed by a colon: not a bind
        ("SELECT :idé", "id"),  # text() reads \w+, Unicode letters too: the bind is "idé"
    ],
)
def test_a_named_bind_is_one_sqlalchemys_text_reads_as_written(statement: str, params: str) -> None:
    # The other way round from the test above (a review found it): each :name the loader counts
    # must be one text() binds, under the same name, or the statement fails when run.
    sql = f"-- name: a\n-- params: {params}\n{statement}"
    try:
        loaded = parse(sql, "f.sql", "named")["a"]
    except SqlFileError:
        return  # refused at load: what the loader promises
    read = set(sqlalchemy.text(loaded).compile().params)
    assert read == {p.strip() for p in params.split(",")}, read


# The epoch of the ids (FENCE's last column, batches.sql): the file of the id column's
# sequence, read once per statement, the table named by its row's type.
IDS_EPOCH = (
    "(SELECT pg_relation_filenode(pg_get_serial_sequence(pg_typeof(NULL::{table})::text, 'id')"
    "::regclass)::bigint)"
)


# The outcomes' test more (batches.sql, migration 0016): the row written before the claim,
# by its xmin or its created_at; a batch of before 0016 (NULL) fenced as before.
WRITTEN_BEFORE = (
    " AND (b.snapshot_xmax IS NULL OR age(o.xmin) > age(b.snapshot_xmax) "
    "OR o.created_at <= b.created_at)"
)


def batch_fence(relay: str, written_before: bool = True, ids: str = "$1") -> str:
    """The fence of a batch's rows (batches.sql): the row as its claim found it (fresh), in the
    range of its own batch, of the ids' current epoch, and that batch still this relay's; for
    an outcome, the row written before the claim too. Its rows named by id (``ids``, the
    array unnest reads them from) beside the join, for the planner (6a0d3c4)."""
    return (
        f"o.id = u.id AND o.id = ANY({ids}::bigint[]) AND CASE WHEN {FRESH_O} "
        "AND EXISTS (SELECT 1 FROM {batches} AS b "
        f"WHERE b.id = -u.token AND CASE WHEN b.relay = {relay} "
        "AND b.destination = o.destination AND o.id > b.first_id AND o.id <= b.last_id "
        f"AND b.epoch = {IDS_EPOCH}{WRITTEN_BEFORE if written_before else ''} "
        "THEN true END) THEN true END"
    )


def test_the_batch_fences_are_written_alike() -> None:
    q = relay_queries

    def flat(sql: str) -> str:
        return " ".join(sql.split())

    fenced = {  # each fence once per array of ids the statement unnests
        "RECORD_BATCH": ("$7", ["$1"]),
        "RECORD_BATCH_DELIVERED": ("$3", ["$1"]),
        "RECORD_BATCH_DELETING": ("$7", ["$8", "$1"]),
        "RECORD_BATCH_DELIVERED_DELETING": ("$3", ["$1"]),
        "RELEASE_BATCH": ("$1", ["$2"]),
    }
    for name, (relay, arrays) in fenced.items():
        outcome = name != "RELEASE_BATCH"
        sql = flat(getattr(q, name))
        for ids in arrays:
            # The ANY list is the very array the pairs are unnested from.
            assert sql.count(f"unnest({ids}::bigint[],") == 1, (name, ids)
            assert sql.count(batch_fence(relay, outcome, ids)) == 1, (name, ids)
        assert sql.count("o.id = ANY(") == len(arrays), name
    # The release puts a row back untouched whichever it is: no test of when it was written.
    assert "snapshot_xmax" not in q.RELEASE_BATCH
    # The claim keeps the xmax of the snapshot it read the rows with.
    assert "pg_snapshot_xmax(pg_current_snapshot())::xid" in q.CLAIM_BATCH
    # A recorded row is no longer fresh, and was claimed once.
    for name in ("RECORD_BATCH", "RECORD_BATCH_DELIVERED", "RECORD_BATCH_DELETING"):
        assert flat(getattr(q, name)).count("claims = 1 FROM unnest(") >= 1, name
    assert "SET run_after = now(), claims = 1" in q.RELEASE_BATCH
    # A batch of an earlier epoch of the ids puts nothing back; a claim takes fresh rows only
    # on a FENCE reading of the current one.
    assert f"AND e.epoch = {IDS_EPOCH}" in q.REAP_BATCHES
    assert f"AND {IDS_EPOCH} = :epoch::bigint" in q.CLAIM_BATCH.replace("$6", ":epoch")
    assert q.FENCE.rstrip().endswith(IDS_EPOCH)
    # What reap_batches sets is what reap sets, but for the relay's name, read from the batch.
    assert (
        reaped("o").replace("coalesce(o.locked_by, '?')", "e.relay") + "\n    claims = 1,"
        in q.REAP_BATCHES
    )
    assert q.REAP_BATCHES.count(LIMITS) == 1


# The tenant portal's scope (relay/portal/queries.sql): every statement starts with it, and
# reads deliveries only through it, since the endpoint became the tenant's.
MINE = "WITH mine AS (SELECT e.id, e.tenant_since FROM {endpoints} AS e WHERE e.tenant = $1)"
SINCE = "d.created_at >= coalesce(m.tenant_since, '-infinity')"


def test_every_portal_statement_is_scoped_to_the_tenant() -> None:
    from relay.portal import queries as portal

    statements = load("relay.portal", "queries.sql", binds="numbered")
    assert len(statements) >= 5
    for name in statements:
        text = getattr(portal, name.upper())
        head = text.lstrip("\n")
        assert head.startswith(MINE + "\n") or head.startswith(MINE + ",\n"), name
        assert text.count("{deliveries} AS d") == text.count(SINCE), name
        # An event is read only where its own tenant is the caller's.
        held = "(o.tenant = $1 OR (o.id IS NULL AND m.tenant_since IS NULL))"
        assert text.count("{table} AS o") == text.count(held), name
