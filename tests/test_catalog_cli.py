"""`outbox-relay catalog export | asyncapi | check`, `[catalog]`, and the catalog's warnings on
`endpoints add --event-type`: the commands run as CI runs them, without the database or the
webhook secrets, on a catalog module of an application's own (written to a temporary folder)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from relay.catalog.checks import problems, type_warnings
from relay.catalog.documents import read_previous
from relay.cli import main
from relay.config.base import ConfigError
from relay.settings import load_settings

APP = '''
from typing import Literal

from pydantic import BaseModel

from outbox.catalog import Catalog

catalog = Catalog(title="shop events", version="7", validate="reject")


class Line(BaseModel):
    sku: str
    quantity: int


@catalog.event(
    "order.created",
    version=3,
    destinations=["orders"],
    key="the order id",
    examples=[{"order_id": 1, "currency": "EUR", "lines": []}],
)
class OrderCreated(BaseModel):
    """An order was placed."""

    order_id: int
    currency: Literal["EUR", "USD"]
    lines: list[Line]


@catalog.event("invoice.paid", destinations=["orders", "hooks"])
class InvoicePaid(BaseModel):
    invoice_id: int
'''

CONFIG = """
database_url = "postgresql://root:db-password-never-shown@127.0.0.1/postgres"
[kafka]
bootstrap_servers = ["kafka.internal:9092"]
[destinations.orders]
kind = "kafka"
topic = "orders"
[destinations.hooks]
kind = "webhook"
url = "https://hooks.example.com/in?token=query-token-never-shown"
secret_env = "CATALOG_TEST_UNSET_SECRET"
"""


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding the application's catalog (shop_events:catalog) and its relay.toml,
    the working directory of the commands; no webhook secret in the environment."""
    (tmp_path / "shop_events.py").write_text(textwrap.dedent(APP))
    (tmp_path / "relay.toml").write_text(CONFIG)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("CATALOG_TEST_UNSET_SECRET", raising=False)
    monkeypatch.delenv("OUTBOX_CATALOG_SOURCE", raising=False)
    monkeypatch.delenv("OUTBOX_DATABASE_URL", raising=False)
    return tmp_path


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner(env=env).invoke(main, ["catalog", *args])


def test_export_writes_the_catalog_as_json(app: Path) -> None:
    res = run("export", "--catalog", "shop_events:catalog", "-o", "catalog.json")
    assert res.exit_code == 0, res.output
    exported = json.loads((app / "catalog.json").read_text())
    assert exported["format"] == "outbox-catalog/1"
    assert [t["name"] for t in exported["types"]] == ["invoice.paid", "order.created"]
    # The export is what a relay without the application's code reads back.
    again = run("export", "--catalog", "catalog.json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout) == exported


def test_asyncapi_needs_neither_the_database_nor_the_secrets(app: Path) -> None:
    res = run("asyncapi", "--config", "relay.toml", "--catalog", "shop_events:catalog")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["asyncapi"] == "3.0.0"
    assert sorted(doc["channels"]) == ["hooks", "orders"]
    assert sorted(doc["channels"]["orders"]["messages"]) == ["invoice.paid", "order.created"]
    assert sorted(doc["channels"]["hooks"]["messages"]) == ["invoice.paid"]
    from relay.config.environment import PLACEHOLDER_SECRET

    for secret in ("db-password-never-shown", "query-token-never-shown", PLACEHOLDER_SECRET):
        assert secret not in res.stdout


def test_the_placeholder_secret_is_for_documenting_only(app: Path) -> None:
    # `run --check` on the same file still refuses the unset variable.
    with pytest.raises(ConfigError, match="CATALOG_TEST_UNSET_SECRET"):
        load_settings(app / "relay.toml")
    res = CliRunner().invoke(main, ["run", "--check", "--config", "relay.toml"])
    assert res.exit_code == 2, res.output
    assert "CATALOG_TEST_UNSET_SECRET" in res.output


def test_the_catalog_comes_from_the_option_the_variable_or_the_config(app: Path) -> None:
    out = run("asyncapi", "--config", "relay.toml", "--catalog", "shop_events:catalog").stdout
    env = {"OUTBOX_CATALOG_SOURCE": "shop_events:catalog"}
    assert run("asyncapi", "--config", "relay.toml", env=env).stdout == out
    (app / "relay.toml").write_text(CONFIG + '[catalog]\nsource = "shop_events:catalog"\n')
    assert run("asyncapi", "--config", "relay.toml").stdout == out
    (app / "relay.toml").write_text(CONFIG)
    res = run("asyncapi", "--config", "relay.toml")
    assert res.exit_code == 2
    assert "say which catalog" in res.output


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("nowhere:catalog", "no module 'nowhere'"),
        ("shop_events:nothing", "nothing"),
        ("missing.json", "missing.json"),
    ],
)
def test_a_catalog_that_cannot_load_is_exit_2_naming_it(app: Path, spec: str, said: str) -> None:
    res = run("export", "--catalog", spec)
    assert res.exit_code == 2, res.output
    assert f"cannot load the catalog {spec!r}" in res.output
    assert said in res.output


def test_a_bad_catalog_source_is_a_configuration_error(app: Path) -> None:
    (app / "relay.toml").write_text(CONFIG + '[catalog]\nsource = "not a spec"\n')
    res = run("asyncapi", "--config", "relay.toml")
    assert res.exit_code == 2, res.output
    assert "catalog.source" in res.output and "module:attr" in res.output


def test_check_reports_a_destination_the_relay_lacks(app: Path) -> None:
    (app / "relay.toml").write_text(CONFIG.replace("[destinations.hooks]", "[destinations.other]"))
    res = run("check", "--config", "relay.toml", "--catalog", "shop_events:catalog")
    assert res.exit_code == 1, res.output
    assert "invoice.paid: destination 'hooks' is not configured" in res.output


def test_check_warns_of_a_channel_whose_types_no_header_tells_apart(app: Path) -> None:
    res = run("check", "--config", "relay.toml", "--catalog", "shop_events:catalog")
    assert res.exit_code == 0, res.output
    assert "destination 'orders' carries 2 types" in res.output
    enveloped = CONFIG.replace(
        'topic = "orders"', 'topic = "orders"\nenvelope = "cloudevents"\nsource = "/shop"'
    )
    (app / "relay.toml").write_text(enveloped)
    res = run("check", "--config", "relay.toml", "--catalog", "shop_events:catalog")
    assert res.exit_code == 0, res.output
    assert "carries" not in res.output


def test_problems_name_a_type_cloudevents_refuses(app: Path) -> None:
    settings = load_settings(
        app / "relay.toml",
        database_url="postgresql://x@localhost/db",
        destinations={
            "orders": {"kind": "kafka", "topic": "o", "envelope": "cloudevents", "source": "/s"}
        },
    )
    catalog = {"types": [{"name": "bad\x01type", "destinations": ["orders"]}]}
    assert problems(catalog, settings) == [
        ("error", "bad\x01type: as a CloudEvents type on 'orders' it holds a control character")
    ]
    assert problems(catalog, None) == []


def _previous(app: Path, as_asyncapi: bool) -> Path:
    cmd = ("asyncapi", "--config", "relay.toml") if as_asyncapi else ("export",)
    res = run(*cmd, "--catalog", "shop_events:catalog", "-o", "previous.json")
    assert res.exit_code == 0, res.output
    return app / "previous.json"


@pytest.mark.parametrize("as_asyncapi", [True, False], ids=["asyncapi", "export"])
def test_read_previous_takes_a_document_or_an_export(app: Path, as_asyncapi: bool) -> None:
    exported = json.loads(run("export", "--catalog", "shop_events:catalog").stdout)
    previous = read_previous(_previous(app, as_asyncapi))
    if as_asyncapi:  # the document names neither where a type was declared nor its mode
        assert {t["origin"] for t in previous["types"]} == {"asyncapi:previous.json"}
        for t in (*previous["types"], *exported["types"]):
            del t["origin"], t["validate"]
    assert previous == exported


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("not json", "not a readable JSON file"),
        ('{"asyncapi": "3.0.0"}', "without x-outbox-catalog"),
        ('{"format": "something/2", "types": []}', "neither an AsyncAPI document"),
        ('{"format": "outbox-catalog/1"}', "without its list of types"),
    ],
)
def test_read_previous_names_what_the_file_is_instead(
    tmp_path: Path, content: str, said: str
) -> None:
    path = tmp_path / "previous.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=said):
        read_previous(path)


CATALOG: dict[str, Any] = {
    "types": [
        {"name": "invoice.paid", "destinations": ["orders"], "deprecated": False},
        {"name": "order.created", "destinations": ["orders", "hooks"], "deprecated": False},
        {"name": "order.legacy", "destinations": ["hooks"], "deprecated": True},
    ]
}


def test_type_warnings() -> None:
    assert type_warnings(CATALOG, "hooks", ("order.created",)) == []
    assert type_warnings(CATALOG, "hooks", ("invoice.payed",)) == [
        "event type 'invoice.payed' is not in the catalog; did you mean 'invoice.paid'?"
    ]
    assert type_warnings(CATALOG, "hooks", ("zzz",)) == ["event type 'zzz' is not in the catalog"]
    assert type_warnings(CATALOG, "hooks", ("invoice.paid",)) == [
        "event type 'invoice.paid' is declared for orders, not for 'hooks'"
    ]
    assert type_warnings(CATALOG, None, ("invoice.paid", "order.legacy")) == [
        "event type 'order.legacy' is deprecated"
    ]


def test_run_check_loads_the_catalog_source(app: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CATALOG_TEST_UNSET_SECRET", "whsec_" + "A" * 43 + "=")
    base = CONFIG + '[catalog]\nsource = "{}"\n'
    (app / "relay.toml").write_text(base.format("shop_events:catalog"))
    res = CliRunner().invoke(main, ["run", "--check", "--config", "relay.toml"])
    assert res.exit_code == 0, res.output
    assert "warning: catalog: destination 'orders' carries 2 types" in res.stderr
    (app / "relay.toml").write_text(base.format("shop_events:missing"))
    res = CliRunner().invoke(main, ["run", "--check", "--config", "relay.toml"])
    assert res.exit_code == 2, res.output
    assert "catalog.source 'shop_events:missing' does not load" in res.stderr


def test_check_against_the_previous_release(app: Path) -> None:
    """The previous release's document committed, then a required field added: exit 3 and the
    change named; --allow lets it through; --json counts it; a catalog problem besides wins."""
    assert _previous(app, as_asyncapi=True).exists()
    (app / "shop_events.py").write_text(
        textwrap.dedent(APP).replace("    invoice_id: int", "    invoice_id: int\n    paid_at: str")
    )
    sys.modules.pop("shop_events", None)  # the next release: a new process would import it anew
    args = ("check", "--config", "relay.toml", "--catalog", "shop_events:catalog")
    res = run(*args, "--against", "previous.json")
    assert res.exit_code == 3, res.output
    assert "BREAKING invoice.paid payload.paid_at: required field added" in res.stdout
    res = run(*args, "--against", "previous.json", "--allow", "invoice.paid")
    assert res.exit_code == 0, res.output
    assert "(allowed)" in res.stdout
    res = run(*args, "--against", "previous.json", "--json")
    assert res.exit_code == 3
    out = json.loads(res.stdout)
    assert out["breaking"] == 1
    assert [c["path"] for c in out["changes"] if c["verdict"] == "breaking"] == ["payload.paid_at"]
    (app / "relay.toml").write_text(CONFIG.replace("[destinations.hooks]", "[destinations.other]"))
    res = run(*args, "--against", "previous.json")
    assert res.exit_code == 1, res.output  # the catalog's own problem first
    assert "BREAKING" in res.stdout


def test_check_against_itself_is_no_change(app: Path) -> None:
    _previous(app, as_asyncapi=False)
    res = run("check", "--catalog", "shop_events:catalog", "--against", "previous.json")
    assert res.exit_code == 0, res.output
    assert res.stdout == "no change against previous.json\n"
