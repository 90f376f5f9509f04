"""Statements live in ``.sql`` files beside the code that runs them (issue #28,
docs/development.md): the loader (outbox/sql.py) reads them byte for byte, every file is
loaded by one module that names each of its statements, and no module of `outbox/` or `relay/`
holds an SQL statement as a string literal. What still does today is listed with its count of
literals, which may only shrink (as tests/test_sizes.py's lists); nothing new joins the list."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

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

# Move these into .sql files (the next steps of issue #28); the figure is the most SQL
# literals each may hold meanwhile.
SQL_LITERALS = {
    "relay/db/queries/checks.py": 4,
    "relay/db/queries/claim.py": 4,
    "relay/db/queries/deliveries.py": 7,
    "relay/db/queries/gauges.py": 2,
    "relay/db/queries/leases.py": 5,
    "relay/db/queries/ordered.py": 8,
    "relay/db/queries/outcomes.py": 3,
    "relay/db/queries/registry.py": 8,
    "relay/db/queries/retention.py": 7,
    "relay/db/snapshots.py": 2,
    "relay/pipeline/listener.py": 1,
    "relay/tools/bench/common.py": 11,
    "relay/tools/bench/console.py": 4,
    "relay/tools/bench/drain.py": 4,
    "relay/tools/bench/fanout.py": 3,
    "relay/tools/bench/fanout_load.py": 3,
    "relay/tools/bench/fanout_sql.py": 10,
    "relay/tools/bench/history.py": 1,
    "relay/tools/bench/simple.py": 2,
    "relay/tools/bench/steady.py": 2,
    "relay/tools/demo.py": 4,
}


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


def over(counts: dict[str, int], allowed: dict[str, int]) -> list[str]:
    """What breaks the rule: SQL literals in a module not listed, or more than listed; listed
    while it has none (take it off the list), or fewer than listed (lower the figure)."""
    problems = [
        f"{name}: {n} SQL literals (statements go in a .sql file beside it)"
        for name, n in counts.items()
        if n > allowed.get(name, 0)
    ]
    for name, cap in allowed.items():
        n = counts.get(name, 0)
        if n == 0:
            problems.append(f"{name}: listed at {cap} SQL literals, now 0: take it off the list")
        elif n < cap:
            problems.append(f"{name}: listed at {cap} SQL literals, now {n}: list it at {n}")
    return sorted(problems)


def test_no_sql_literal_outside_the_sql_files() -> None:
    counts = {str(p.relative_to(ROOT)): len(sql_literals(p.read_text())) for p in sources()}
    assert not over({name: n for name, n in counts.items() if n}, SQL_LITERALS)


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
    assert over({"a.py": 1}, {}) == [
        "a.py: 1 SQL literals (statements go in a .sql file beside it)"
    ]
    assert over({"a.py": 3}, {"a.py": 2}) == [
        "a.py: 3 SQL literals (statements go in a .sql file beside it)"
    ]
    assert over({"a.py": 2}, {"a.py": 2}) == []
    assert over({"a.py": 1}, {"a.py": 2}) == ["a.py: listed at 2 SQL literals, now 1: list it at 1"]
    assert over({}, {"gone.py": 2}) == [
        "gone.py: listed at 2 SQL literals, now 0: take it off the list"
    ]


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
    # A confirmed purge keeps what the relay's purge keeps (relay/db/queries/retention.py).
    for purge in (queries.PURGE_SELECTED_DELIVERED, queries.PURGE_SELECTED_FINISHED):
        assert "  AND NOT " + relay_queries._OPEN_DELIVERY + "\nORDER BY" in purge


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
