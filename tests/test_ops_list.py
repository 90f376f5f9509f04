"""`outbox-relay list` and admin.list_rows against a real database: filters, keyset pages,
validation, the text and JSON forms, and the plans that keep it fast on a large table."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import asyncpg
import pytest
from click.testing import CliRunner, Result

from outbox.dburl import to_asyncpg_dsn
from relay.cli import main
from relay.ops import admin
from relay.ops.admin import AdminError
from tests.test_ops_cli import sql

ROW_KEYS = {
    "id",
    "destination",
    "key",
    "tenant",
    "event_type",
    "status",
    "attempts",
    "created_at",
    "run_after",
    "delivered_at",
    "last_error",
}


def cli(db_url: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["list", "--database-url", db_url, *args])


def cli_json(db_url: str, *args: str) -> Any:
    res = cli(db_url, *args, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def add(
    db_url: str,
    destination: str,
    status: str = "pending",
    *,
    n: int = 1,
    key: str | None = None,
    tenant: str | None = None,
    event_type: str | None = None,
    error: str | None = None,
) -> list[int]:
    rows = sql(
        db_url,
        """
        INSERT INTO outbox (destination, key, tenant, event_type, payload, status, last_error,
                            attempts, delivered_at)
        SELECT %s, %s, %s, %s, '\\x00', %s, %s, 2,
               CASE WHEN %s = 'delivered' THEN now() END
        FROM generate_series(1, %s)
        RETURNING id
        """,
        destination,
        key,
        tenant,
        event_type,
        status,
        error,
        status,
        n,
    )
    return sorted(r[0] for r in rows)


def ids(page: dict[str, Any]) -> list[int]:
    return [r["id"] for r in page["rows"]]


def with_conn(db_url: str, action: Callable[[asyncpg.Connection], Awaitable[Any]]) -> Any:
    async def go() -> Any:
        conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
        try:
            return await action(conn)
        finally:
            await conn.close()

    return asyncio.run(go())


def list_rows(db_url: str, **kw: Any) -> dict[str, Any]:
    result: dict[str, Any] = with_conn(db_url, lambda c: admin.list_rows(c, "public", **kw))
    return result


# --- what it returns ------------------------------------------------------------------------


def test_rows_come_newest_first_with_every_field(db_url: str) -> None:
    [delivered] = add(db_url, "orders", "delivered", key="k1", tenant="acme", event_type="a.b")
    [failed] = add(db_url, "emails", "failed", error="HTTP 500")
    [pending] = add(db_url, "orders")

    page = list_rows(db_url)
    assert ids(page) == [pending, failed, delivered]
    assert page["next_before_id"] is None
    assert all(set(r) == ROW_KEYS for r in page["rows"])
    d = page["rows"][2]
    assert (d["destination"], d["key"], d["tenant"], d["event_type"]) == (
        "orders",
        "k1",
        "acme",
        "a.b",
    )
    assert (d["status"], d["attempts"], d["last_error"]) == ("delivered", 2, None)
    for field in ("created_at", "run_after", "delivered_at"):
        assert datetime.fromisoformat(d[field]).tzinfo is not None
    assert page["rows"][0]["delivered_at"] is None
    assert page["rows"][1]["last_error"] == "HTTP 500"
    # The command says the same, as JSON.
    assert cli_json(db_url) == json.loads(json.dumps(page))


def test_every_filter_narrows_and_they_combine(db_url: str) -> None:
    orders_failed = add(db_url, "orders", "failed", n=3, key="k1", error="RequestTimedOut: broker")
    [orders_size] = add(db_url, "orders", "failed", key="k2", error="MessageSizeTooLarge")
    [emails_failed] = add(db_url, "emails", "failed", tenant="acme", error="HTTP 500 Timedout")
    acme = add(db_url, "emails", "delivered", n=2, tenant="acme", event_type="user.created")
    [other_type] = add(db_url, "emails", "pending", tenant="acme", event_type="user.deleted")
    [running] = add(db_url, "orders", "running", key="k1")
    [skipped] = add(db_url, "orders", "skipped", error="given up")

    def listed(**kw: Any) -> list[int]:
        return sorted(ids(list_rows(db_url, **kw)))

    assert listed(status="failed") == sorted([*orders_failed, orders_size, emails_failed])
    assert listed(status="running") == [running]
    assert listed(status="skipped") == [skipped]
    assert listed(status="delivered") == acme
    assert listed(destination="emails") == sorted([emails_failed, *acme, other_type])
    assert listed(key="k1") == sorted([*orders_failed, running])
    assert listed(tenant="acme") == sorted([emails_failed, *acme, other_type])
    assert listed(event_type="user.created") == acme
    # A plain word matches anywhere, whatever its case; % and _ are LIKE's wildcards.
    assert listed(error_like="timedout") == sorted([*orders_failed, emails_failed])
    assert listed(error_like="HTTP 5__%") == [emails_failed]
    assert listed(error_like="Message%") == [orders_size]
    assert listed(min_id=orders_size, max_id=acme[0]) == [orders_size, emails_failed, acme[0]]
    assert listed(before_id=orders_failed[2]) == orders_failed[:2]
    assert listed(status="failed", destination="orders", key="k1") == orders_failed
    assert listed(status="failed", destination="orders", error_like="size") == [orders_size]
    assert listed(status="pending", tenant="acme", event_type="user.deleted") == [other_type]
    assert listed(status="failed", destination="nowhere") == []
    # The command takes the same filters.
    page = cli_json(db_url, "--status", "failed", "--destination", "orders", "--key", "k1")
    assert sorted(ids(page)) == orders_failed
    page = cli_json(db_url, "--tenant", "acme", "--event-type", "user.created")
    assert sorted(ids(page)) == acme
    page = cli_json(db_url, "--error-like", "timedout", "--min-id", str(orders_failed[1]))
    assert sorted(ids(page)) == [*orders_failed[1:], emails_failed]


# --- pages ----------------------------------------------------------------------------------


def test_keyset_pages_never_skip_or_repeat_a_row(db_url: str) -> None:
    rows = add(db_url, "orders", "failed", n=10, error="x")
    add(db_url, "orders", "delivered", n=5)  # not failed: never listed below

    seen: list[int] = []
    before = None
    pages = 0
    while True:
        page = list_rows(db_url, status="failed", limit=3, before_id=before)
        seen += ids(page)
        pages += 1
        if pages == 1:
            # New rows arrive between pages: they are newer than the keyset, so the next
            # pages neither repeat nor skip a row (OFFSET would shift by them).
            add(db_url, "orders", "failed", n=4, error="x")
        before = page["next_before_id"]
        if before is None:
            break
        assert before == page["rows"][-1]["id"] and len(page["rows"]) == 3
    assert pages == 4  # 3 + 3 + 3 + 1: the last page says there is no next one
    assert seen == sorted(rows, reverse=True)

    # A page that ends exactly at the last row says so: no empty page after it.
    full = list_rows(db_url, status="failed", limit=14)
    assert len(full["rows"]) == 14 and full["next_before_id"] is None
    assert list_rows(db_url, status="failed", limit=13)["next_before_id"] == rows[1]


def test_text_lists_a_page_cuts_long_errors_and_says_how_to_go_on(db_url: str) -> None:
    long_error = "Traceback: " + "x" * 300 + " THE END"
    [first] = add(db_url, "orders", "failed", key="k1", error=long_error)
    later = add(db_url, "orders", "failed", n=2, error="short\nand two lines")

    res = cli(db_url, "--limit", "2")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].split() == [
        "ID",
        "DESTINATION",
        "KEY",
        "STATUS",
        "ATTEMPTS",
        "CREATED",
        "RUN",
        "AFTER",
        "LAST",
        "ERROR",
    ]
    # A line break in an error is shown, escaped, on the row's one line.
    assert lines[1].startswith(str(later[1])) and lines[1].endswith(r"short\nand two lines")
    assert f"--before-id {later[0]}" in lines[-1]

    last = cli(db_url, "--before-id", str(later[0]))
    assert last.exit_code == 0 and last.output.count("\n") == 2  # header and one row
    row = last.output.splitlines()[1]
    assert row.startswith(str(first)) and "k1" in row and "THE END" not in row
    assert row.endswith("…") and len(row.split("Traceback")[1]) < 100
    # JSON has the whole error.
    assert cli_json(db_url, "--before-id", str(later[0]))["rows"][0]["last_error"] == long_error

    none = cli(db_url, "--status", "running")
    assert none.exit_code == 0 and none.output == "no rows match\n"


# --- what it refuses ------------------------------------------------------------------------


def test_bad_arguments_are_clear_errors(db_url: str) -> None:
    res = cli(db_url, "--status", "done")
    assert res.exit_code == 2
    assert "'done' is not one of 'pending', 'running', 'delivered', 'failed', 'skipped'" in (
        res.output
    )
    for limit in ("0", "1001", "many"):
        res = cli(db_url, "--limit", limit)
        assert res.exit_code == 2 and "--limit" in res.output, res.output
    assert cli(db_url, "--limit", "1000").exit_code == 0
    res = cli(db_url, "--before-id", str(2**63))
    assert res.exit_code == 2 and "--before-id" in res.output

    # The function checks them too (the web console calls it directly), before any query.
    with pytest.raises(AdminError, match="pending, running, delivered, failed, skipped"):
        list_rows(db_url, status="done")
    for bad in (0, 1001, True, 2.5):
        with pytest.raises(AdminError, match="limit must be a whole number from 1 to 1000"):
            list_rows(db_url, limit=bad)
    with pytest.raises(AdminError, match="before_id must be a row id"):
        list_rows(db_url, before_id=-1)
    with pytest.raises(AdminError, match="min_id must be a row id"):
        list_rows(db_url, min_id=2**63)


def test_a_default_page_is_50_rows(db_url: str) -> None:
    rows = add(db_url, "orders", n=51)
    page = cli_json(db_url)
    assert ids(page) == sorted(rows, reverse=True)[:50]
    assert page["next_before_id"] == rows[1]


def test_an_unmigrated_schema_or_one_before_0006(db_url: str, empty_db_url: str) -> None:
    res = cli(empty_db_url)
    assert res.exit_code == 1 and "outbox-relay migrate" in res.output
    # Before migration 0006 there is no tenant nor event_type: listed as None, and filtering
    # on them says to migrate.
    [row] = add(db_url, "orders", tenant="acme")
    sql(db_url, "ALTER TABLE outbox DROP COLUMN tenant, DROP COLUMN event_type")
    page = list_rows(db_url, destination="orders")
    assert ids(page) == [row] and page["rows"][0]["tenant"] is None
    with pytest.raises(AdminError, match="migration 0006"):
        list_rows(db_url, tenant="acme")


def test_a_status_cannot_inject_sql(db_url: str) -> None:
    add(db_url, "orders")
    with pytest.raises(AdminError, match="unknown status"):
        list_rows(db_url, status="pending' OR '1'='1")
    # Values are bound, never written into the statement.
    assert list_rows(db_url, destination="orders' OR '1'='1")["rows"] == []


# --- plans: fast on a large table -----------------------------------------------------------


class Recorder:
    """An asyncpg connection that keeps the last `list` statement it ran."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.statement: tuple[str, tuple[Any, ...]] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        if "ORDER BY id DESC" in query:
            self.statement = (query, args)
        return list(await self.conn.fetch(query, *args))


def scans(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The plan's nodes that read the outbox table, each with its index and rows read."""
    found = []
    if plan.get("Relation Name") == "outbox":
        found.append(plan)
    for child in plan.get("Plans", []):
        found += scans(child)
    return found


def explain(db_url: str, **kw: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """list_rows' page, and the outbox scans of its statement, run again under EXPLAIN
    ANALYZE with a generic plan (as a long-lived connection, the web console's, caches it)."""

    async def go(conn: asyncpg.Connection) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        recorder = Recorder(conn)
        page = await admin.list_rows(recorder, "public", **kw)  # type: ignore[arg-type]
        assert recorder.statement is not None
        query, args = recorder.statement
        # A prepared statement, planned for any value of its parameters (EXPLAIN of a query
        # with bound values would plan for those values).
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        await conn.execute(f"PREPARE list_page AS {query}")
        values = [
            await conn.fetchval("SELECT quote_literal($1::text)", a)
            if isinstance(a, str)
            else str(a)
            for a in args
        ]
        execute = "EXECUTE list_page" + (f"({', '.join(values)})" if values else "")
        text = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {execute}")
        return page, scans(json.loads(text)[0]["Plan"])

    result: tuple[dict[str, Any], list[dict[str, Any]]] = with_conn(db_url, go)
    return result


def test_pages_read_an_index_not_the_table(db_url: str) -> None:
    # A table where a walk back along the primary key is the trap: an incident's failed rows
    # are old, and 60 000 delivered rows came after them.
    sql(
        db_url,
        """
        INSERT INTO outbox (destination, key, payload, status, last_error, delivered_at)
        SELECT CASE WHEN g % 10 = 0 THEN 'emails' ELSE 'orders' END,
               'k' || (g % 1000), '\\x00',
               CASE WHEN g BETWEEN 1000 AND 2999 THEN 'failed' ELSE 'delivered' END,
               CASE WHEN g BETWEEN 1000 AND 2999 THEN 'HTTP 503' END,
               CASE WHEN g NOT BETWEEN 1000 AND 2999 THEN now() END
        FROM generate_series(1, 64000) AS g
        """,
    )
    pending = add(db_url, "orders", n=30)
    sql(db_url, "ANALYZE outbox")

    # No filter, or a status most rows have: the newest rows, read back along the primary
    # key, and no further than the page.
    for kw in ({}, {"status": "delivered"}, {"destination": "orders"}):
        page, [scan] = explain(db_url, limit=20, **kw)
        assert scan.get("Index Name") == "outbox_pkey", (kw, scan)
        assert scan["Actual Rows"] <= 21 + 30, (kw, scan)
    page, [scan] = explain(db_url, status="pending", limit=20)
    assert ids(page) == sorted(pending, reverse=True)[:20]
    assert scan["Actual Rows"] <= 30, scan

    # Failed rows: gathered through their partial index, never by walking the 60 000 newer
    # rows; the same with a destination, and for a page further down.
    for kw in (
        {"status": "failed"},
        {"status": "failed", "destination": "emails"},
        {"status": "failed", "before_id": 2000},
    ):
        page, [scan] = explain(db_url, limit=20, **kw)
        assert scan.get("Index Name") == "outbox_finished_idx", (kw, scan)
        assert scan["Actual Rows"] <= 2000, (kw, scan)
        assert len(page["rows"]) == 20 and all(r["status"] == "failed" for r in page["rows"])
    # A key of an open row: the key index (or, for failed rows, the failed rows' own one).
    page, [scan] = explain(db_url, status="failed", destination="orders", key="k7")
    assert scan.get("Index Name") in ("outbox_key_idx", "outbox_failed_key_idx"), scan
    assert scan["Actual Rows"] <= 2, scan

    # A keyset page deep down reads from there, not from the top.
    page, [scan] = explain(db_url, before_id=5000, limit=20)
    assert scan.get("Index Name") == "outbox_pkey" and scan["Actual Rows"] == 21
    assert ids(page) == list(range(4999, 4979, -1))
