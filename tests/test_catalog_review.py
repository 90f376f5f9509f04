"""Hostile review of #31 (application side): each test failed on 4a76629 and names a bug."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from outbox import Outbox
from outbox.catalog import Catalog, CatalogError, EventSchemaError, EventType

SECRET = "alice@example.com"


def box(schema: dict[str, Any], mode: str = "reject", **kw: Any) -> Outbox:
    catalog = Catalog(validate=mode)  # type: ignore[arg-type]
    catalog.add(EventType.from_schema("t", schema, destinations=["d"], **kw))
    return Outbox(catalog=catalog)


def refusal(schema: dict[str, Any], payload: Any, **kw: Any) -> EventSchemaError:
    with pytest.raises(EventSchemaError) as err:
        box(schema)._message("d", payload, kw.get("key"), None, None, None, event_type="t")
    return err.value


# --- PII: a key of the payload is a value too ------------------------------------------------


@pytest.mark.parametrize(
    "names",
    [{"maxLength": 3}, {"pattern": "^z"}, {"format": "uuid"}, {"enum": ["a"]}],
)
def test_property_names_errors_carry_no_key(names: dict[str, Any]) -> None:
    err = refusal({"type": "object", "propertyNames": names}, {SECRET: 1})
    assert SECRET not in str(err), str(err)  # '"alice@example.com" is longer than 3 characters'


def test_additional_properties_message_carries_no_key() -> None:
    schema = {
        "type": "object",
        "patternProperties": {"^id$": {}},
        "additionalProperties": False,
    }
    err = refusal(schema, {"id": 1, SECRET: 1, "bob@example.com": 2})
    assert SECRET not in str(err) and "bob@" not in str(err), str(err)


def test_map_keys_reach_neither_field_nor_path() -> None:
    schema = {
        "type": "object",
        "properties": {"scores": {"type": "object", "additionalProperties": {"type": "integer"}}},
    }
    err = refusal(schema, {"scores": {SECRET: "x"}})
    assert SECRET not in err.field and SECRET not in err.path, (err.field, err.path)


def test_warn_logs_no_map_key(caplog: pytest.LogCaptureFixture) -> None:
    out = box({"type": "object", "additionalProperties": {"type": "integer"}}, "warn")
    with caplog.at_level(logging.WARNING, logger="outbox.catalog"):
        out._message("d", {SECRET: "x"}, None, None, None, None, event_type="t")
    assert caplog.records and SECRET not in caplog.text, caplog.text


# --- the warn throttle -----------------------------------------------------------------------


def test_warn_throttle_holds_one_line_per_rule_not_per_index(
    caplog: pytest.LogCaptureFixture,
) -> None:
    out = box({"type": "array", "items": {"type": "integer"}}, "warn")
    with caplog.at_level(logging.WARNING, logger="outbox.catalog"):
        for i in range(200):
            out._message("d", [0] * i + ["x"], None, None, None, None, event_type="t")
    # "at most once a minute per type, field and rule": 200 lines, 200 subjects kept forever
    assert len(caplog.records) == 1, len(caplog.records)


# --- bypasses --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["", "   "])
def test_a_type_with_a_key_refuses_an_empty_key(key: str) -> None:
    out = box({"type": "object"}, key="the order id")
    with pytest.raises(EventSchemaError, match="key"):
        out._message("d", {}, key, None, None, None, event_type="t")


def test_keys_that_collide_once_encoded_are_not_validated_by_the_last_one() -> None:
    out = box({"type": "object", "properties": {"1": {"type": "string"}}})
    # stored b'{"1":5,"1":"ok"}': validated as {"1": "ok"}, a first-wins reader gets 5
    with pytest.raises(EventSchemaError):
        out._message("d", {1: 5, "1": "ok"}, None, None, None, None, event_type="t")  # type: ignore[dict-item]


def test_a_dict_subclass_is_validated_as_stored() -> None:
    class Odd(dict[str, Any]):
        def items(self) -> Any:  # json.dumps uses it, jsonschema-rs does not
            return [("n", "not an int")]

    out = box({"type": "object", "properties": {"n": {"type": "integer"}}})
    with pytest.raises(EventSchemaError):
        out._message("d", Odd(n=1), None, None, None, None, event_type="t")


# --- schemas that break at enqueue instead of at declaration ---------------------------------


@pytest.mark.parametrize(
    "schema",
    [{"type": "strng"}, {"properties": {"a": {"pattern": "(("}}}, {"minLength": -1}],
)
def test_an_invalid_schema_is_refused_at_declaration(schema: dict[str, Any]) -> None:
    with pytest.raises(CatalogError):
        EventType.from_schema("t", schema, destinations=["d"])


def test_an_invalid_schema_is_refused_naming_the_place() -> None:
    schema = {"properties": {"a": {"pattern": "(("}}}
    with pytest.raises(CatalogError, match=r"'t'.*\(\(.*at #/properties/a/pattern"):
        EventType.from_schema("t", schema, destinations=["d"])


def test_warn_mode_never_fails_the_business_write(caplog: pytest.LogCaptureFixture) -> None:
    # Constructed as is (as an export loaded without jsonschema-rs would be): never compiled.
    broken = EventType(
        name="t",
        version=1,
        description=None,
        schema={"type": "strng"},
        portable={"type": "strng"},
        definitions={},
        destinations=("d",),
    )
    catalog = Catalog(validate="warn")
    catalog.add(broken)
    with caplog.at_level(logging.WARNING, logger="outbox.catalog"):
        for _ in range(3):
            Outbox(catalog=catalog)._message("d", {}, None, None, None, None, event_type="t")
    assert [r.getMessage().split()[:2] for r in caplog.records] == [
        ["outbox.catalog.broken", "event_type=t"]
    ]
    with pytest.raises(CatalogError, match="not a valid JSON Schema"):
        rejecting = Catalog(validate="reject")
        rejecting.add(broken)
        Outbox(catalog=rejecting)._message("d", {}, None, None, None, None, event_type="t")


# --- loading an export -----------------------------------------------------------------------


def _export_with(**changes: Any) -> dict[str, Any]:
    catalog = Catalog()
    catalog.add(EventType.from_schema("t", {"type": "object"}, destinations=["d"]))
    exported = catalog.export()
    exported["types"][0].update(changes)
    return exported


@pytest.mark.parametrize(
    "changes",
    [
        {"schema": {"$ref": "https://example.com/x.json"}},
        {"schema": {"unevaluatedProperties": False}},
        {"schema": {"type": "strng"}},
        {"examples": [1]},
        {"origin": 5},
    ],
)
def test_load_checks_what_declaration_checks(changes: dict[str, Any]) -> None:
    with pytest.raises(CatalogError):
        Catalog.load(_export_with(**changes))


def test_a_deeply_nested_export_is_a_catalog_error(tmp_path: Path) -> None:
    file = tmp_path / "c.json"
    file.write_text('{"format": "outbox-catalog/1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CatalogError):
        Catalog.load(file)


def test_load_catalog_takes_an_upper_case_json_path(tmp_path: Path) -> None:
    from outbox.catalog import load_catalog

    file = tmp_path / "CATALOG.JSON"
    file.write_text(json.dumps(_export_with()))
    assert len(load_catalog(str(file))) == 1  # today: "no module '/tmp/...'"


# --- file references -------------------------------------------------------------------------


def test_a_ref_outside_the_schema_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "private.json").write_text('{"description": "not for publication"}')
    folder = tmp_path / "schemas"
    folder.mkdir()
    for ref in ("../private.json", str(tmp_path / "private.json")):
        with pytest.raises(CatalogError):
            EventType.from_schema("t", {"$ref": ref}, destinations=["d"], base_dir=folder)


# --- validate="off" and jsonschema-rs --------------------------------------------------------


def test_an_off_catalog_with_examples_says_it_needs_jsonschema_rs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "jsonschema_rs", None)  # as if not installed
    catalog = Catalog(validate="off")
    # Examples are what consumers copy: checked whatever the mode, and said so.
    with pytest.raises(
        CatalogError, match=r"examples needs jsonschema-rs.*outbox-relay\[catalog\]"
    ):
        EventType.from_schema("t", {"type": "object"}, destinations=["d"], examples=[{}])
    # Without examples, and loaded from an export, nothing needs it.
    catalog.add(EventType.from_schema("t", {"type": "strng"}, destinations=["d"]))
    assert len(Catalog.load(catalog.export())) == 1


# --- the fixes, beyond the findings ----------------------------------------------------------


def test_messages_are_our_own_where_jsonschema_rs_would_quote_a_key() -> None:
    names = refusal({"type": "object", "propertyNames": {"maxLength": 3}}, {SECRET: 1})
    assert (names.field, names.keyword) == ("payload", "propertyNames")
    assert names.message == "a property name is not allowed (maxLength 3) (t v1: propertyNames)"
    closed = {"type": "object", "properties": {"id": {}}, "additionalProperties": False}
    extra = refusal(closed, {"id": 1, SECRET: 1})
    assert (extra.field, extra.path, extra.keyword) == ("payload[*]", "/*", "additionalProperties")
    assert extra.message.startswith("an unexpected property")


def test_declared_names_are_kept_through_refs_and_combinators() -> None:
    schema = {
        "type": "object",
        "properties": {"lines": {"type": "array", "items": {"$ref": "#/$defs/Line"}}},
        "allOf": [{"properties": {"tags": {"additionalProperties": {"type": "string"}}}}],
        "$defs": {"Line": {"type": "object", "properties": {"sku": {"maxLength": 2}}}},
    }
    err = refusal(schema, {"lines": [{"sku": "abc"}]})
    assert (err.field, err.path) == ("payload.lines[0].sku", "/lines/0/sku")
    err = refusal(schema, {"tags": {SECRET: 1}})
    assert (err.field, err.path) == ("payload.tags[*]", "/tags/*")


@pytest.mark.parametrize(
    "payload", ['{"n": 1, "n": "x"}', b'{"a": {"n": 1, "n": 2}}', {1: 5, "1": 6}]
)
def test_a_key_twice_in_what_is_stored_is_refused(payload: Any) -> None:
    out = box({"type": "object", "properties": {"n": {"type": "integer"}}})
    with pytest.raises(EventSchemaError) as err:
        out._message("d", payload, None, None, None, "application/json", event_type="t")
    assert (err.value.field, err.value.keyword) == ("payload", "duplicateKey")


def test_the_throttle_forgets_subjects_older_than_its_window() -> None:
    from outbox.catalog.catalog import _Throttle

    now = [0.0]
    throttle = _Throttle(60.0, lambda: now[0], keep=4)
    for i in range(4):
        assert throttle.allow(("t", str(i))) == 0
    assert throttle.allow(("t", "0")) is None  # held back, counted
    now[0] = 61.0
    assert throttle.allow(("t", "new")) == 0  # the table is full: the old ones go
    assert len(throttle._last) == 1 and throttle._held == {}


def test_refs_read_only_regular_files_of_bounded_size(tmp_path: Path) -> None:
    import os

    folder = tmp_path / "schemas"
    folder.mkdir()
    os.mkfifo(folder / "pipe.json")
    (folder / "big.json").write_text('{"description": "' + "x" * (1 << 20) + '"}')
    (tmp_path / "private.json").write_text("{}")
    (folder / "link.json").symlink_to(tmp_path / "private.json")
    for ref, expected in [
        ("pipe.json", "not a regular file"),
        ("big.json", "larger than"),
        ("link.json", "leaves the schema's folder"),
        ("/dev/zero", "is absolute"),
    ]:
        with pytest.raises(CatalogError, match=expected):
            EventType.from_schema("t", {"$ref": ref}, destinations=["d"], base_dir=folder)
    (folder / "ok.json").write_text('{"type": "integer"}')
    assert EventType.from_schema("t", {"$ref": "ok.json"}, destinations=["d"], base_dir=folder)


def test_a_deeply_nested_schema_is_a_catalog_error_naming_the_type() -> None:
    deep: dict[str, Any] = {}
    for _ in range(5000):
        deep = {"items": deep}
    with pytest.raises(CatalogError, match="'t'"):
        EventType.from_schema("t", deep, destinations=["d"])
    with pytest.raises(CatalogError, match="'t' in the export"):
        Catalog.load(_export_with(schema=deep))


def test_load_catalog_tells_a_missing_module_from_a_failing_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox.catalog import load_catalog

    (tmp_path / "events_needing_x.py").write_text("import no_such_dependency_x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(CatalogError, match="importing events_needing_x failed") as err:
        load_catalog("events_needing_x:catalog")
    assert "no_such_dependency_x" in str(err.value)
    with pytest.raises(CatalogError, match="no module 'events_needing'"):
        load_catalog("events_needing:catalog")
