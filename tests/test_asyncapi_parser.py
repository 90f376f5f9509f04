"""The documents relay/catalog/asyncapi.py builds, read by the AsyncAPI project's own parser
(@asyncapi/parser, pinned in tests/asyncapi; tests/support/asyncapi.py installs it): no error,
and the parser reads the channels, operations, messages and payloads we meant. One node process
for every document of the module. A broken document is seen to fail, so a parser that stopped
reporting would not pass unnoticed."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from relay.catalog import build, render
from relay.catalog.names import escape
from tests.support import asyncapi
from tests.support.catalog_docs import CONFIGS, catalog, clashing_catalog, settings

# Each document: the configuration, the catalog, and whether webhook channels give their path.
DOCUMENTS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "everything": (CONFIGS["everything"], catalog(), False),
    "everything-paths": (CONFIGS["everything"], catalog(), True),
    "kafka-only": (CONFIGS["kafka-only"], catalog(), False),
    "http-only": (CONFIGS["http-only"], catalog(), True),
    "clashing-keys": (CONFIGS["kafka-only"], clashing_catalog(), False),
}
BROKEN = "broken"


def broken(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` with one reference written the 2020-12 way (a pydantic schema's
    ``#/$defs/Line``), which does not resolve in an AsyncAPI document."""
    bad = copy.deepcopy(document)
    bad["components"]["schemas"]["order.created"]["properties"]["lines"]["items"] = {
        "$ref": "#/$defs/Line"
    }
    return bad


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    built = {}
    for name, (config, exported, paths) in DOCUMENTS.items():
        s = settings(tmp_path_factory.mktemp(name), config)
        built[name] = build(exported, s, webhook_paths=paths)
    built[BROKEN] = broken(built["kafka-only"])
    return built


@pytest.fixture(scope="module")
def parsed(
    documents: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("documents")
    paths = []
    for name, document in documents.items():
        path = folder / f"{name}.json"
        path.write_text(render(document))
        paths.append(path)
    results = asyncapi.check(paths)
    return {Path(r["path"]).stem: r for r in results}


def errors(result: dict[str, Any]) -> list[str]:
    return [
        f"{d['code']} at {'.'.join(d['path'])}: {d['message']}"
        for d in result["diagnostics"]
        if d["severity"] == 0
    ]


def dereference(document: dict[str, Any], schema: Any, seen: tuple[str, ...] = ()) -> Any:
    """``schema`` with its references replaced by what they point to, as the parser resolves
    them; a reference back to a schema being expanded is ``{"$circular": true}``, as check.js
    writes a recursion."""
    if isinstance(schema, list):
        return [dereference(document, s, seen) for s in schema]
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref")
    if isinstance(ref, str):
        if ref in seen:
            return {"$circular": True}
        node: Any = document
        for part in ref[2:].split("/"):
            node = node[part]
        return dereference(document, node, (*seen, ref))
    return {k: dereference(document, v, seen) for k, v in schema.items()}


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_the_parser_finds_no_error(parsed: dict[str, dict[str, Any]], name: str) -> None:
    assert errors(parsed[name]) == []
    assert "channels" in parsed[name]  # a document was made of it


def test_a_broken_document_is_an_error(parsed: dict[str, dict[str, Any]]) -> None:
    found = errors(parsed[BROKEN])
    assert found and any("invalid-ref" in e and "$defs/Line" in e for e in found), found


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_channels_are_the_destinations(
    parsed: dict[str, dict[str, Any]],
    documents: dict[str, dict[str, Any]],
    name: str,
    tmp_path: Path,
) -> None:
    config, exported, paths = DOCUMENTS[name]
    s = settings(tmp_path, config)
    expected = {}
    for destination, d in s.destinations.items():
        address = getattr(d, "topic", None)
        if paths and d.kind == "webhook":
            address = "/hooks/path-only-with-webhook-paths"
        expected[escape(destination)] = address
    channels = parsed[name]["channels"]
    assert {c["id"]: c["address"] for c in channels} == expected
    for c in channels:
        declared = {
            escape(t["name"])
            for t in exported["types"]
            if documents[name]["channels"][c["id"]]["title"] in t["destinations"]
        }
        assert {m["id"] for m in c["messages"]} == declared


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_an_operation_sends_each_channels_messages(
    parsed: dict[str, dict[str, Any]], name: str
) -> None:
    channels = {c["id"]: c for c in parsed[name]["channels"]}
    operations = {o["id"]: o for o in parsed[name]["operations"]}
    assert set(operations) == {f"send-{c}" for c in channels}
    for cid, channel in channels.items():
        operation = operations[f"send-{cid}"]
        assert operation["action"] == "send" and operation["channels"] == [cid]
        assert sorted(operation["messages"]) == sorted(m["id"] for m in channel["messages"])


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_each_payload_the_parser_resolves_is_our_schema(
    parsed: dict[str, dict[str, Any]], documents: dict[str, dict[str, Any]], name: str
) -> None:
    document = documents[name]
    compared = 0
    for channel in parsed[name]["channels"]:
        ours = document["channels"][channel["id"]]["messages"]
        for message in channel["messages"]:
            payload = ours[message["id"]]["payload"]
            component = payload["properties"]["data"] if "properties" in payload else payload
            assert component["$ref"].startswith("#/components/schemas/")
            expected = dereference(document, component)
            resolved = message["payload"]
            if "properties" in payload:  # a structured CloudEvent: the type's schema is its data
                resolved = resolved["properties"]["data"]
            assert json.dumps(resolved, sort_keys=True) == json.dumps(expected, sort_keys=True)
            compared += 1
    assert compared >= 2


def test_without_node_the_tests_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not root: nothing is installed, and the error names the packages.
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(RuntimeError, match=r"need Node\.js and npm: install them"):
        asyncapi.parser()
