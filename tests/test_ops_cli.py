"""The operations commands against a real database: status, show, retry, purge, pause, resume,
skip; their confirmations, --config, and the schema variable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result

from relay.cli import main, terminal
from relay.cli.options import EXIT_CONDITION


def cli(db_url: str, *args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(main, [args[0], "--database-url", db_url, *args[1:]], input=input)


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
    # relay-a registered last with batch leases (relay.claims); the others never said.
    sql(
        db_url,
        "UPDATE outbox_relays SET features = '{batch-claims}', features_at = seen_at "
        "WHERE relay_id = 'relay-a'",
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
    assert {k: r["claims"] for k, r in relays.items()} == {
        "relay-a": "batch",
        "relay-b": "row",
        "relay-c": "row",
    }

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
    orders_line = lines[2].split()
    # Ten minutes old when inserted, and seconds more by now on a loaded machine ("10m1s").
    assert orders_line[3].startswith("10m")
    del orders_line[3]
    assert orders_line == ["orders", "5", "3", "4", "5", "3", "2", "active"]
    assert "relay-a: running on host-1 pid 41" in human.output
    assert "relay-b: silent on host-2 pid 42, SILENT for 5m" in human.output
    assert "serves emails, orders (claims by row)" in human.output
    assert "serves orders (claims by batch)" in human.output
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

    res = cli(db_url, "retry", "--error-like", "timedout", "--yes")
    assert res.exit_code == 0 and "retried 3 failed row(s)" in res.output
    after = statuses(db_url)
    assert all(after[i] == ("pending", 0) for i in timeouts)
    assert after[size] == ("failed", 1)
    due = sql(
        db_url, "SELECT bool_and(run_after <= now()) FROM outbox WHERE id = ANY(%s)", timeouts
    )
    assert due == [(True,)]

    assert (
        cli_json(db_url, "retry", "--destination", "emails", "--since", "1d", "--yes")["rows"] == 1
    )
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
        db_url,
        "purge",
        "--older-than",
        "7d",
        "--destination",
        "orders",
        "--batch-size",
        "10",
        "--yes",
    )
    assert done["deleted"] == {"delivered": 25, "skipped": 1, "failed": 0}
    assert done["batches"] == 4  # 10 + 10 + 5 delivered, 1 skipped
    left = set(statuses(db_url))
    assert not left & {*old, *old_skipped}
    kept = {*recent, *just_failed, *just_skipped, *old_pending, *old_running, *other}
    assert left == kept | set(old_failed)

    res = cli(db_url, "purge", "--older-than", "7d", "--failed", "--yes")
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


# --- confirmations: what a command will change, asked first -------------------------------


def test_purge_shows_what_it_deletes_and_asks(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    insert(db_url, "orders", "delivered", n=3, delivered_ago="8 days")
    insert(db_url, "emails", "delivered", n=2, delivered_ago="8 days")
    insert(db_url, "emails", "failed", error="x", finished_ago="8 days")
    insert(db_url, "emails", "delivered", delivered_ago="1 day")

    # Off a terminal: refused (exit 2) with what it would delete, and how to go on.
    refused = cli(db_url, "purge", "--older-than", "7d", "--failed")
    assert refused.exit_code == 2, refused.output
    assert "would delete 6 row(s) older than 7d" in refused.output
    assert "emails: 2 delivered, 1 failed; orders: 3 delivered" in refused.output
    assert "no terminal to confirm on: pass --yes" in refused.output
    assert len(statuses(db_url)) == 7
    assert cli(db_url, "purge", "--older-than", "7d", "--dry-run").exit_code == 0

    monkeypatch.setattr(terminal, "stdin", lambda: True)
    no = cli(db_url, "purge", "--older-than", "7d", input="n\n")
    assert no.exit_code == 1, no.output
    assert "would delete 5 row(s) older than 7d:\n  emails: 2 delivered\n" in no.output
    assert "  orders: 3 delivered\ndelete them? [y/N]" in no.output
    assert len(statuses(db_url)) == 7

    yes = cli(db_url, "purge", "--older-than", "7d", "--json", input="y\n")
    assert yes.exit_code == 0, yes.output
    assert json.loads(yes.stdout)["deleted"] == {"delivered": 5, "skipped": 0, "failed": 0}
    assert len(statuses(db_url)) == 2
    # Nothing left to delete: nothing to ask.
    again = cli(db_url, "purge", "--older-than", "7d")
    assert again.exit_code == 0 and "?" not in again.output, again.output
    assert "deleted 0 delivered, 0 skipped row(s)" in again.output


def test_retry_by_filter_asks_and_by_id_does_not(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    orders = insert(db_url, "orders", "failed", n=2, error="boom")
    [email] = insert(db_url, "emails", "failed", error="boom")
    before = statuses(db_url)

    for args in (["--all"], ["--destination", "orders"], ["--error-like", "boom"]):
        refused = cli(db_url, "retry", *args)
        assert refused.exit_code == 2 and "pass --yes" in refused.output, (args, refused.output)
    refused = cli(db_url, "retry", "--since", "1h")
    assert f"would retry 3 failed row(s) (emails: 1 (ids {email}…{email}); orders: 2" in (
        refused.output
    )
    assert statuses(db_url) == before
    # Many destinations: the refusal's one line names the first ten.
    for n in range(12):
        insert(db_url, f"d{n:02}", "failed", error="boom")
    refused = cli(db_url, "retry", "--error-like", "boom")
    assert "would retry 15 failed row(s) (d00: 1" in refused.output
    assert "d09: 1" in refused.output and "d10" not in refused.output
    assert "; … 4 more destination(s)) and there is no terminal" in refused.output
    sql(db_url, "DELETE FROM outbox WHERE destination LIKE 'd%'")
    # Rows named one by one are what the operator chose: retried at once.
    by_id = cli(db_url, "retry", "--id", str(email))
    assert by_id.exit_code == 0 and "retried 1 failed row(s)" in by_id.output

    monkeypatch.setattr(terminal, "stdin", lambda: True)
    no = cli(db_url, "retry", "--destination", "orders", input="n\n")
    assert no.exit_code == 1
    assert f"would retry 2 failed row(s):\n  orders: 2 (ids {orders[0]}…{orders[1]})" in no.output
    assert "retry them? [y/N]" in no.output
    assert statuses(db_url)[orders[0]] == ("failed", 0)
    yes = cli(db_url, "retry", "--destination", "orders", input="y\n")
    assert yes.exit_code == 0 and "retried 2 failed row(s)" in yes.output
    assert all(statuses(db_url)[i] == ("pending", 0) for i in orders)


def test_skip_shows_the_rows_per_destination_and_asks(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = insert(db_url, "orders", "failed", n=2, error="poison")
    [c] = insert(db_url, "emails", "failed", error="poison")
    before = statuses(db_url)

    refused = cli(db_url, "skip", str(a))
    assert refused.exit_code == 2 and "no terminal to confirm on: pass --yes" in refused.output
    # The rows are checked before anything is asked.
    bad = cli(db_url, "skip", str(a), "99999")
    assert bad.exit_code == 1 and "no outbox row with id 99999" in bad.output
    assert statuses(db_url) == before
    dry = cli_json(db_url, "skip", str(a), str(c), "--dry-run")
    assert dry["destinations"] == {
        "emails": {"rows": 1, "ids": [c]},
        "orders": {"rows": 1, "ids": [a]},
    }

    monkeypatch.setattr(terminal, "stdin", lambda: True)
    no = cli(db_url, "skip", str(a), str(b), str(c), input="n\n")
    assert no.exit_code == 1
    assert (
        "would skip 3 failed row(s), never to be delivered:\n"
        f"  emails: 1 (ids {c})\n  orders: 2 (ids {a}, {b})\nskip them? [y/N]"
    ) in no.output
    assert statuses(db_url) == before
    yes = cli(db_url, "skip", str(a), str(b), input="y\n")
    assert yes.exit_code == 0 and f"skipped 2 row(s): {a}, {b}" in yes.output
    # --yes off a terminal.
    monkeypatch.setattr(terminal, "stdin", lambda: False)
    assert cli(db_url, "skip", str(c), "--yes").exit_code == 0
    assert {s for s, _ in statuses(db_url).values()} == {"skipped"}


# --- --config: the relay's relay.toml names the database and schema -----------------------

# None unsets the variable for the command (the test's own environment must not leak in).
NO_VARIABLES: dict[str, str | None] = dict.fromkeys(
    ("OUTBOX_DATABASE_URL", "OUTBOX_SCHEMA", "OUTBOX_RELAY_SCHEMA", "OUTBOX_CONFIG")
)


def command(*args: str, **env: str) -> Result:
    return CliRunner().invoke(main, list(args), env={**NO_VARIABLES, **env})


def billing(db_url: str) -> tuple[int, int]:
    """The schema "Billing" migrated next to public, one failed row in each."""
    migrated = command("migrate", "--database-url", db_url, "--schema", "Billing")
    assert migrated.exit_code == 0, migrated.output
    [public] = insert(db_url, "orders", "failed", error="x")
    [(row,)] = sql(
        db_url,
        """INSERT INTO "Billing".outbox (destination, payload, status)
        VALUES ('invoices', '\\x00', 'failed') RETURNING id""",
    )
    return public, row


def config(tmp_path: Path, text: str) -> str:
    """A relay.toml of its own (each call a new file)."""
    path = tmp_path / f"relay-{len(list(tmp_path.iterdir()))}.toml"
    path.write_text(text)
    return str(path)


UNREACHABLE = "postgresql://root:hunter2secret@127.0.0.1:1/nope"


def listed(res: Result) -> list[str]:
    assert res.exit_code == 0, res.output
    return [r["destination"] for r in json.loads(res.stdout)["rows"]]


def test_commands_read_the_database_and_schema_from_the_relay_config(
    db_url: str, tmp_path: Path
) -> None:
    billing(db_url)
    cfg = config(tmp_path, f"database_url = '{db_url}'\n[relay]\nschema = 'Billing'\n")
    status = command("status", "--config", cfg, "--json")
    assert status.exit_code == 0, status.output
    data = json.loads(status.stdout)
    assert data["schema"] == "Billing" and data["totals"]["failed"] == 1
    assert listed(command("list", "--config", cfg, "--json")) == ["invoices"]
    assert listed(command("list", "--json", OUTBOX_CONFIG=cfg)) == ["invoices"]
    for args in (["pause", "invoices"], ["resume", "invoices"], ["show", "1"]):
        res = command(*args, "--config", cfg)
        assert res.exit_code == 0, (args, res.output)
    res = command("retry", "--all", "--yes", "--config", cfg)
    assert res.exit_code == 0 and "retried 1 failed row(s)" in res.output
    res = command("purge", "--older-than", "1d", "--yes", "--config", cfg)
    assert res.exit_code == 0, res.output


def test_an_option_beats_its_variable_which_beats_the_config(db_url: str, tmp_path: Path) -> None:
    billing(db_url)
    cfg = config(tmp_path, f"database_url = '{UNREACHABLE}'\n[relay]\nschema = 'Billing'\n")
    # Each value on its own: the URL from the option or variable, the schema from the file.
    assert listed(command("list", "--json", "--config", cfg, "--database-url", db_url)) == [
        "invoices"
    ]
    res = command("list", "--json", "--config", cfg, OUTBOX_DATABASE_URL=db_url)
    assert listed(res) == ["invoices"]
    res = command(
        "list", "--json", "--config", cfg, "--schema", "public", OUTBOX_DATABASE_URL=db_url
    )
    assert listed(res) == ["orders"]
    # A file without a schema: the variable's, else public.
    plain = config(tmp_path, f"database_url = '{db_url}'\n")
    assert listed(command("list", "--json", "--config", plain, OUTBOX_SCHEMA="Billing")) == [
        "invoices"
    ]
    assert listed(command("list", "--json", "--config", plain)) == ["orders"]
    # A file without a URL (kept in the environment, as in deploy/): the variable's.
    no_url = config(tmp_path, "[relay]\nschema = 'Billing'\n")
    res = command("list", "--json", "--config", no_url, OUTBOX_DATABASE_URL=db_url)
    assert listed(res) == ["invoices"]
    # A variable and the file naming different schemas: refused, as `run` refuses it.
    res = command("list", "--config", cfg, OUTBOX_SCHEMA="public", OUTBOX_DATABASE_URL=db_url)
    assert res.exit_code == 2 and "OUTBOX_SCHEMA" in res.stderr, res.output
    # And the unreachable URL of the file, when nothing else names one, never its password.
    res = command("status", "--config", cfg)
    assert res.exit_code == 1 and "hunter2secret" not in res.output
    assert "PostgreSQL is running" in res.output


def test_an_invalid_config_is_the_error_of_run_check(tmp_path: Path) -> None:
    for text in (
        f"database_url = '{UNREACHABLE}'\n[relay]\nbatchsize = 3\n",  # a misspelt key
        "[relay]\nschema = 'Billing'\n",  # no database_url anywhere
        "database_url = [",  # not TOML
    ):
        cfg = config(tmp_path, text)
        checked = command("run", "--check", "--config", cfg)
        assert checked.exit_code == 2 and checked.stderr.startswith("outbox-relay: ")
        for args in (["status"], ["list"], ["purge", "--older-than", "1d"], ["skip", "1"]):
            res = command(*args, "--config", cfg)
            assert res.exit_code == 2, (text, args, res.output)
            assert res.stderr == checked.stderr, (text, args)
            assert "hunter2secret" not in res.output
    res = command("status", "--config", str(tmp_path / "missing.toml"))
    assert res.exit_code == 2 and "does not exist" in res.stderr


def test_no_database_named_anywhere_is_a_usage_error() -> None:
    res = command("status")
    assert res.exit_code == 2
    assert "--database-url, OUTBOX_DATABASE_URL, or --config" in res.output


# --- one schema variable: OUTBOX_SCHEMA ---------------------------------------------------


DEPRECATED = "OUTBOX_RELAY_SCHEMA is deprecated"


def test_the_old_schema_variable_still_works_with_a_warning(db_url: str, tmp_path: Path) -> None:
    billing(db_url)
    res = command("list", "--json", "--database-url", db_url, OUTBOX_RELAY_SCHEMA="Billing")
    assert listed(res) == ["invoices"]  # stdout is the JSON alone
    assert res.stderr.count(DEPRECATED) == 1 and "set OUTBOX_SCHEMA instead" in res.stderr
    res = command("list", "--json", "--database-url", db_url, OUTBOX_SCHEMA="Billing")
    assert listed(res) == ["invoices"] and res.stderr == ""
    # With --config too: said once, on stderr, and not as the relay's log event.
    cfg = config(tmp_path, f"database_url = '{db_url}'\n")
    res = command("list", "--json", "--config", cfg, OUTBOX_RELAY_SCHEMA="Billing")
    assert listed(res) == ["invoices"]
    assert res.stderr.count(DEPRECATED) == 1 and "relay.config" not in res.output
    # Every command that takes --schema, migrate and endpoints too.
    for args in (["migrate"], ["endpoints", "list"], ["status"]):
        res = command(*args, "--database-url", db_url, OUTBOX_RELAY_SCHEMA="Billing")
        assert res.exit_code == 0 and res.stderr.count(DEPRECATED) == 1, (args, res.output)
    # The two naming different schemas stays an error.
    res = command(
        "list", "--database-url", db_url, OUTBOX_SCHEMA="Billing", OUTBOX_RELAY_SCHEMA="other"
    )
    assert res.exit_code == 2 and "set only OUTBOX_SCHEMA" in res.output


def test_the_relay_logs_the_old_schema_variable(tmp_path: Path) -> None:
    cfg = config(tmp_path, f"database_url = '{UNREACHABLE}'\n")
    env = {"PATH": "/usr/bin:/bin", "OUTBOX_RELAY_SCHEMA": "events"}
    run = subprocess.run(
        [sys.executable, "-m", "relay.cli", "run", "--check", "--config", cfg],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    # Its answer on stdout as ever; the warning event before logging is set up, on stderr.
    assert run.stdout == "configuration OK: 0 destination(s), schema 'events'\n"
    assert "relay.config.deprecated_variable" in run.stderr
    assert "variable=OUTBOX_RELAY_SCHEMA" in run.stderr and "use=OUTBOX_SCHEMA" in run.stderr
    env = {"PATH": "/usr/bin:/bin", "OUTBOX_SCHEMA": "events"}
    run = subprocess.run(
        [sys.executable, "-m", "relay.cli", "run", "--check", "--config", cfg],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert run.returncode == 0 and "deprecated" not in run.stderr


def test_an_estimated_delivered_count_is_marked_in_text_and_json(db_url: str) -> None:
    sql(
        db_url,
        "INSERT INTO outbox (destination, payload, status, delivered_at, finished_at) "
        "SELECT 'orders', '\\x00', 'delivered', now(), now() FROM generate_series(1, 120000)",
    )
    sql(db_url, "INSERT INTO outbox (destination, payload) VALUES ('orders', '\\x00')")
    sql(db_url, "ANALYZE outbox")
    data = cli_json(db_url, "status")
    [orders] = [d for d in data["destinations"] if d["destination"] == "orders"]
    assert orders["delivered_estimated"] is True and orders["pending"] == 1
    text = cli(db_url, "status")
    assert text.exit_code == 0 and f"~{orders['delivered']}" in text.output


def test_a_destination_the_statistics_miss_is_counted_not_lost(db_url: str) -> None:
    """Statistics taken before a destination existed would leave it out of an estimate, or
    credit its rows to the others: status counts exactly then."""
    sql(db_url, "ALTER TABLE outbox SET (autovacuum_enabled = false)")
    sql(
        db_url,
        "INSERT INTO outbox (destination, payload, status, delivered_at, finished_at) "
        "SELECT 'old', '\\x00', 'delivered', now() - interval '1 hour', now() "
        "FROM generate_series(1, 120000)",
    )
    sql(db_url, "ANALYZE outbox")
    sql(
        db_url,
        "INSERT INTO outbox (destination, payload, status, delivered_at, finished_at) "
        "SELECT 'new', '\\x00', 'delivered', now(), now() FROM generate_series(1, 30000)",
    )
    data = cli_json(db_url, "status")
    got = {d["destination"]: d["delivered"] for d in data["destinations"]}
    assert got == {"old": 120000, "new": 30000}
    assert data["delivered_estimated"] is False


def test_a_circuit_is_reported_under_its_own_destination(db_url: str) -> None:
    from relay.app import Relay
    from tests.support.relays import settings
    from tests.webhook_helpers import SECRET

    hook = {"kind": "webhook", "url": "http://127.0.0.1:9/", "secrets": [SECRET]}
    relay = Relay(
        settings(db_url, "127.0.0.1:9", destinations={"billing": hook, "billing eu": hook})
    )
    breaker = relay.sinks["billing eu"].endpoints["billing eu"].breaker  # type: ignore[attr-defined]
    for _ in range(breaker.threshold):
        breaker.failure()
    assert relay._circuit_states() == {"billing eu": "open"}


def test_status_names_the_snapshot_that_holds_back_vacuum(db_url: str) -> None:
    """A held snapshot older than --snapshot-warning: a line naming it and how to end it, and
    `snapshot` in --json (always, over the threshold or not); none once it is closed."""
    import time

    from relay.db.queries import SNAPSHOT_HOLDER

    app = "nightly-report"
    with psycopg.connect(db_url, application_name=app, autocommit=True) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM outbox")
        pid = holder.info.backend_pid
        deadline = time.monotonic() + 10
        # Transactions of other sessions begun before it are older until they end.
        while sql(db_url, SNAPSHOT_HOLDER)[0][1] != pid:
            assert time.monotonic() < deadline, "never the oldest holder"
            time.sleep(0.05)
        young = cli_json(db_url, "status", "--snapshot-warning", "1h")["snapshot"]
        assert young["pid"] == pid and young["kind"] == "backend" and young["visible"]
        assert young["over_threshold"] is False and young["threshold_s"] == 3600
        assert young["application_name"] == app
        assert "snapshot held" not in cli(db_url, "status", "--snapshot-warning", "1h").output
        time.sleep(0.3)
        data = cli_json(db_url, "status", "--snapshot-warning", "0.2")["snapshot"]
        assert data["over_threshold"] is True and data["age_s"] > 0.2
        assert data["state"] == "idle in transaction" and data["xid_age"] >= 1
        res = CliRunner().invoke(
            main,
            ["status", "--database-url", db_url],
            env={"OUTBOX_RELAY_SNAPSHOT_WARNING": "200ms"},
        )
        assert res.exit_code == 0, res.output
        line = next(x for x in res.output.splitlines() if "snapshot held" in x)
        assert f"by pid {pid} (nightly-report, user root, idle in transaction" in line
        assert f"end it: SELECT pg_terminate_backend({pid}) if it is not needed" in res.output
    after = cli_json(db_url, "status", "--snapshot-warning", "0.2")["snapshot"]
    assert after is None or after["pid"] != pid
