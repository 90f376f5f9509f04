"""`outbox-relay endpoints` against a real database: add, list, show, update, disable, enable,
rotate-secret, delete."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result
from cryptography.fernet import Fernet

from relay.cli import main, terminal
from tests.test_imports import HEAVY, imported

LOCAL = "http://127.0.0.1:9/in"


def cli(db_url: str, *args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(
        main, ["endpoints", args[0], "--database-url", db_url, *args[1:]], input=input
    )


def cli_json(db_url: str, *args: str) -> Any:
    res = cli(db_url, *args, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)  # stderr may say the secret is stored unencrypted


def sql(db_url: str, query: str, *params: Any, **named: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(db_url, autocommit=True) as c:
        cur = c.execute(query, named or params or None)
        return cur.fetchall() if cur.description else []


def add(db_url: str, *args: str) -> dict[str, Any]:
    """A new endpoint of destination 'orders' at LOCAL, as `add --json` prints it."""
    return cli_json(db_url, "add", "orders", LOCAL, "--allow-private-networks", *args)  # type: ignore[no-any-return]


def key_of(secret: str) -> bytes:
    assert secret.startswith("whsec_")
    return base64.b64decode(secret.removeprefix("whsec_"), validate=True)


def stored_secret(db_url: str, endpoint_id: int) -> str:
    [(secret,)] = sql(db_url, "SELECT secret FROM outbox_endpoints WHERE id = %s", endpoint_id)
    return str(secret)


# --- add ------------------------------------------------------------------------------------


def test_add_prints_the_id_and_the_generated_secret_once(db_url: str) -> None:
    res = cli(
        db_url,
        "add",
        "orders",
        LOCAL,
        "--tenant",
        "acme",
        "--event-type",
        "invoice.paid",
        "--event-type",
        "invoice.voided",
        "--rate-limit",
        "5",
        "--description",
        "Acme's billing",
        "--allow-private-networks",
    )
    assert res.exit_code == 0, res.output
    [(endpoint_id,)] = sql(db_url, "SELECT id FROM outbox_endpoints")
    secret = stored_secret(db_url, endpoint_id)
    assert len(key_of(secret)) == 32
    assert res.output.count(secret) == 1
    assert res.output.startswith(f"added endpoint {endpoint_id} to orders: {LOCAL}")
    assert "tenant acme, event types invoice.paid,invoice.voided" in res.output
    assert f"endpoints show {endpoint_id} --show-secret" in res.output

    data = add(db_url, "--event-type", "a.b", "--no-dns-check")
    assert len(key_of(data["secret"])) == 32
    assert data["secret"] == stored_secret(db_url, data["id"]) != secret
    assert data["destination"] == "orders" and data["url"] == LOCAL
    assert (data["tenant"], data["event_types"], data["rate_limit"]) == (None, ["a.b"], None)
    assert data["enabled"] is True and data["description"] == ""


def test_add_with_a_given_secret_does_not_echo_it(db_url: str) -> None:
    given = "whsec_" + base64.b64encode(bytes(range(32))).decode()
    res = cli(db_url, "add", "orders", LOCAL, "--allow-private-networks", "--secret", given)
    assert res.exit_code == 0, res.output
    assert given not in res.output
    [(endpoint_id,)] = sql(db_url, "SELECT id FROM outbox_endpoints")
    assert stored_secret(db_url, endpoint_id) == given
    short = cli(db_url, "add", "orders", LOCAL, "--no-dns-check", "--secret", "whsec_c2hvcnQ=")
    assert short.exit_code == 1 and "secret:" in short.output and "24 random bytes" in short.output


def test_add_refuses_a_loopback_url_without_allow_private_networks(db_url: str) -> None:
    res = cli(db_url, "add", "orders", LOCAL)
    assert res.exit_code == 1
    assert "127.0.0.1" in res.output and "--allow-private-networks" in res.output
    assert "Traceback" not in res.output
    bad = cli(db_url, "add", "orders", "ftp://example.com/", "--no-dns-check")
    assert bad.exit_code == 1 and "http:// or https://" in bad.output
    assert sql(db_url, "SELECT count(*) FROM outbox_endpoints") == [(0,)]
    zero = cli(db_url, "add", "orders", LOCAL, "--no-dns-check", "--rate-limit", "0")
    assert zero.exit_code == 2 and "--rate-limit" in zero.output


def test_secrets_are_stored_encrypted_with_the_key_and_shown_in_clear(db_url: str) -> None:
    env = {"OUTBOX_ENDPOINT_SECRET_KEY": Fernet.generate_key().decode()}
    args = ["add", "--database-url", db_url, "orders", LOCAL, "--allow-private-networks", "--json"]
    res = CliRunner(env=env).invoke(main, ["endpoints", *args])
    assert res.exit_code == 0, res.output
    ep = json.loads(res.output)
    assert stored_secret(db_url, ep["id"]).startswith("enc:")
    show = ["show", "--database-url", db_url, str(ep["id"]), "--show-secret", "--json"]
    shown = CliRunner(env=env).invoke(main, ["endpoints", *show])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["secret"] == ep["secret"]
    keyless = cli(db_url, "show", str(ep["id"]), "--show-secret")
    assert keyless.exit_code == 1 and "OUTBOX_ENDPOINT_SECRET_KEY is not set" in keyless.output


# --- list -----------------------------------------------------------------------------------


def test_list_shows_every_endpoint_and_never_a_secret(db_url: str) -> None:
    one = add(db_url, "--tenant", "acme", "--event-type", "a.b", "--event-type", "c.d")
    two = add(db_url, "--rate-limit", "7")
    other = cli_json(db_url, "add", "emails", LOCAL, "--allow-private-networks")
    assert cli(db_url, "disable", str(two["id"]), "--reason", "moved away").exit_code == 0

    res = cli(db_url, "list")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].split() == [
        "ID",
        "DESTINATION",
        "URL",
        "TENANT",
        "EVENT",
        "TYPES",
        "RATE",
        "LIMIT",
        "STATE",
    ]
    assert lines[1].split() == [str(one["id"]), "orders", LOCAL, "acme", "a.b,c.d", "-", "enabled"]
    assert lines[2].split() == [
        str(two["id"]),
        "orders",
        LOCAL,
        "*",
        "*",
        "7/s",
        "disabled:",
        "moved",
        "away",
    ]
    assert lines[3].split()[:2] == [str(other["id"]), "emails"]
    listed = cli_json(db_url, "list")
    for secret in (one["secret"], two["secret"], other["secret"]):
        assert secret not in res.output and secret not in json.dumps(listed)
    assert all("secret" not in e for e in listed["endpoints"])
    assert [e["id"] for e in listed["endpoints"]] == [one["id"], two["id"], other["id"]]

    only = cli_json(db_url, "list", "--destination", "orders", "--tenant", "acme")
    assert [e["id"] for e in only["endpoints"]] == [one["id"]]
    none = cli(db_url, "list", "--destination", "nowhere")
    assert none.exit_code == 0 and "no endpoints match" in none.output


# --- show -----------------------------------------------------------------------------------


def test_show_without_and_with_the_secret(db_url: str) -> None:
    ep = add(db_url, "--description", "Acme's billing")
    plain = cli(db_url, "show", str(ep["id"]))
    assert plain.exit_code == 0, plain.output
    assert ep["secret"] not in plain.output and "secret:" not in plain.output
    assert f"url:                   {LOCAL}" in plain.output
    assert "tenant:                * (every tenant)" in plain.output
    assert "description:           Acme's billing" in plain.output
    assert "state:                 enabled" in plain.output
    assert "no attempts yet" in plain.output
    assert "secret" not in cli_json(db_url, "show", str(ep["id"]))

    shown = cli(db_url, "show", str(ep["id"]), "--show-secret")
    assert shown.exit_code == 0, shown.output
    assert f"secret:                {ep['secret']}" in shown.output
    assert cli_json(db_url, "show", str(ep["id"]), "--show-secret")["secret"] == ep["secret"]


def test_show_counts_deliveries_and_lists_the_latest_attempts(db_url: str) -> None:
    ep = add(db_url)
    other = add(db_url)
    sql(
        db_url,
        """
        INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, status, created_at,
                                       last_error, last_status)
        VALUES (1, %(e)s, 'orders', 'pending', now() - interval '10 min', NULL, NULL),
               (2, %(e)s, 'orders', 'pending', now() - interval '1 min', 'HTTP 503', 503),
               (3, %(e)s, 'orders', 'running', now(), NULL, NULL),
               (4, %(e)s, 'orders', 'delivered', now(), NULL, 200),
               (5, %(e)s, 'orders', 'delivered', now(), NULL, 200),
               (6, %(e)s, 'orders', 'failed', now(), 'HTTP 410: gone', 410),
               (7, %(e)s, 'orders', 'cancelled', now(), 'endpoint was disabled', NULL),
               (8, %(o)s, 'orders', 'failed', now(), 'other endpoint', 500)
        """,
        e=ep["id"],
        o=other["id"],
    )
    sql(
        db_url,
        """
        INSERT INTO outbox_attempts (delivery_id, event_id, endpoint_id, at, http_status,
                                     duration_ms, error)
        SELECT 1, 100 + g, %(e)s, now() - make_interval(mins => g),
               CASE WHEN g %% 2 = 0 THEN 500 END, 12.34 * g,
               CASE WHEN g %% 2 = 0 THEN 'HTTP 500: oops' END
        FROM generate_series(1, 12) AS g
        UNION ALL
        SELECT 9, 999, %(o)s, now(), 200, 1, NULL
        """,
        e=ep["id"],
        o=other["id"],
    )

    data = cli_json(db_url, "show", str(ep["id"]))
    d = data["deliveries"]
    assert {s: d[s] for s in ("pending", "running", "delivered", "failed", "cancelled")} == {
        "pending": 2,
        "running": 1,
        "delivered": 2,
        "failed": 1,
        "cancelled": 1,
    }
    assert 600 <= d["oldest_pending_age_s"] < 700
    # The newest delivery tried (event 7) holds the last outcome.
    assert (d["last_error"], d["last_status"]) == ("endpoint was disabled", None)
    attempts = data["recent_attempts"]
    assert [a["event_id"] for a in attempts] == [101 + i for i in range(10)]
    assert attempts[1] == {
        "at": attempts[1]["at"],
        "event_id": 102,
        "http_status": 500,
        "duration_ms": 24.7,
        "error": "HTTP 500: oops",
    }
    assert attempts[0]["http_status"] is None and attempts[0]["error"] is None
    assert data["failing_since"] is None and data["last_success_at"] is None

    human = cli(db_url, "show", str(ep["id"]))
    assert human.exit_code == 0, human.output
    assert (
        "deliveries:            2 pending (oldest 10m), 1 running, 2 delivered, 1 failed, "
        "1 cancelled"
    ) in human.output
    assert "last_error:            endpoint was disabled" in human.output
    assert "latest 10 attempt(s), newest first:" in human.output
    rows = human.output.split("newest first:\n")[1].splitlines()
    assert rows[0].split() == ["AT", "EVENT", "HTTP", "MS", "ERROR"]
    assert rows[1].split()[1:] == ["101", "-", "12", "-"]
    assert rows[2].split()[1:] == ["102", "500", "25", "HTTP", "500:", "oops"]
    assert len(rows) == 11


# --- update ---------------------------------------------------------------------------------


def test_update_changes_only_what_is_given(db_url: str) -> None:
    ep = add(db_url, "--tenant", "acme", "--event-type", "a.b", "--rate-limit", "5")
    moved = cli_json(db_url, "update", str(ep["id"]), "--tenant", "globex")
    assert (moved["tenant"], moved["event_types"], moved["rate_limit"]) == ("globex", ["a.b"], 5)
    assert "secret" not in moved

    res = cli(db_url, "update", str(ep["id"]), "--all-tenants", "--no-rate-limit")
    assert res.exit_code == 0, res.output
    assert "updated endpoint" in res.output and "tenant:                * (every" in res.output
    row = sql(
        db_url,
        "SELECT tenant, event_types, rate_limit, url FROM outbox_endpoints WHERE id = %s",
        ep["id"],
    )
    assert row == [(None, ["a.b"], None, LOCAL)]

    more = cli_json(
        db_url,
        "update",
        str(ep["id"]),
        "--all-event-types",
        "--url",
        "http://127.0.0.1:10/x",
        "--allow-private-networks",
        "--description",
        "new",
    )
    assert (more["event_types"], more["url"], more["description"]) == (
        [],
        "http://127.0.0.1:10/x",
        "new",
    )
    refused = cli(db_url, "update", str(ep["id"]), "--url", LOCAL)
    assert refused.exit_code == 1 and "127.0.0.1" in refused.output
    both = cli(db_url, "update", str(ep["id"]), "--tenant", "a", "--all-tenants")
    assert both.exit_code == 2 and "contradict" in both.output
    nothing = cli(db_url, "update", str(ep["id"]))
    assert nothing.exit_code == 2 and "nothing to change" in nothing.output


# --- disable / enable -----------------------------------------------------------------------


def test_disable_with_a_reason_and_enable(db_url: str) -> None:
    ep = add(db_url)
    res = cli(db_url, "disable", str(ep["id"]), "--reason", "customer asked")
    assert res.exit_code == 0, res.output
    assert f"outbox-relay endpoints enable {ep['id']}" in res.output
    off = cli_json(db_url, "show", str(ep["id"]))
    assert (off["enabled"], off["disabled_reason"]) == (False, "customer asked")
    assert off["disabled_at"] is not None
    assert (
        "state:                 disabled: customer asked"
        in cli(db_url, "show", str(ep["id"])).output
    )

    on = cli_json(db_url, "enable", str(ep["id"]))
    assert (on["enabled"], on["disabled_reason"], on["disabled_at"]) == (True, None, None)
    assert "enabled endpoint" in cli(db_url, "enable", str(ep["id"])).output


# --- rotate-secret --------------------------------------------------------------------------


def test_rotate_secret_prints_the_new_secret_that_show_then_shows(db_url: str) -> None:
    ep = add(db_url)
    res = cli(db_url, "rotate-secret", str(ep["id"]), "--keep-previous-hours", "2")
    assert res.exit_code == 0, res.output
    new = stored_secret(db_url, ep["id"])
    assert new != ep["secret"] and len(key_of(new)) == 32
    assert res.output.count(new) == 1 and ep["secret"] not in res.output
    assert "the previous secret stays valid until" in res.output
    shown = cli_json(db_url, "show", str(ep["id"]), "--show-secret")
    assert shown["secret"] == new
    kept = sql(
        db_url,
        "SELECT previous_secret, extract(epoch FROM previous_secret_until - now()) "
        "FROM outbox_endpoints WHERE id = %s",
        ep["id"],
    )
    assert kept[0][0] == ep["secret"] and 7000 < kept[0][1] <= 7200

    again = cli_json(db_url, "rotate-secret", str(ep["id"]), "--keep-previous-hours", "0")
    assert again["secret"] == stored_secret(db_url, ep["id"]) != new
    nan = cli(db_url, "rotate-secret", str(ep["id"]), "--keep-previous-hours", "nan")
    assert nan.exit_code == 2


# --- delete ---------------------------------------------------------------------------------


def _deliveries(db_url: str, endpoint_id: int) -> None:
    sql(
        db_url,
        "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, status) "
        "VALUES (1, %(e)s, 'orders', 'pending'), (2, %(e)s, 'orders', 'delivered')",
        e=endpoint_id,
    )


def test_delete_needs_yes_off_a_terminal_and_cancels_pending_deliveries(db_url: str) -> None:
    ep = add(db_url)
    _deliveries(db_url, ep["id"])
    refused = cli(db_url, "delete", str(ep["id"]))
    assert refused.exit_code != 0 and "--yes" in refused.output
    assert sql(db_url, "SELECT count(*) FROM outbox_endpoints") == [(1,)]

    res = cli(db_url, "delete", str(ep["id"]), "--yes")
    assert res.exit_code == 0, res.output
    assert f"deleted endpoint {ep['id']}; cancelled 1 unfinished deliveries" in res.output
    assert sql(db_url, "SELECT count(*) FROM outbox_endpoints") == [(0,)]
    assert sql(db_url, "SELECT event_id, status FROM outbox_deliveries ORDER BY 1") == [
        (1, "cancelled"),
        (2, "delivered"),
    ]


def test_delete_on_a_terminal_asks_first(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(terminal, "stdin", lambda: True)
    ep = add(db_url)
    _deliveries(db_url, ep["id"])
    no = cli(db_url, "delete", str(ep["id"]), input="n\n")
    assert no.exit_code == 1 and "cancel its 1 unfinished deliveries?" in no.output
    assert sql(db_url, "SELECT count(*) FROM outbox_endpoints") == [(1,)]
    yes = cli(db_url, "delete", str(ep["id"]), "--json", input="y\n")
    assert yes.exit_code == 0, yes.output
    assert json.loads(yes.stdout) == {"id": ep["id"], "deleted": True, "cancelled": 1}


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["show", "999"],
        ["update", "999", "--description", "x"],
        ["disable", "999"],
        ["enable", "999"],
        ["rotate-secret", "999"],
        ["delete", "999", "--yes"],
    ],
)
def test_an_unknown_id_is_one_clear_error(db_url: str, command: list[str]) -> None:
    res = cli(db_url, *command)
    assert res.exit_code == 1
    assert "no endpoint 999" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("command", [["list"], ["show", "1"], ["delete", "1", "--yes"]])
def test_unreachable_database_is_one_clear_error(command: list[str]) -> None:
    res = cli("postgresql://root:secret@127.0.0.1:1/nope", *command)
    assert res.exit_code == 1
    assert "PostgreSQL is running" in res.output and "secret" not in res.output


def test_an_unmigrated_database_says_to_migrate(empty_db_url: str) -> None:
    res = cli(empty_db_url, "list")
    assert res.exit_code == 1 and "outbox-relay migrate" in res.output


def test_the_schema_option_is_honoured(db_url: str) -> None:
    migrated = CliRunner().invoke(
        main, ["migrate", "--database-url", db_url, "--schema", "Billing"]
    )
    assert migrated.exit_code == 0, migrated.output
    ep = cli_json(db_url, "add", "orders", LOCAL, "--allow-private-networks", "--schema", "Billing")
    assert sql(db_url, 'SELECT id FROM "Billing".outbox_endpoints') == [(ep["id"],)]
    assert sql(db_url, "SELECT count(*) FROM public.outbox_endpoints") == [(0,)]
    assert cli_json(db_url, "list")["endpoints"] == []
    shown = cli_json(db_url, "show", str(ep["id"]), "--schema", "Billing")
    assert shown["deliveries"]["pending"] == 0


def test_the_relay_config_names_the_database_and_schema(db_url: str, tmp_path: Path) -> None:
    migrated = CliRunner().invoke(
        main, ["migrate", "--database-url", db_url, "--schema", "Billing"]
    )
    assert migrated.exit_code == 0, migrated.output
    cfg = tmp_path / "relay.toml"
    cfg.write_text(f"database_url = '{db_url}'\n[relay]\nschema = 'Billing'\n")
    env = {"OUTBOX_DATABASE_URL": None, "OUTBOX_SCHEMA": None, "OUTBOX_RELAY_SCHEMA": None}

    def endpoints(*args: str) -> Any:
        res = CliRunner().invoke(main, ["endpoints", *args, "--config", str(cfg)], env=env)
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    ep = endpoints("add", "orders", LOCAL, "--allow-private-networks", "--json")
    assert sql(db_url, 'SELECT id FROM "Billing".outbox_endpoints') == [(ep["id"],)]
    assert [e["id"] for e in endpoints("list", "--json")["endpoints"]] == [ep["id"]]
    assert endpoints("delete", str(ep["id"]), "--yes", "--json")["deleted"] is True
    # An invalid one: the error of `run --check`, exit 2.
    cfg.write_text(f"database_url = '{db_url}'\n[relay]\nbatchsize = 3\n")
    res = CliRunner().invoke(main, ["endpoints", "list", "--config", str(cfg)], env=env)
    assert res.exit_code == 2 and "relay.batchsize" in res.stderr, res.output


# --- the real entry point -------------------------------------------------------------------


def test_the_command_reads_the_url_from_the_environment(db_url: str) -> None:
    env = {"OUTBOX_DATABASE_URL": db_url, "PATH": "/usr/bin:/bin"}
    args = ["endpoints", "add", "orders", LOCAL, "--json", "--allow-private-networks"]
    run = subprocess.run(
        [sys.executable, "-m", "relay.cli", *args],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["destination"] == "orders"


def test_listing_the_commands_loads_neither_sqlalchemy_nor_the_relay() -> None:
    modules = imported("from relay.cli import main; main(['endpoints', 'add', '--help'])")
    assert "relay.cli.endpoints" in modules
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY or m.startswith(HEAVY))
    assert not heavy, heavy
    assert "outbox.endpoints" not in modules


# --- the event catalog's word on --event-type ------------------------------------------------


def test_add_and_update_warn_of_a_type_the_catalog_lacks(db_url: str, tmp_path: Path) -> None:
    from outbox.catalog import Catalog, EventType

    catalog = Catalog()
    catalog.add(EventType.from_schema("invoice.paid", {"type": "object"}, destinations=["orders"]))
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(catalog.export()))
    spec = ["--catalog", str(path)]
    res = cli(
        db_url,
        "add",
        "orders",
        LOCAL,
        "--allow-private-networks",
        "--event-type",
        "invoice.payed",
        *spec,
    )
    assert res.exit_code == 0, res.output  # a warning, not a refusal: the endpoint is added
    assert (
        "warning: event type 'invoice.payed' is not in the catalog; did you mean 'invoice.paid'?"
        in res.stderr
    )
    [(endpoint_id, types)] = sql(db_url, "SELECT id, event_types FROM outbox_endpoints")
    assert types == ["invoice.payed"]
    res = cli(db_url, "update", str(endpoint_id), "--event-type", "invoice.paid", *spec)
    assert res.exit_code == 0, res.output
    assert "warning" not in res.stderr
    res = cli(
        db_url,
        "add",
        "orders",
        LOCAL,
        "--allow-private-networks",
        "--event-type",
        "x",
        "--catalog",
        "nowhere:c",
    )
    assert res.exit_code == 0, res.output
    assert "cannot load the catalog 'nowhere:c'" in res.stderr and "not checked" in res.stderr
    # Without a catalog nothing is said.
    res = cli(db_url, "add", "orders", LOCAL, "--allow-private-networks", "--event-type", "x")
    assert res.exit_code == 0 and "warning: event type" not in res.stderr
