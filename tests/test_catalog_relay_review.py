"""The relay side of the event catalog (#31) as a hostile review found it: each test failed
before its fix (the two guards excepted, said so)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from relay.catalog.documents import read_previous
from relay.catalog.view import load_view
from tests.support import catalogs
from tests.support.portal import Served
from tests.test_portal_api import with_catalog  # noqa: F401 - the portal with the catalog

URL = "http://127.0.0.1:9/in"


async def test_another_tenants_endpoint_is_404_whatever_the_types(
    with_catalog: Served,  # noqa: F811
) -> None:
    # (passes at HEAD: the lock comes before check_types; kept as a guard)
    async with with_catalog.client("a") as a:
        r = await a.post("/endpoints", json={"url": URL, "event_types": ["order.created"]})
        assert r.status_code == 201
        theirs = r.json()["id"]
    async with with_catalog.client("b") as b:
        unknown = await b.patch(f"/endpoints/{theirs}", json={"event_types": ["nope"]})
        known = await b.patch(f"/endpoints/{theirs}", json={"event_types": ["order.created"]})
        missing = await b.patch("/endpoints/999999", json={"event_types": ["nope"]})
    assert unknown.status_code == known.status_code == missing.status_code == 404
    assert unknown.json()["detail"].replace(str(theirs), "N") == missing.json()["detail"].replace(
        "999999", "N"
    )


def test_read_previous_refuses_a_deeply_nested_file(tmp_path: Path) -> None:
    # FAILS at HEAD: RecursionError escapes (a traceback, exit 1 = "a problem", not 2).
    path = tmp_path / "deep.json"
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ValueError, match=r"deep\.json"):
        read_previous(path)
    ext = tmp_path / "deep-ext.json"
    ext.write_text(json.dumps({"asyncapi": "3.0.0", "x-outbox-catalog": "{" * 100_000}))
    with pytest.raises(ValueError, match=r"deep-ext\.json"):
        read_previous(ext)


@pytest.mark.parametrize(
    "types",
    [[1, "x"], [{"name": "order.created"}], [{"name": ["unhashable"], "portable": "no"}]],
)
def test_read_previous_refuses_types_that_are_not_exported_types(
    tmp_path: Path, types: list[object]
) -> None:
    # FAILS at HEAD: accepted, then compare() crashes (TypeError) or misreports.
    path = tmp_path / "prev.json"
    path.write_text(json.dumps({"format": "outbox-catalog/1", "types": types}))
    with pytest.raises(ValueError, match=r"prev\.json"):
        read_previous(path)


def test_a_catalog_module_that_exits_does_not_stop_the_relay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # FAILS at HEAD: load_view catches Exception only; an application module that calls
    # sys.exit (argparse at import, a Django manage-style guard) kills the relay at start.
    (tmp_path / "rev2_exiting_catalog.py").write_text("import sys\nsys.exit(2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "rev2_exiting_catalog", raising=False)
    view = load_view("rev2_exiting_catalog:catalog", None)
    assert view is not None and not view.available and "SystemExit" in (view.error or "")


def _settings(folder: Path, body: str):  # type: ignore[no-untyped-def]
    from relay.settings import load_settings

    path = folder / "relay.toml"
    path.write_text('database_url = "postgresql://u:pw@db/x"\n' + body)
    return load_settings(path)


def test_the_document_names_no_path_of_the_machine_that_built_it(tmp_path: Path) -> None:
    # FAILS at HEAD: x-outbox-catalog carries each type's `origin` (the schema file's path as
    # given, often absolute; or pydantic:<module>.<class>) to every consumer of the document.
    from outbox.catalog import Catalog, EventType
    from relay.catalog.asyncapi import build, render

    folder = tmp_path / "srv-app-internal"
    folder.mkdir()
    (folder / "order.json").write_text('{"type": "object"}')
    catalog = Catalog(title="t", version="1")
    catalog.add(EventType.from_schema("order.created", folder / "order.json", destinations=["h"]))
    s = _settings(
        tmp_path,
        '[destinations.h]\nkind = "webhook"\nurl = "https://h.example.com/x"\n'
        'secrets = ["whsec_' + "QUFB" * 8 + '"]\n',
    )
    assert "srv-app-internal" not in render(build(catalog.export(), s))


def test_sasl_plaintext_is_not_described_as_tls(tmp_path: Path) -> None:
    # FAILS at HEAD: every protocol but PLAINTEXT is "kafka-secure" (TLS), SASL_PLAINTEXT too.
    from outbox.catalog import Catalog
    from relay.catalog.asyncapi import build

    s = _settings(
        tmp_path,
        '[kafka]\nbootstrap_servers = ["k:9092"]\nsecurity_protocol = "SASL_PLAINTEXT"\n'
        'sasl_mechanism = "PLAIN"\nsasl_plain_username = "u"\nsasl_plain_password = "p"\n'
        '[destinations.o]\nkind = "kafka"\ntopic = "t"\n',
    )
    doc = build(Catalog(title="t", version="1").export(), s)
    assert doc["servers"]["kafka"]["protocol"] == "kafka"


def test_documenting_ends_with_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Passes at HEAD; the existing test_the_placeholder_secret_is_for_documenting_only would
    # still pass if _documenting() never reset the variable (it runs no documenting command
    # first). This one runs `catalog asyncapi` then loads the same file in the same process.
    from click.testing import CliRunner

    from relay.cli import main
    from relay.config.base import ConfigError
    from relay.config.environment import documenting

    monkeypatch.delenv("REV2_UNSET_SECRET", raising=False)
    spec = catalogs.write_export(tmp_path)
    body = '[destinations.h]\nkind = "webhook"\nurl = "https://h.example.com/x"\n'
    body += 'secret_env = "REV2_UNSET_SECRET"\n'
    (tmp_path / "relay.toml").write_text(body)
    for command in ("asyncapi", "export", "check"):
        res = CliRunner().invoke(
            main, ["catalog", command, "--config", str(tmp_path / "relay.toml"), "--catalog", spec]
        )
        assert res.exit_code in (0, 1), res.output
        assert documenting.get() is False
        with pytest.raises(ConfigError, match="REV2_UNSET_SECRET"):
            _settings(tmp_path, body)


def test_the_portal_hints_only_at_types_it_lists() -> None:
    from relay.portal.changes import Policy, Refused

    policy = Policy(
        ("hooks",),
        types={"hooks": frozenset({"order.created"}), "other": frozenset({"invoice.paid"})},
    )
    with pytest.raises(Refused) as listed:
        policy.check_types("hooks", ["order.creatd"])
    assert "did you mean 'order.created'" in str(listed.value)
    with pytest.raises(Refused) as unlisted:  # a destination the portal does not offer
        policy.check_types("other", ["invoice.payed"])
    assert "did you mean" not in str(unlisted.value)


def test_endpoints_json_stays_json_when_the_catalog_prints(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from relay.cli import main

    (tmp_path / "rev2_noisy_catalog.py").write_text(
        "print('hello from the application')\n"
        "from outbox.catalog import Catalog\ncatalog = Catalog()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("OUTBOX_CATALOG_SOURCE", "nowhere:ignored")  # never read implicitly
    args = ["endpoints", "add", "orders", URL, "--database-url", db_url, "--json"]
    res = CliRunner().invoke(
        main,
        [
            *args,
            "--allow-private-networks",
            "--event-type",
            "t",
            "--catalog",
            "rev2_noisy_catalog:catalog",
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["event_types"] == ["t"]
    assert "hello from the application" in res.stderr
