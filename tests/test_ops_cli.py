"""The operations commands against a real database: status, show, retry, purge, pause, resume."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result

from relay.cli import main
from relay.cli.options import EXIT_CONDITION


def cli(db_url: str, *args: str) -> Result:
    return CliRunner().invoke(main, [args[0], "--database-url", db_url, *args[1:]])


def cli_json(db_url: str, *args: str) -> Any:
    res = cli(db_url, *args, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def sql(db_url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(db_url, autocommit=True) as c:
        cur = c.execute(query, params or None)
        return cur.fetchall() if cur.description else []


def insert(
    db_url: str,
    destination: str,
    status: str = "pending",
    *,
    n: int = 1,
    age: str = "0s",
    run_in: str = "0s",
    error: str | None = None,
    attempts: int = 0,
    locked_by: str | None = None,
    delivered_ago: str | None = None,
    finished_ago: str | None = None,
    payload: bytes = b'{"x":1}',
    content_type: str = "application/json",
    headers: str = "{}",
) -> list[int]:
    rows = sql(
        db_url,
        """
        INSERT INTO outbox (destination, payload, content_type, headers, status, attempts,
                            last_error, locked_by, locked_until, created_at, run_after,
                            delivered_at, finished_at)
        SELECT %s, %s, %s, %s::jsonb, %s, %s, %s, %s,
               CASE WHEN %s::text IS NOT NULL THEN now() + interval '30 s' END,
               now() - %s::interval, now() + %s::interval,
               CASE WHEN %s = 'delivered' THEN now() - coalesce(%s, '0s')::interval END,
               CASE WHEN %s IN ('delivered', 'failed', 'skipped')
                    THEN now() - coalesce(%s, %s, '0s')::interval END
        FROM generate_series(1, %s)
        RETURNING id
        """,
        destination,
        payload,
        content_type,
        headers,
        status,
        attempts,
        error,
        locked_by,
        locked_by,
        age,
        run_in,
        status,
        delivered_ago,
        status,
        finished_ago,
        delivered_ago,
        n,
    )
    return sorted(r[0] for r in rows)


def statuses(db_url: str) -> dict[int, tuple[str, int]]:
    return {r[0]: (r[1], r[2]) for r in sql(db_url, "SELECT id, status, attempts FROM outbox")}


# --- status ---------------------------------------------------------------------------------


def test_status_reports_every_state_per_destination(db_url: str) -> None:
    insert(db_url, "orders", n=3, age="10 min")  # due now
    insert(db_url, "orders", n=2, run_in="1 hour")  # pending, not due
    insert(db_url, "orders", "running", n=4, locked_by="relay-a")
    insert(db_url, "orders", "delivered", n=5)
    insert(db_url, "orders", "failed", n=2, error="boom: broker said no", attempts=25)
    insert(db_url, "orders", "failed", n=1, error="other", attempts=3)
    insert(db_url, "orders", "skipped", n=2, error="given up")
    insert(db_url, "emails", "delivered", n=1)
    assert cli(db_url, "pause", "emails", "--reason", "vendor outage", "--by", "ops").exit_code == 0
    sql(
        db_url,
        """
        INSERT INTO outbox_relays (relay_id, host, pid, version, destinations, seen_at, stopped_at)
        VALUES ('relay-a', 'host-1', 41, '1.0', '{orders}', now(), NULL),
               ('relay-b', 'host-2', 42, '1.0', '{emails,orders}', now() - interval '5 min', NULL),
               ('relay-c', 'host-3', 43, '1.0', '{orders}', now() - interval '1 min', now())
        """,
    )

    data = cli_json(db_url, "status")
    assert [d["destination"] for d in data["destinations"]] == ["emails", "orders"]
    emails, orders = data["destinations"]
    assert emails["paused"]["reason"] == "vendor outage" and emails["paused"]["by"] == "ops"
    assert emails["delivered"] == 1 and emails["pending"] == 0
    assert emails["oldest_pending_age_s"] is None
    assert orders["paused"] is None
    assert {
        k: orders[k] for k in ("pending", "due_now", "running", "delivered", "failed", "skipped")
    } == {
        "pending": 5,
        "due_now": 3,
        "running": 4,
        "delivered": 5,
        "failed": 3,
        "skipped": 2,
    }
    assert 600 <= orders["oldest_pending_age_s"] < 700
    assert [(x["relay"], x["rows"]) for x in orders["in_flight"]] == [("relay-a", 4)]
    assert 0 < orders["in_flight"][0]["lease_left_s"] <= 30
    assert orders["failed_errors"] == [
        {"error": "boom: broker said no", "rows": 2},
        {"error": "other", "rows": 1},
    ]
    assert data["totals"] == {
        "pending": 5,
        "due_now": 3,
        "running": 4,
        "delivered": 6,
        "failed": 3,
        "skipped": 2,
    }
    assert data["problems"] == []
    relays = {r["relay_id"]: r for r in data["relays"]}
    assert {k: r["state"] for k, r in relays.items()} == {
        "relay-a": "running",
        "relay-b": "silent",
        "relay-c": "stopped",
    }
    assert relays["relay-b"]["destinations"] == ["emails", "orders"]
    assert relays["relay-a"]["host"] == "host-1" and relays["relay-a"]["pid"] == 41

    human = cli(db_url, "status")
    assert human.exit_code == 0, human.output
    lines = human.output.splitlines()
    assert lines[0].split()[:8] == [
        "DESTINATION",
        "PENDING",
        "DUE",
        "OLDEST",
        "RUNNING",
        "DELIVERED",
        "FAILED",
        "SKIPPED",
    ]
    assert lines[1].split()[:9] == ["emails", "0", "0", "-", "0", "1", "0", "0", "PAUSED"]
    assert lines[2].split() == ["orders", "5", "3", "10m", "4", "5", "3", "2", "active"]
    assert "relay-a: running on host-1 pid 41" in human.output
    assert "relay-b: silent on host-2 pid 42, SILENT for 5m" in human.output
    assert "serves emails, orders" in human.output
    assert "relay-c: stopped" in human.output
    assert "4 row(s) held by relay-a" in human.output
    assert "orders: 2 x boom: broker said no" in human.output


def test_status_exit_codes_for_scripts(db_url: str) -> None:
    insert(db_url, "orders", n=1, age="2 min")
    ok = cli(db_url, "status", "--fail-if-failed", "--fail-if-pending-older-than", "5m")
    assert ok.exit_code == 0, ok.output
    late = cli(db_url, "status", "--fail-if-pending-older-than", "1m")
    assert late.exit_code == EXIT_CONDITION
    assert "pending rows older than 1m in orders" in late.output
    insert(db_url, "orders", "failed", error="x")
    failed = cli(db_url, "status", "--fail-if-failed", "--json")
    assert failed.exit_code == EXIT_CONDITION
    assert json.loads(failed.output)["problems"] == ["1 failed row(s)"]
    assert cli(db_url, "status").exit_code == 0  # no --fail-if-…: informational only


def test_status_of_an_empty_outbox_and_unmigrated_database(db_url: str, empty_db_url: str) -> None:
    res = cli(db_url, "status")
    assert res.exit_code == 0 and "is empty" in res.output
    assert cli_json(db_url, "status")["destinations"] == []
    bare = cli(empty_db_url, "status")
    assert bare.exit_code == 1 and "outbox-relay migrate" in bare.output


# --- show -----------------------------------------------------------------------------------


def test_show_rows_in_full(db_url: str) -> None:
    [j] = insert(
        db_url,
        "orders",
        "failed",
        error="MessageSizeTooLarge",
        attempts=1,
        headers='{"event-type": "order.created"}',
    )
    [b] = insert(
        db_url, "orders", payload=b"\x00\xff" * 10, content_type="application/octet-stream"
    )
    data = cli_json(db_url, "show", str(j), str(b), "--preview-bytes", "4")
    assert data["missing"] == []
    one, two = data["rows"]
    assert one["id"] == j and one["status"] == "failed" and one["attempts"] == 1
    assert one["last_error"] == "MessageSizeTooLarge"
    assert one["headers"] == {"event-type": "order.created"}
    assert one["payload_bytes"] == 7 and one["payload_preview"] == '{"x"… (7 bytes)'
    assert one["created_at"] and one["delivered_at"] is None
    assert set(one) >= {"run_after", "locked_by", "locked_until", "key", "content_type"}
    assert two["payload_preview"] == "00 ff 00 ff… (20 bytes)"

    human = cli(db_url, "show", str(j))
    assert human.exit_code == 0
    assert "last_error:      MessageSizeTooLarge" in human.output
    assert '{"x":1}' in human.output


def test_show_missing_id_is_an_error(db_url: str) -> None:
    [i] = insert(db_url, "orders")
    res = cli(db_url, "show", str(i), "99999")
    assert res.exit_code == 1
    assert f"id:              {i}" in res.output
    assert "no outbox row with id 99999" in res.output


# --- retry ----------------------------------------------------------------------------------


def test_retry_dry_run_then_filters(db_url: str) -> None:
    timeouts = insert(db_url, "orders", "failed", n=3, error="RequestTimedOut: broker", attempts=25)
    [size] = insert(db_url, "orders", "failed", error="MessageSizeTooLarge", attempts=1)
    [old] = insert(db_url, "emails", "failed", error="HTTP 500", attempts=9, age="3 days")
    [new_email] = insert(db_url, "emails", "failed", error="HTTP 500", attempts=9)
    [delivered] = insert(db_url, "orders", "delivered")
    before = statuses(db_url)

    dry = cli_json(db_url, "retry", "--all", "--dry-run")
    assert dry["dry_run"] is True and dry["rows"] == 6
    assert dry["destinations"]["orders"] == {
        "rows": 4,
        "first_id": timeouts[0],
        "last_id": size,
    }
    assert statuses(db_url) == before  # nothing changed

    human_dry = cli(db_url, "retry", "--error-like", "timedout", "--dry-run")
    assert human_dry.exit_code == 0 and "would retry 3 failed row(s)" in human_dry.output
    assert statuses(db_url) == before

    res = cli(db_url, "retry", "--error-like", "timedout")
    assert res.exit_code == 0 and "retried 3 failed row(s)" in res.output
    after = statuses(db_url)
    assert all(after[i] == ("pending", 0) for i in timeouts)
    assert after[size] == ("failed", 1)
    due = sql(
        db_url, "SELECT bool_and(run_after <= now()) FROM outbox WHERE id = ANY(%s)", timeouts
    )
    assert due == [(True,)]

    assert cli_json(db_url, "retry", "--destination", "emails", "--since", "1d")["rows"] == 1
    assert statuses(db_url)[new_email] == ("pending", 0)
    assert statuses(db_url)[old] == ("failed", 9)

    assert cli_json(db_url, "retry", "--id", str(size))["rows"] == 1
    assert statuses(db_url)[size] == ("pending", 0)
    assert statuses(db_url)[delivered] == ("delivered", 0)


def test_retry_refuses_unknown_or_unfailed_ids_and_no_filter(db_url: str) -> None:
    [f] = insert(db_url, "orders", "failed", error="x", attempts=3)
    [d] = insert(db_url, "orders", "delivered")
    res = cli(db_url, "retry", "--id", str(f), "--id", "99999")
    assert res.exit_code == 1 and "no outbox row with id 99999" in res.output
    res = cli(db_url, "retry", "--id", str(f), "--id", str(d))
    assert res.exit_code == 1 and f"{d} is delivered" in res.output
    assert statuses(db_url)[f] == ("failed", 3)  # nothing changed by either
    res = cli(db_url, "retry")
    assert res.exit_code == 2 and "--all" in res.output
    res = cli(db_url, "retry", "--since", "yesterday-ish")
    assert res.exit_code == 2 and "ISO-8601" in res.output


# --- purge ----------------------------------------------------------------------------------


def test_purge_deletes_old_delivered_rows_in_batches(db_url: str) -> None:
    old = insert(db_url, "orders", "delivered", n=25, delivered_ago="8 days", age="9 days")
    recent = insert(db_url, "orders", "delivered", n=3, delivered_ago="1 day", age="9 days")
    old_failed = insert(
        db_url, "orders", "failed", n=2, age="9 days", finished_ago="8 days", error="x"
    )
    # An old event that failed a minute ago is a minute old to the operator: kept.
    just_failed = insert(db_url, "orders", "failed", age="9 days", finished_ago="1 min", error="x")
    old_skipped = insert(db_url, "orders", "skipped", age="9 days", finished_ago="8 days")
    just_skipped = insert(db_url, "orders", "skipped", age="9 days", finished_ago="1 min")
    old_pending = insert(db_url, "orders", n=2, age="9 days")
    old_running = insert(db_url, "orders", "running", n=1, age="9 days", locked_by="r")
    other = insert(db_url, "emails", "delivered", n=4, delivered_ago="8 days")

    res = cli(db_url, "purge")
    assert res.exit_code == 2 and "purge needs --older-than" in res.output
    res = cli(db_url, "purge", "--older-than", "a week")
    assert res.exit_code == 2 and "not a duration" in res.output

    dry = cli_json(db_url, "purge", "--older-than", "7d", "--failed", "--dry-run")
    assert dry == {
        "dry_run": True,
        "rows": 32,
        "destinations": {
            "emails": {"delivered": 4},
            "orders": {"delivered": 25, "failed": 2, "skipped": 1},
        },
    }
    assert len(statuses(db_url)) == 40

    done = cli_json(
        db_url, "purge", "--older-than", "7d", "--destination", "orders", "--batch-size", "10"
    )
    assert done["deleted"] == {"delivered": 25, "skipped": 1, "failed": 0}
    assert done["batches"] == 4  # 10 + 10 + 5 delivered, 1 skipped
    left = set(statuses(db_url))
    assert not left & {*old, *old_skipped}
    kept = {*recent, *just_failed, *just_skipped, *old_pending, *old_running, *other}
    assert left == kept | set(old_failed)

    res = cli(db_url, "purge", "--older-than", "7d", "--failed")
    assert res.exit_code == 0
    assert "deleted 4 delivered, 0 skipped and 2 failed row(s) older than 7d" in res.output
    assert set(statuses(db_url)) == kept - set(other)


# --- pause / resume -------------------------------------------------------------------------


def test_pause_and_resume(db_url: str) -> None:
    first = cli_json(db_url, "pause", "orders", "--reason", "consumer migration")
    assert first["paused"] is True and first["already_paused"] is False
    again = cli(db_url, "pause", "orders")
    assert again.exit_code == 0 and "already paused" in again.output
    rows = sql(db_url, "SELECT destination, reason, paused_by FROM outbox_paused")
    assert rows[0][:2] == ("orders", "consumer migration") and "@" in rows[0][2]
    resumed = cli_json(db_url, "resume", "orders")
    assert resumed["was_paused"] is True
    assert sql(db_url, "SELECT count(*) FROM outbox_paused") == [(0,)]
    res = cli(db_url, "resume", "orders")
    assert res.exit_code == 0 and "was not paused" in res.output


# --- the real entry point ---------------------------------------------------------------------


def test_commands_read_the_url_from_the_environment(db_url: str) -> None:
    insert(db_url, "orders", "failed", error="x")
    env = {"OUTBOX_DATABASE_URL": db_url, "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-m", "relay.cli", "status", "--json", "--fail-if-failed"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == EXIT_CONDITION, run.stderr
    assert json.loads(run.stdout)["totals"]["failed"] == 1


@pytest.mark.parametrize("command", [["status"], ["show", "1"], ["pause", "x"]])
def test_unreachable_database_is_one_clear_error(command: list[str]) -> None:
    res = cli("postgresql://root:secret@127.0.0.1:1/nope", *command)
    assert res.exit_code == 1
    assert "PostgreSQL is running" in res.output and "secret" not in res.output
