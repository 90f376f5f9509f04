"""Hostile review of issue #31's compatibility check (outbox/catalog/compat.py): a test for each
finding, each of which failed before its fix."""

from __future__ import annotations

import time
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest

from outbox.catalog.compat import compare
from tests.test_catalog_compat import INT, STR, catalog, entry, judged, obj

NODE = "#/definitions/Node"


def _valid(schema: dict[str, Any], defs: dict[str, Any], value: Any) -> bool:
    return bool(jsonschema.Draft7Validator({**schema, "definitions": defs}).is_valid(value))


def test_null_dropped_from_a_self_reference_is_breaking() -> None:
    # pydantic's `next: Node | None` made `next: Node` (a linked list, a tree's parent).
    root = {"$ref": NODE}
    nullable = {"anyOf": [{"$ref": NODE}, {"type": "null"}]}
    old_defs = {"Node": obj(v=INT, next=nullable)}
    new_defs = {"Node": obj(v=INT, next={"$ref": NODE})}
    # The oracle: an old event no longer fits the new schema.
    assert _valid(root, old_defs, {"v": 1, "next": None})
    assert not _valid(root, new_defs, {"v": 1, "next": None})
    assert ("payload.next", "type-changed", "breaking") in judged(
        root, root, old_defs=old_defs, new_defs=new_defs
    )


def test_null_added_to_a_self_reference_is_breaking() -> None:
    root = {"$ref": NODE}
    nullable = {"anyOf": [{"$ref": NODE}, {"type": "null"}]}
    old_defs = {"Node": obj(v=INT, next={"$ref": NODE})}
    new_defs = {"Node": obj(v=INT, next=nullable)}
    assert ("payload.next", "type-changed", "breaking") in judged(
        root, root, old_defs=old_defs, new_defs=new_defs
    )


def test_content_type_changed_is_breaking() -> None:
    old = catalog(entry(obj(id=INT)))
    new = catalog(entry(obj(id=INT), content_type="application/cloudevents+json"))
    assert any(c.breaking for c in compare(old, new)), compare(old, new)


def test_optional_field_added_under_an_old_pattern_is_breaking() -> None:
    # Old events may hold x1 as a string (the pattern admits it); the new schema wants an
    # integer there.
    pattern = {"^x": STR}
    old = {**obj(), "patternProperties": pattern}
    new = {**obj(x1=INT), "patternProperties": pattern}
    assert _valid(old, {}, {"x1": "a"}) and not _valid(new, {}, {"x1": "a"})
    assert any(v == "breaking" for _, _, v in judged(old, new))


def test_a_shared_definition_is_compared_once_not_exponentially() -> None:
    # A DAG, no cycle: D0 holds two references to D1, D1 two to D2, ... (2**n paths).
    n = 16
    defs: dict[str, Any] = {f"D{n}": INT}
    for i in range(n):
        ref = {"$ref": f"#/definitions/D{i + 1}"}
        defs[f"D{i}"] = obj(a=ref, b=ref)
    changed = {**defs, f"D{n}": STR}
    root = {"$ref": "#/definitions/D0"}
    started = time.monotonic()
    found = compare(catalog(entry(root, defs)), catalog(entry(root, changed)))
    assert time.monotonic() - started < 5
    assert found


def test_a_long_chain_of_references_is_no_recursion_error() -> None:
    n = 400
    defs: dict[str, Any] = {f"D{n}": INT}
    for i in range(n):
        defs[f"D{i}"] = obj(a={"$ref": f"#/definitions/D{i + 1}"})
    root = {"$ref": "#/definitions/D0"}
    changed = {**defs, f"D{n}": STR}
    assert compare(catalog(entry(root, defs)), catalog(entry(root, changed)))


def _export(tmp: Any, name: str, schema: dict[str, Any]) -> str:
    from outbox.catalog import Catalog, EventType

    c = Catalog(title="t", version="1", validate="reject")
    c.add(EventType.from_schema("order.created", schema, destinations=["orders"]))
    path = tmp / name
    path.write_text(__import__("json").dumps(c.export()))
    return str(path)


def test_a_keyword_with_a_line_break_stays_one_line(tmp_path: Any) -> None:
    from click.testing import CliRunner

    from relay.cli import main

    old = _export(tmp_path, "old.json", {**obj(id=INT), "x-a\nBREAKING forged: x": 1})
    new = _export(tmp_path, "new.json", obj(id=INT))
    result = CliRunner().invoke(main, ["catalog", "check", "--catalog", new, "--against", old])
    assert result.exit_code == 0, result.output
    assert len(result.output.splitlines()) == 1, result.output


def test_a_long_chain_of_references_through_the_command(tmp_path: Any) -> None:
    from click.testing import CliRunner

    from relay.cli import main

    n = 1000
    defs: dict[str, Any] = {f"D{n}": INT}
    for i in range(n):
        defs[f"D{i}"] = obj(a={"$ref": f"#/definitions/D{i + 1}"})
    root = {"$ref": "#/definitions/D0", "definitions": defs}
    old = _export(tmp_path, "old.json", root)
    new = _export(tmp_path, "new.json", {**root, "definitions": {**defs, f"D{n}": STR}})
    result = CliRunner().invoke(main, ["catalog", "check", "--catalog", new, "--against", old])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert result.exit_code == 3, result.output


def test_a_shared_definition_is_reported_once() -> None:
    line = {"$ref": "#/definitions/Line"}
    old_defs, new_defs = {"Line": obj(sku=INT)}, {"Line": obj(sku=STR)}
    found = judged(obj(a=line, b=line), obj(a=line, b=line), old_defs=old_defs, new_defs=new_defs)
    assert found == [("payload.a.sku", "type-changed", "breaking")]


def test_too_deep_a_schema_is_a_usage_error(tmp_path: Any) -> None:
    from click.testing import CliRunner

    from relay.cli import main

    n = 3000
    defs: dict[str, Any] = {f"D{n}": INT}
    for i in range(n):
        defs[f"D{i}"] = {"allOf": [{"$ref": f"#/definitions/D{i + 1}"}]}
    root = {"$ref": "#/definitions/D0"}
    changed = {**defs, f"D{n}": STR}
    with pytest.raises(ValueError, match=r"order\.created is nested too deeply"):
        compare(catalog(entry(root, defs)), catalog(entry(root, changed)))
    old = _export(tmp_path, "old.json", {**root, "definitions": defs})
    new = _export(tmp_path, "new.json", {**root, "definitions": changed})
    args = ["catalog", "check", "--catalog", new, "--against", old]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "nested too deeply" in result.output


def test_version_is_listed_and_safe() -> None:
    found = compare(catalog(entry(INT)), catalog(entry(INT, version=2)))
    assert [(c.path, c.rule, c.verdict, c.detail) for c in found] == [
        ("version", "version-changed", "safe", "version 1 → 2")
    ]


def test_a_look_alike_name_is_quoted() -> None:
    assert judged(obj(**{"n\u0430me": INT}), obj()) == [
        ('payload["n\u0430me"]', "field-removed", "breaking")
    ]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ({"type": "string", "minLength": 0}, STR),
        ({"type": "array", "minItems": 0, "uniqueItems": False}, {"type": "array"}),
        ({"type": "object", "minProperties": 0}, {"type": "object"}),
        ({"type": ["string", "null"], "enum": ["a"]}, {"enum": ["a"]}),
        ({"type": "number", "enum": [1]}, {"enum": [1]}),
    ],
)
def test_what_says_nothing_more_is_no_change(old: dict[str, Any], new: dict[str, Any]) -> None:
    assert judged(old, new) == [] and judged(new, old) == []


def test_the_old_property_names_judge_an_added_name() -> None:
    def named(names: dict[str, Any], **props: Any) -> dict[str, Any]:
        return {**obj(**props), "propertyNames": names}

    lower = {"pattern": "^[a-z]+$"}
    assert judged(named(lower), named(lower, x=INT)) == [("payload.x", "optional-added", "safe")]
    assert judged(named(lower), named(lower, X=INT)) == [
        ("payload.X", "optional-added", "breaking")
    ]
    email = {"format": "email"}
    assert judged(named(email), named(email, x=INT)) == [("payload.x", "cannot-judge", "breaking")]


def test_a_pattern_admits_a_field_a_closed_object_refuses_otherwise() -> None:
    old = {**obj(closed=True), "patternProperties": {"^x": INT}}
    new = {**obj(x1=INT, closed=True), "patternProperties": {"^x": INT}}
    assert judged(old, new) == [("payload.x1", "optional-added", "safe")]
    new = {**obj(y=INT, closed=True), "patternProperties": {"^x": INT}}
    assert judged(old, new) == [("payload.y", "optional-added", "breaking")]
