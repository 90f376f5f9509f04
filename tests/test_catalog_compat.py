"""The catalog's compatibility check (outbox/catalog/compat.py, docs/design/event-catalog.md
§6), pure: no database. A pair (old, new) for every row of §6's table, each verdict, with the
path it names; then properties: a catalog against itself has no change, a definition hoisted
or inlined changes nothing, and whatever is judged safe is safe by the `jsonschema` oracle
(old events valid under the new schema, new events valid under the old one for a tolerant
reader, who ignores unknown fields and enum values)."""

from __future__ import annotations

import copy
import re
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from outbox.catalog.compat import Change, compare

NAME = "order.created"
OBJECT: dict[str, Any] = {"type": "object", "properties": {"id": {"type": "integer"}}}


def entry(
    portable: Any, definitions: dict[str, Any] | None = None, name: str = NAME, **fields: Any
) -> dict[str, Any]:
    """An export's entry for one type, as `Catalog.export()` writes it."""
    return {
        "name": name,
        "version": 1,
        "description": "An order was placed.",
        "schema": portable,
        "portable": portable,
        "definitions": definitions or {},
        "examples": [],
        "deprecated": False,
        "destinations": ["orders"],
        "key": None,
        "content_type": "application/json",
        "validate": None,
        "origin": "tests",
        **fields,
    }


def catalog(*types: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": "outbox-catalog/1",
        "title": "shop events",
        "version": "7",
        "validate": "off",
        "unknown": "allow",
        "types": sorted(types, key=lambda t: str(t["name"])),
    }


def judged(old: Any, new: Any, **defs: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(path, rule, verdict) of every change between two payload schemas of one type;
    ``old_defs``/``new_defs`` are their definitions."""
    changes = compare(
        catalog(entry(old, defs.get("old_defs"))), catalog(entry(new, defs.get("new_defs")))
    )
    assert all(c.type == NAME for c in changes)
    return [(c.path, c.rule, c.verdict) for c in changes]


def obj(required: tuple[str, ...] = (), closed: bool = False, **props: Any) -> dict[str, Any]:
    """An object schema; a field whose name is not an identifier goes in ``**{"a.b": s}``."""
    node: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        node["required"] = list(required)
    if closed:
        node["additionalProperties"] = False
    return node


INT = {"type": "integer"}
STR = {"type": "string"}

# Every row of §6's table, with each verdict it has: (old, new, what compare says).
ROWS: dict[str, tuple[Any, Any, list[tuple[str, str, str]]]] = {
    "required field added": (
        obj(("id",), id=INT),
        obj(("id", "currency"), id=INT, currency=STR),
        [("payload.currency", "required-added", "breaking")],
    ),
    "optional field added": (
        obj(id=INT),
        obj(id=INT, note=STR),
        [("payload.note", "optional-added", "safe")],
    ),
    "optional field added to a closed object": (
        obj(closed=True, id=INT),
        obj(closed=True, id=INT, note=STR),
        [("payload.note", "optional-added", "breaking")],
    ),
    "required field removed": (
        obj(("id", "note"), id=INT, note=STR),
        obj(("id",), id=INT),
        [("payload.note", "field-removed", "breaking")],
    ),
    "optional field removed": (
        obj(id=INT, note=STR),
        obj(id=INT),
        [("payload.note", "field-removed", "breaking")],
    ),
    "deprecated optional field removed": (
        obj(id=INT, note={**STR, "deprecated": True}),
        obj(id=INT),
        [("payload.note", "field-removed", "safe")],
    ),
    "deprecated required field removed": (
        obj(("note",), id=INT, note={**STR, "deprecated": True}),
        obj(id=INT),
        [("payload.note", "field-removed", "breaking")],
    ),
    "deprecated optional field removed from a closed object": (
        obj(closed=True, id=INT, note={**STR, "deprecated": True}),
        obj(closed=True, id=INT),
        [("payload.note", "field-removed", "breaking")],
    ),
    "optional to required": (
        obj(id=INT),
        obj(("id",), id=INT),
        [("payload.id", "optional-to-required", "breaking")],
    ),
    "required to optional": (
        obj(("id",), id=INT),
        obj(id=INT),
        [("payload.id", "required-to-optional", "breaking")],
    ),
    "type widened (integer to number)": (
        obj(n=INT),
        obj(n={"type": "number"}),
        [("payload.n", "type-changed", "breaking")],
    ),
    "type narrowed (number to integer)": (
        obj(n={"type": "number"}),
        obj(n=INT),
        [("payload.n", "type-changed", "breaking")],
    ),
    "null added": (
        obj(n=INT),
        obj(n={"type": ["integer", "null"]}),
        [("payload.n", "type-changed", "breaking")],
    ),
    "null added as pydantic writes it": (
        obj(n=INT),
        obj(n={"anyOf": [INT, {"type": "null"}], "default": None}),
        [("payload.n", "annotation", "safe"), ("payload.n", "type-changed", "breaking")],
    ),
    "null removed": (
        obj(n={"type": ["integer", "null"]}),
        obj(n=INT),
        [("payload.n", "type-changed", "breaking")],
    ),
    "type given where there was none": (
        obj(n={}),
        obj(n=STR),
        [("payload.n", "type-changed", "breaking")],
    ),
    "enum narrowed": (
        obj(s={"type": "string", "enum": ["EUR", "USD", "GBP"]}),
        obj(s={"type": "string", "enum": ["EUR"]}),
        [("payload.s", "enum-narrowed", "breaking")],
    ),
    "enum given where there was none": (
        obj(s=STR),
        obj(s={"type": "string", "enum": ["EUR"]}),
        [("payload.s", "enum-narrowed", "breaking")],
    ),
    "const changed": (
        obj(kind={"const": "a"}),
        obj(kind={"const": "b"}),
        [("payload.kind", "enum-narrowed", "breaking"), ("payload.kind", "enum-widened", "safe")],
    ),
    "enum widened": (
        obj(s={"type": "string", "enum": ["EUR"]}),
        obj(s={"type": "string", "enum": ["EUR", "USD"]}),
        [("payload.s", "enum-widened", "safe")],
    ),
    "const widened to an enum": (
        obj(kind={"type": "string", "const": "a"}),
        obj(kind={"type": "string", "enum": ["a", "b"]}),
        [("payload.kind", "enum-widened", "safe")],
    ),
    "enum dropped": (
        obj(s={"type": "string", "enum": ["EUR"]}),
        obj(s=STR),
        [("payload.s", "enum-widened", "safe")],
    ),
    "untyped enum gains a value of another type": (
        obj(s={"enum": ["a"]}),
        obj(s={"enum": ["a", 1]}),
        [("payload.s", "enum-widened", "safe"), ("payload.s", "type-changed", "breaking")],
    ),
    "maxLength lowered": (
        obj(s={**STR, "maxLength": 64}),
        obj(s={**STR, "maxLength": 32}),
        [("payload.s", "bound-tightened", "breaking")],
    ),
    "minimum raised": (
        obj(n={**INT, "minimum": 0}),
        obj(n={**INT, "minimum": 1}),
        [("payload.n", "bound-tightened", "breaking")],
    ),
    "minItems raised": (
        obj(a={"type": "array", "minItems": 0}),
        obj(a={"type": "array", "minItems": 2}),
        [("payload.a", "bound-tightened", "breaking")],
    ),
    "multipleOf added": (
        obj(n=INT),
        obj(n={**INT, "multipleOf": 5}),
        [("payload.n", "bound-tightened", "breaking")],
    ),
    "multipleOf made coarser": (
        obj(n={**INT, "multipleOf": 5}),
        obj(n={**INT, "multipleOf": 10}),
        [("payload.n", "bound-tightened", "breaking")],
    ),
    "pattern added": (
        obj(s=STR),
        obj(s={**STR, "pattern": "^[A-Z]+$"}),
        [("payload.s", "bound-tightened", "breaking")],
    ),
    "pattern changed": (
        obj(s={**STR, "pattern": "^[A-Z]+$"}),
        obj(s={**STR, "pattern": "^[a-z]+$"}),
        [("payload.s", "bound-changed", "breaking")],
    ),
    "format added": (
        obj(s=STR),
        obj(s={**STR, "format": "date-time"}),
        [("payload.s", "bound-tightened", "breaking")],
    ),
    "uniqueItems added": (
        obj(a={"type": "array"}),
        obj(a={"type": "array", "uniqueItems": True}),
        [("payload.a", "bound-tightened", "breaking")],
    ),
    "maxLength raised": (
        obj(s={**STR, "maxLength": 32}),
        obj(s={**STR, "maxLength": 64}),
        [("payload.s", "bound-loosened", "breaking")],
    ),
    "maximum removed": (
        obj(n={**INT, "maximum": 10}),
        obj(n=INT),
        [("payload.n", "bound-loosened", "breaking")],
    ),
    "exclusiveMinimum lowered": (
        obj(n={**INT, "exclusiveMinimum": 3}),
        obj(n={**INT, "exclusiveMinimum": 1}),
        [("payload.n", "bound-loosened", "breaking")],
    ),
    "multipleOf made finer": (
        obj(n={**INT, "multipleOf": 10}),
        obj(n={**INT, "multipleOf": 5}),
        [("payload.n", "bound-loosened", "breaking")],
    ),
    "format removed": (
        obj(s={**STR, "format": "uuid"}),
        obj(s=STR),
        [("payload.s", "bound-loosened", "breaking")],
    ),
    "array items changed": (
        obj(lines={"type": "array", "items": obj(sku={**STR, "maxLength": 64})}),
        obj(lines={"type": "array", "items": obj(sku={**STR, "maxLength": 32})}),
        [("payload.lines[].sku", "bound-tightened", "breaking")],
    ),
    "array items gain an optional field": (
        obj(lines={"type": "array", "items": obj(sku=STR)}),
        obj(lines={"type": "array", "items": obj(sku=STR, qty=INT)}),
        [("payload.lines[].qty", "optional-added", "safe")],
    ),
    "tuple position changed": (
        obj(pair={"type": "array", "items": [INT, STR]}),
        obj(pair={"type": "array", "items": [INT, INT]}),
        [("payload.pair[1]", "type-changed", "breaking")],
    ),
    "additionalProperties false to true": (
        obj(closed=True, id=INT),
        obj(id=INT),
        [("payload", "additional-properties", "breaking")],
    ),
    "additionalProperties true to false": (
        obj(id=INT),
        obj(closed=True, id=INT),
        [("payload", "additional-properties", "breaking")],
    ),
    "additionalProperties schema changed": (
        {"type": "object", "additionalProperties": INT},
        {"type": "object", "additionalProperties": STR},
        [("payload.*", "type-changed", "breaking")],
    ),
    "anyOf differing": (
        obj(v={"anyOf": [INT, STR]}),
        obj(v={"anyOf": [INT, {"type": "boolean"}]}),
        [("payload.v", "cannot-judge", "breaking")],
    ),
    "anyOf gaining a branch": (
        obj(v={"anyOf": [INT, STR]}),
        obj(v={"anyOf": [INT, STR, {"type": "boolean"}]}),
        [("payload.v", "cannot-judge", "breaking")],
    ),
    "oneOf differing": (
        obj(v={"oneOf": [INT, STR]}),
        obj(v={"oneOf": [INT, {**STR, "maxLength": 3}]}),
        [("payload.v", "cannot-judge", "breaking")],
    ),
    "allOf differing": (
        obj(v={"allOf": [INT, {"minimum": 0}]}),
        obj(v={"allOf": [INT, {"minimum": 1}]}),
        [("payload.v", "cannot-judge", "breaking")],
    ),
    "if added": (
        obj(v=INT),
        obj(v={**INT, "if": {"minimum": 0}, "then": {"maximum": 9}}),
        [("payload.v", "cannot-judge", "breaking"), ("payload.v", "cannot-judge", "breaking")],
    ),
    "not differing": (
        obj(v={**INT, "not": {"const": 1}}),
        obj(v={**INT, "not": {"const": 2}}),
        [("payload.v", "cannot-judge", "breaking")],
    ),
    "patternProperties differing": (
        {"type": "object", "patternProperties": {"^x-": STR}},
        {"type": "object", "patternProperties": {"^y-": STR}},
        [("payload", "cannot-judge", "breaking")],
    ),
    "a keyword no rule reads, differing": (
        obj(v={"$comment": "c", "type": "string", "contentEncoding": "base64"}),
        obj(v={"$comment": "c", "type": "string"}),
        [("payload.v", "cannot-judge", "breaking")],
    ),
    "anyOf with a description changed inside": (
        obj(v={"anyOf": [INT, STR]}),
        obj(v={"anyOf": [{**INT, "description": "cents"}, STR]}),
        [("payload.v", "annotation", "safe")],
    ),
    "annotations added": (
        obj(id=INT),
        obj(
            id={**INT, "title": "Id", "description": "d", "examples": [1], "default": 0},
        ),
        [("payload.id", "annotation", "safe")] * 4,
    ),
    "field deprecated": (
        obj(id=INT),
        obj(id={**INT, "deprecated": True}),
        [("payload.id", "annotation", "safe")],
    ),
    "description changed and title removed": (
        {**obj(id=INT), "description": "old", "title": "T"},
        {**obj(id=INT), "description": "new"},
        [("payload", "annotation", "safe")] * 2,
    ),
    "multipleOf 1 made 2": (
        obj(n={**INT, "multipleOf": 1}),
        obj(n={**INT, "multipleOf": 2}),
        [("payload.n", "bound-tightened", "breaking")],
    ),
    "multipleOf 2 made 1": (
        obj(n={**INT, "multipleOf": 2}),
        obj(n={**INT, "multipleOf": 1}),
        [("payload.n", "bound-loosened", "breaking")],
    ),
    "multipleOf neither divides": (
        obj(n={**INT, "multipleOf": 3}),
        obj(n={**INT, "multipleOf": 5}),
        [("payload.n", "bound-changed", "breaking")],
    ),
    "multipleOf from an invalid 0": (
        obj(n={**INT, "multipleOf": 0}),
        obj(n={**INT, "multipleOf": 5}),
        [("payload.n", "bound-changed", "breaking")],
    ),
    "uniqueItems dropped": (
        obj(a={"type": "array", "uniqueItems": True}),
        obj(a={"type": "array", "uniqueItems": False}),
        [("payload.a", "bound-loosened", "breaking")],
    ),
    "a required field without a schema, given one": (
        {"type": "object", "required": ["id"]},
        obj(("id",), id=INT),
        [("payload.id", "type-changed", "breaking")],
    ),
    "a tuple's rest made a position": (
        {"type": "array", "items": [INT], "additionalItems": STR},
        {"type": "array", "items": [INT, STR], "additionalItems": STR},
        [],
    ),
    "a tuple's rest closed": (
        {"type": "array", "items": [INT], "additionalItems": STR},
        {"type": "array", "items": [INT]},
        [("payload[]", "type-changed", "breaking")],
    ),
    "patternProperties with a description changed inside": (
        {"type": "object", "patternProperties": {"^x-": STR}},
        {"type": "object", "patternProperties": {"^x-": {**STR, "description": "d"}}},
        [("payload", "annotation", "safe")],
    ),
    "dependencies the same": (
        {"type": "object", "dependencies": {"a": ["b"], "c": INT}},
        {"type": "object", "dependencies": {"a": ["b"], "c": INT}},
        [],
    ),
    "dependencies differing": (
        {"type": "object", "dependencies": {"a": ["b"]}},
        {"type": "object", "dependencies": {"a": ["c"]}},
        [("payload", "cannot-judge", "breaking")],
    ),
    "a dependency made a schema": (
        {"type": "object", "dependencies": {"a": ["b"]}},
        {"type": "object", "dependencies": {"a": {"required": ["b"]}}},
        [("payload", "cannot-judge", "breaking")],
    ),
    "anyOf written as something other than a list": (
        obj(v={"anyOf": {"type": "integer"}}),
        obj(v={"anyOf": {"type": "integer"}}),
        [],
    ),
    "items removed": (
        {"type": "array", "items": INT},
        {"type": "array"},
        [("payload[]", "type-changed", "breaking")],
    ),
    "type changed entirely": (
        obj(n={"type": ["integer", "string"]}),
        obj(n={"type": ["boolean", "null"]}),
        [("payload.n", "type-changed", "breaking")],
    ),
    "enum made a const": (
        obj(s={"type": "string", "enum": ["a", "b"]}),
        obj(s={"type": "string", "const": "a"}),
        [("payload.s", "enum-narrowed", "breaking")],
    ),
    "a bound written as a string": (
        obj(s={**STR, "maxLength": "10"}),
        obj(s={**STR, "maxLength": "5"}),
        [("payload.s", "bound-changed", "breaking")],
    ),
    "multipleOf to an invalid 0": (
        obj(n={**INT, "multipleOf": 5}),
        obj(n={**INT, "multipleOf": 0}),
        [("payload.n", "bound-changed", "breaking")],
    ),
    "a required name without a schema dropped": (
        {"type": "object", "required": ["id"]},
        {"type": "object"},
        [("payload.id", "field-removed", "breaking")],
    ),
    "dependencies with a description changed inside": (
        {
            "type": "object",
            "dependencies": {"c": {"$ref": "#/properties/c"}},
            "properties": {"c": INT},
        },
        {
            "type": "object",
            "dependencies": {"c": {"$ref": "#/properties/c", "description": "d"}},
            "properties": {"c": INT},
        },
        [("payload", "annotation", "safe")],
    ),
    "patternProperties written as a list": (
        {"type": "object", "patternProperties": [INT]},
        {"type": "object", "patternProperties": [INT]},
        [],
    ),
    "allOf with a description changed inside": (
        obj(v={"allOf": [INT, {"minimum": 0}]}),
        obj(v={"allOf": [INT, {"minimum": 0, "description": "d"}]}),
        [("payload.v", "annotation", "safe")],
    ),
    "oneOf with a description changed inside": (
        obj(v={"oneOf": [INT, STR]}),
        obj(v={"oneOf": [INT, {**STR, "description": "d"}]}),
        [("payload.v", "annotation", "safe")],
    ),
    "not with a description changed inside": (
        obj(v=STR, w={**INT, "not": {"$ref": "#/properties/v"}}),
        obj(v=STR, w={**INT, "not": {"$ref": "#/properties/v", "description": "d"}}),
        [("payload.w", "annotation", "safe")],
    ),
    "a field added where extras had a schema": (
        {"type": "object", "properties": {}, "additionalProperties": INT},
        {"type": "object", "properties": {"b": STR}, "additionalProperties": INT},
        [("payload.b", "optional-added", "safe"), ("payload.b", "type-changed", "breaking")],
    ),
    "a field removed where extras have a schema": (
        {
            "type": "object",
            "properties": {"b": {**STR, "deprecated": True}},
            "additionalProperties": INT,
        },
        {"type": "object", "properties": {}, "additionalProperties": INT},
        [
            ("payload.b", "annotation", "safe"),
            ("payload.b", "field-removed", "safe"),
            ("payload.b", "type-changed", "breaking"),
        ],
    ),
    "additionalProperties schema made false": (
        {"type": "object", "additionalProperties": INT},
        {"type": "object", "additionalProperties": False},
        [("payload", "additional-properties", "breaking")],
    ),
    "additionalProperties schema referred to, changed": (
        {
            "type": "object",
            "properties": {"id": INT},
            "additionalProperties": {"$ref": "#/properties/id"},
        },
        {"type": "object", "properties": {"id": INT}, "additionalProperties": STR},
        [("payload.*", "type-changed", "breaking")],
    ),
    "tuple position dropped": (
        {"type": "array", "items": [INT, STR]},
        {"type": "array", "items": [INT]},
        [("payload[1]", "type-changed", "breaking")],
    ),
    "patternProperties referring, with a description changed inside": (
        {
            "type": "object",
            "properties": {"a": INT},
            "patternProperties": {"^x-": {"$ref": "#/properties/a"}},
        },
        {
            "type": "object",
            "properties": {"a": INT},
            "patternProperties": {"^x-": {"$ref": "#/properties/a", "title": "t"}},
        },
        [("payload", "annotation", "safe")],
    ),
    "an extension keyword changed": (
        obj(v={**INT, "x-unit": "cents"}),
        obj(v={**INT, "x-unit": "euros"}),
        [("payload.v", "annotation", "safe")],
    ),
    "integer beside number": (
        obj(n={"type": ["integer", "number"]}),
        obj(n={"type": "number"}),
        [],
    ),
    "enum of objects in another key order": (
        obj(v={"enum": [{"a": 1, "b": 2}]}),
        obj(v={"enum": [{"b": 2, "a": 1.0}]}),
        [],
    ),
    "enum of objects with other keys": (
        obj(v={"enum": [{"a": 1}]}),
        obj(v={"enum": [{"b": 1}]}),
        [("payload.v", "enum-narrowed", "breaking"), ("payload.v", "enum-widened", "safe")],
    ),
    "enum gains a value outside ASCII": (
        obj(v={"type": "string", "enum": ["a"]}),
        obj(v={"type": "string", "enum": ["a", "é"]}),
        [("payload.v", "enum-widened", "safe")],
    ),
    "anyOf empty": (obj(v={"anyOf": []}), obj(v={"anyOf": []}), []),
    "anyOf of an untyped branch and null": (
        obj(v={"anyOf": [{"minimum": 0}, {"type": "null"}]}),
        obj(v={"anyOf": [{"minimum": 0}, {"type": "null"}]}),
        [],
    ),
    "allOf with null is not nullable": (
        obj(v={"allOf": [INT, {"type": "null"}]}),
        obj(v={"type": ["integer", "null"]}),
        [("payload.v", "cannot-judge", "breaking"), ("payload.v", "type-changed", "breaking")],
    ),
    "oneOf of a nullable and null is not nullable": (
        obj(v={"oneOf": [{"type": ["integer", "null"]}, {"type": "null"}]}),
        obj(v={"type": ["integer", "null"]}),
        [("payload.v", "cannot-judge", "breaking"), ("payload.v", "type-changed", "breaking")],
    ),
    "a required field's schema dropped": (
        obj(("id",), id=INT),
        {"type": "object", "required": ["id"]},
        [("payload.id", "type-changed", "breaking")],
    ),
    "a bound made a string": (
        obj(s={**STR, "maxLength": 5}),
        obj(s={**STR, "maxLength": "5"}),
        [("payload.s", "bound-changed", "breaking")],
    ),
    "nothing changed": (obj(("id",), closed=True, id=INT), obj(("id",), closed=True, id=INT), []),
}


@pytest.mark.parametrize("row", ROWS)
def test_every_row_of_the_table(row: str) -> None:
    old, new, expected = ROWS[row]
    assert judged(old, new) == sorted(expected)


# What `catalog check` prints for each row: the wording is the command's output.
DETAILS: dict[str, list[str]] = {
    "required field added": ["required field added (old events lack it)"],
    "optional field added": ["optional field added (tolerant reader)"],
    "optional field added to a closed object": [
        "optional field added to a closed object (additionalProperties: false)"
    ],
    "required field removed": [
        "required field removed (readers of it get nothing; deprecate first)"
    ],
    "optional field removed": [
        "optional field removed without being deprecated first (readers get nothing)"
    ],
    "deprecated optional field removed": ["deprecated optional field removed"],
    "deprecated required field removed": [
        "required field removed (readers of it get nothing; deprecate first)"
    ],
    "deprecated optional field removed from a closed object": [
        "field removed from a closed object (old events holding it fail)"
    ],
    "optional to required": ["now required (old events may lack it)"],
    "required to optional": ["now optional (new events may lack it)"],
    "type widened (integer to number)": [
        "type integer → number (old events may be integer; old readers may get number)"
    ],
    "type narrowed (number to integer)": [
        "type number → integer (old events may be number; old readers may get integer)"
    ],
    "null added": ["type integer → integer, null (old readers may get null)"],
    "null added as pydantic writes it": [
        "default added",
        "type integer → integer, null (old readers may get null)",
    ],
    "null removed": ["type integer, null → integer (old events may be null)"],
    "type given where there was none": ["type any → string (old events may not fit)"],
    "enum narrowed": ['enum loses "GBP", "USD" (old events may hold it)'],
    "enum given where there was none": ["enum added (old events may hold others)"],
    "const changed": [
        'const loses "a" (old events may hold it)',
        'const gains "b" (tolerant reader)',
    ],
    "enum widened": ['enum gains "USD" (tolerant reader)'],
    "const widened to an enum": ['const gains "b" (tolerant reader)'],
    "enum dropped": ["enum removed (tolerant reader)"],
    "untyped enum gains a value of another type": [
        "enum gains 1 (tolerant reader)",
        "type string → integer, string (old readers may get integer)",
    ],
    "maxLength lowered": ["maxLength 64 → 32 (old events may not fit)"],
    "minimum raised": ["minimum 0 → 1 (old events may not fit)"],
    "minItems raised": ["minItems 0 → 2 (old events may not fit)"],
    "multipleOf added": ["multipleOf none → 5 (old events may not fit)"],
    "multipleOf made coarser": ["multipleOf 5 → 10 (old events may not fit)"],
    "pattern added": ['pattern none → "^[A-Z]+$" (old events may not fit)'],
    "pattern changed": [
        'pattern "^[A-Z]+$" → "^[a-z]+$"'
        " (old events may not fit; old readers' storage may not fit new events)"
    ],
    "format added": ['format none → "date-time" (old events may not fit)'],
    "uniqueItems added": ["uniqueItems none → true (old events may not fit)"],
    "maxLength raised": ["maxLength 32 → 64 (old readers' storage may not fit new events)"],
    "maximum removed": ["maximum 10 → none (old readers' storage may not fit new events)"],
    "exclusiveMinimum lowered": [
        "exclusiveMinimum 3 → 1 (old readers' storage may not fit new events)"
    ],
    "multipleOf made finer": ["multipleOf 10 → 5 (old readers' storage may not fit new events)"],
    "format removed": ['format "uuid" → none (old readers\' storage may not fit new events)'],
    "array items changed": ["maxLength 64 → 32 (old events may not fit)"],
    "array items gain an optional field": ["optional field added (tolerant reader)"],
    "tuple position changed": [
        "type string → integer (old events may be string; old readers may get integer)"
    ],
    "additionalProperties false to true": [
        "additionalProperties false → true (a closed schema promised no other field)"
    ],
    "additionalProperties true to false": [
        "additionalProperties true → false (old extras now invalid)"
    ],
    "additionalProperties schema changed": [
        "type integer → string (old events may be integer; old readers may get string)"
    ],
    "anyOf differing": ["anyOf differs (cannot judge: no subset test; --allow if intended)"],
    "anyOf gaining a branch": ["anyOf differs (cannot judge: no subset test; --allow if intended)"],
    "oneOf differing": ["oneOf differs (cannot judge: no subset test; --allow if intended)"],
    "allOf differing": ["allOf differs (cannot judge: no subset test; --allow if intended)"],
    "if added": [
        "if differs (cannot judge: no subset test; --allow if intended)",
        "then differs (cannot judge: no subset test; --allow if intended)",
    ],
    "not differing": ["not differs (cannot judge: no subset test; --allow if intended)"],
    "patternProperties differing": [
        "patternProperties differs (cannot judge: no subset test; --allow if intended)"
    ],
    "a keyword no rule reads, differing": [
        "contentEncoding differs (cannot judge: no subset test; --allow if intended)"
    ],
    "anyOf with a description changed inside": ["description added"],
    "annotations added": ["default added", "description added", "examples added", "title added"],
    "field deprecated": ["deprecated added"],
    "description changed and title removed": ["description changed", "title removed"],
    "multipleOf 1 made 2": ["multipleOf 1 → 2 (old events may not fit)"],
    "multipleOf 2 made 1": ["multipleOf 2 → 1 (old readers' storage may not fit new events)"],
    "multipleOf neither divides": [
        "multipleOf 3 → 5 (old events may not fit; old readers' storage may not fit new events)"
    ],
    "multipleOf from an invalid 0": [
        "multipleOf 0 → 5 (old events may not fit; old readers' storage may not fit new events)"
    ],
    "uniqueItems dropped": [
        "uniqueItems true → false (old readers' storage may not fit new events)"
    ],
    "a required field without a schema, given one": ["type any → integer (old events may not fit)"],
    "a tuple's rest made a position": [],
    "a tuple's rest closed": ["type string → any (old readers may get a value of any type)"],
    "patternProperties with a description changed inside": ["description added"],
    "dependencies the same": [],
    "dependencies differing": [
        "dependencies differs (cannot judge: no subset test; --allow if intended)"
    ],
    "a dependency made a schema": [
        "dependencies differs (cannot judge: no subset test; --allow if intended)"
    ],
    "anyOf written as something other than a list": [],
    "items removed": ["type integer → any (old readers may get a value of any type)"],
    "type changed entirely": [
        "type integer, string → boolean, null"
        " (old events may be integer, string; old readers may get boolean, null)"
    ],
    "enum made a const": ['const loses "b" (old events may hold it)'],
    "a bound written as a string": [
        'maxLength "10" → "5"'
        " (old events may not fit; old readers' storage may not fit new events)"
    ],
    "multipleOf to an invalid 0": [
        "multipleOf 5 → 0 (old events may not fit; old readers' storage may not fit new events)"
    ],
    "a required name without a schema dropped": [
        "required field removed (readers of it get nothing; deprecate first)"
    ],
    "dependencies with a description changed inside": ["description added"],
    "patternProperties written as a list": [],
    "allOf with a description changed inside": ["description added"],
    "oneOf with a description changed inside": ["description added"],
    "not with a description changed inside": ["description added"],
    "a field added where extras had a schema": [
        "optional field added (tolerant reader)",
        "type integer → string (old events may be integer; old readers may get string)",
    ],
    "a field removed where extras have a schema": [
        "deprecated removed",
        "deprecated optional field removed",
        "type string → integer (old events may be string; old readers may get integer)",
    ],
    "additionalProperties schema made false": [
        "additionalProperties a schema → false (old extras now invalid)"
    ],
    "additionalProperties schema referred to, changed": [
        "type integer → string (old events may be integer; old readers may get string)"
    ],
    "tuple position dropped": ["type string → any (old readers may get a value of any type)"],
    "patternProperties referring, with a description changed inside": ["title added"],
    "an extension keyword changed": ["x-unit changed"],
    "integer beside number": [],
    "enum of objects in another key order": [],
    "enum of objects with other keys": [
        'enum loses {"a": 1} (old events may hold it)',
        'enum gains {"b": 1} (tolerant reader)',
    ],
    "enum gains a value outside ASCII": ['enum gains "é" (tolerant reader)'],
    "anyOf empty": [],
    "anyOf of an untyped branch and null": [],
    "allOf with null is not nullable": [
        "allOf differs (cannot judge: no subset test; --allow if intended)",
        "type any → integer, null (old events may not fit)",
    ],
    "oneOf of a nullable and null is not nullable": [
        "oneOf differs (cannot judge: no subset test; --allow if intended)",
        "type any → integer, null (old events may not fit)",
    ],
    "a required field's schema dropped": [
        "type integer → any (old readers may get a value of any type)"
    ],
    "a bound made a string": [
        'maxLength 5 → "5" (old events may not fit; old readers\' storage may not fit new events)'
    ],
    "nothing changed": [],
}


@pytest.mark.parametrize("row", ROWS)
def test_every_row_says_what_changed_and_why(row: str) -> None:
    old, new, _ = ROWS[row]
    assert [c.detail for c in compare(catalog(entry(old)), catalog(entry(new)))] == DETAILS[row]


def types(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [(c.path, c.rule, c.verdict) for c in compare(catalog(*old), catalog(*new))]


def test_types_added_deprecated_and_removed() -> None:
    assert types([], [entry(OBJECT)]) == [("", "type-added", "safe")]
    assert types([entry(OBJECT)], [entry(OBJECT, deprecated=True)]) == [
        ("", "type-deprecated", "safe")
    ]
    assert types([entry(OBJECT, deprecated=True)], [entry(OBJECT)]) == [
        ("", "type-undeprecated", "safe")
    ]
    assert types([entry(OBJECT)], []) == [("", "type-removed", "breaking")]
    assert types([entry(OBJECT, deprecated=True)], []) == [("", "type-removed", "safe")]


def test_a_type_dropped_from_a_destination() -> None:
    both = entry(OBJECT, destinations=["customer-events", "orders"])
    assert types([both], [entry(OBJECT)]) == [("destinations", "destination-dropped", "breaking")]
    old = entry(OBJECT, destinations=["customer-events", "orders"], deprecated=True)
    assert types([old], [entry(OBJECT, deprecated=True)]) == [
        ("destinations", "destination-dropped", "safe")
    ]
    assert types([entry(OBJECT)], [both]) == [("destinations", "destination-added", "safe")]


def test_the_key() -> None:
    described = entry(OBJECT, key="the order id")
    assert types([described], [entry(OBJECT, key="the order's id")]) == [
        ("key", "key-described", "safe")
    ]
    assert types([entry(OBJECT)], [described]) == [("key", "key-required", "breaking")]
    assert types([described], [entry(OBJECT)]) == [("key", "key-dropped", "breaking")]


def test_type_changes_read_as_one_line_each() -> None:
    old = [
        entry(OBJECT, name="a", destinations=["x", "y"], key="k"),
        entry(OBJECT, name="b", deprecated=True, destinations=["x", "y"]),
        entry(OBJECT, name="c"),
        entry(OBJECT, name="d", deprecated=True),
        entry(OBJECT, name="e", key="k"),
    ]
    new = [
        entry(OBJECT, name="a", destinations=["x", "z"], key="k2", description="new"),
        entry(OBJECT, name="b", destinations=["x"], key="k", examples=[{}]),
        entry(OBJECT, name="c", deprecated=True),
        entry(OBJECT, name="e"),
        entry(OBJECT, name="f"),
    ]
    assert [str(c) for c in compare(catalog(*old), catalog(*new))] == [
        "safe a description: description changed",
        "safe a destinations: now also sent to z",
        "BREAKING a destinations: no longer sent to y (its consumers stop receiving it)",
        "safe a key: key description changed",
        "safe b: type no longer deprecated",
        "safe b destinations: deprecated type no longer sent to y",
        "safe b examples: examples changed",
        "BREAKING b key: a key is now required (old events have none)",
        "safe c: type deprecated",
        "safe d: deprecated type removed",
        "BREAKING e key: a key is no longer required (new events may have none)",
        "safe f: type added",
    ]
    assert [str(c) for c in compare(catalog(*new[2:3]), catalog())] == [
        "safe c: deprecated type removed"
    ]
    assert [str(c) for c in compare(catalog(*old[2:3]), catalog())] == [
        "BREAKING c: type removed (consumers stop receiving it; deprecate first)"
    ]


def test_a_type_description_and_examples_are_annotations() -> None:
    new = entry(OBJECT, description="Placed.", examples=[{"id": 1}])
    assert types([entry(OBJECT)], [new]) == [
        ("description", "annotation", "safe"),
        ("examples", "annotation", "safe"),
    ]


def test_a_change_reads_as_one_line_and_changes_come_sorted() -> None:
    line = obj(sku={**STR, "maxLength": 64})
    old = entry(obj(lines={"type": "array", "items": {"$ref": "#/definitions/Line"}}))
    old["definitions"] = {"Line": line}
    new = copy.deepcopy(old)
    new["definitions"]["Line"]["properties"]["sku"]["maxLength"] = 32
    added = entry(OBJECT, name="invoice.paid")
    changes = compare(catalog(old), catalog(new, added))
    assert [str(c) for c in changes] == [
        "safe invoice.paid: type added",
        "BREAKING order.created payload.lines[].sku: maxLength 64 → 32 (old events may not fit)",
    ]
    assert changes == sorted(changes) and changes[1].breaking and not changes[0].breaking
    assert changes[1] == Change(
        NAME,
        "payload.lines[].sku",
        "bound-tightened",
        "breaking",
        "maxLength 64 → 32 (old events may not fit)",
    )


def test_details_name_the_values_and_the_reason() -> None:
    def details(old: Any, new: Any) -> list[str]:
        return [str(c) for c in compare(catalog(entry(old)), catalog(entry(new)))]

    assert details(obj(n=INT), obj(n={"type": ["integer", "null"]})) == [
        f"BREAKING {NAME} payload.n: type integer → integer, null (old readers may get null)"
    ]
    assert details(obj(s={"enum": ["a", "b"]}), obj(s={"enum": ["a", "c"]})) == [
        f'BREAKING {NAME} payload.s: enum loses "b" (old events may hold it)',
        f'safe {NAME} payload.s: enum gains "c" (tolerant reader)',
    ]
    assert details(obj(s={**STR, "maxLength": 3}), obj(s=STR)) == [
        f"BREAKING {NAME} payload.s: maxLength 3 → none"
        " (old readers' storage may not fit new events)"
    ]
    assert details(obj(v={"anyOf": [INT, STR]}), obj(v={"anyOf": [STR, INT]})) == [
        f"BREAKING {NAME} payload.v: anyOf differs"
        " (cannot judge: no subset test; --allow if intended)"
    ]


def test_a_field_whose_name_is_not_an_identifier() -> None:
    assert judged(obj((), False, **{"a.b": INT}), obj((), False, **{"a.b": STR})) == [
        ('payload["a.b"]', "type-changed", "breaking")
    ]


def test_references_are_followed_into_the_definitions() -> None:
    old = obj(line={"$ref": "#/definitions/Line"})
    line = obj(sku=STR)
    renamed = obj(line={"$ref": "#/definitions/OrderLine"})
    assert judged(old, renamed, old_defs={"Line": line}, new_defs={"OrderLine": line}) == []
    assert judged(old, obj(line=line), old_defs={"Line": line}) == []
    changed = obj(sku=INT)
    assert judged(old, old, old_defs={"Line": line}, new_defs={"Line": changed}) == [
        ("payload.line.sku", "type-changed", "breaking")
    ]
    # A pydantic field description beside the reference is the field's.
    described = obj(line={"$ref": "#/definitions/Line", "description": "a line"})
    assert judged(old, described, old_defs={"Line": line}, new_defs={"Line": line}) == [
        ("payload.line", "annotation", "safe")
    ]


def test_a_reference_leading_nowhere_is_compared_as_written() -> None:
    old, new = obj(x={"$ref": "#/definitions/A"}), obj(x={"$ref": "#/definitions/B"})
    assert judged(old, new) == [("payload.x", "cannot-judge", "breaking")]
    assert judged(old, old) == []
    remote = obj(x={"$ref": "https://example.com/s.json"})
    assert judged(remote, new) == [("payload.x", "cannot-judge", "breaking")]


def test_pointers_into_the_schema_and_escaped_names() -> None:
    old = obj(a=STR, b={"$ref": "#/properties/a"})
    assert judged(old, obj(a=STR, b=STR)) == []
    assert judged(old, obj(a=STR, b=INT)) == [("payload.b", "type-changed", "breaking")]
    escaped = obj(x={"$ref": "#/definitions/a~1b%20c~0"})
    assert judged(escaped, obj(x=INT), old_defs={"a/b c~": INT}) == []
    beyond = {"type": "array", "items": [INT, {"$ref": "#/items/2"}]}
    assert judged(beyond, {"type": "array", "items": [INT, {}]}) == [
        ("payload[1]", "cannot-judge", "breaking")
    ]
    pair = {"type": "array", "items": [INT, {"$ref": "#/items/0"}]}
    assert judged(pair, {"type": "array", "items": [INT, INT]}) == []
    assert judged(obj(x={"$ref": "#/items/0"}), obj(x=INT)) == [
        ("payload.x", "cannot-judge", "breaking"),  # the $ref, written differently
        ("payload.x", "type-changed", "breaking"),  # any (unknown) → integer
    ]


TREE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "value": INT,
        "children": {"type": "array", "items": {"$ref": "#/definitions/Node"}},
    },
}


def test_recursive_definitions_end_and_are_compared_by_name() -> None:
    root = {"$ref": "#/definitions/Node"}
    assert judged(root, root, old_defs={"Node": TREE}, new_defs={"Node": TREE}) == []
    string_tree = copy.deepcopy(TREE)
    string_tree["properties"]["value"] = STR
    assert judged(root, root, old_defs={"Node": TREE}, new_defs={"Node": string_tree}) == [
        ("payload.value", "type-changed", "breaking")
    ]
    renamed = copy.deepcopy(TREE)
    renamed["properties"]["children"]["items"] = {"$ref": "#/definitions/Tree"}
    tree_root = {"$ref": "#/definitions/Tree"}
    assert judged(root, tree_root, old_defs={"Node": TREE}, new_defs={"Tree": renamed}) == []
    # A recursive definition against the tree written out: compared to the tree's end.
    written = obj(value=INT, children={"type": "array", "items": obj(value=STR)})
    assert judged(root, written, old_defs={"Node": TREE}) == [
        ("payload.children[].children", "field-removed", "breaking"),
        ("payload.children[].value", "type-changed", "breaking"),
    ]
    assert judged(written, root, new_defs={"Node": TREE}) == [
        ("payload.children[].children", "optional-added", "safe"),
        ("payload.children[].value", "type-changed", "breaking"),
    ]
    listed = {"L": {"type": "array", "items": {"$ref": "#/definitions/L"}}}
    assert judged({"$ref": "#/definitions/L"}, {"type": "array"}, old_defs=listed) == [
        ("payload[]", "type-changed", "breaking")
    ]
    # ... and against nothing: once, not forever.
    assert judged(root, obj(value=INT, children={"type": "array"}), old_defs={"Node": TREE}) == [
        ("payload.children[]", "type-changed", "breaking"),
        ("payload.children[].children", "field-removed", "breaking"),
        ("payload.children[].value", "field-removed", "breaking"),
    ]
    # A loop of bare references, and one through an allOf, still end.
    loop = {"A": {"$ref": "#/definitions/B"}, "B": {"$ref": "#/definitions/A"}}
    assert judged({"$ref": "#/definitions/A"}, INT, old_defs=loop) != []
    wrapped = {"A": {"allOf": [{"$ref": "#/definitions/A"}]}}
    assert (
        judged(
            {"$ref": "#/definitions/A"},
            {"$ref": "#/definitions/A"},
            old_defs=wrapped,
            new_defs=wrapped,
        )
        == []
    )


def test_nullable_spellings_are_one() -> None:
    pydantic = obj(n={"anyOf": [{"$ref": "#/definitions/N"}, {"type": "null"}]})
    listed = obj(n={"type": ["integer", "null"], "minimum": 0})
    defs = {"N": {**INT, "minimum": 0}}
    assert judged(pydantic, listed, old_defs=defs) == []
    assert (
        judged(obj(n={"oneOf": [{"type": "null"}, INT]}), obj(n={"type": ["null", "integer"]}))
        == []
    )
    assert judged(obj(n={"allOf": [INT]}), obj(n=INT)) == []
    # Not one when the other branch admits null, or holds a keyword a null would meet.
    assert (
        judged(
            obj(n={"anyOf": [{"enum": [1, None]}, {"type": "null"}]}),
            obj(n={"type": ["integer", "null"]}),
        )[0][1]
        == "cannot-judge"
    )


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (None, "null"),
        (True, "boolean"),
        (1, "integer"),
        (2.0, "integer"),
        (1.5, "number"),
        ("s", "string"),
        ([1], "array"),
        ({"a": 1}, "object"),
    ],
)
def test_an_untyped_enum_has_the_type_of_its_values(value: Any, kind: str) -> None:
    assert judged(obj(x={"enum": [value]}), obj(x={"type": kind, "enum": [value]})) == []
    assert judged(obj(x={"const": value}), obj(x={"type": kind, "const": value})) == []
    other = "string" if kind != "string" else "integer"
    assert judged(obj(x={"const": value}), obj(x={"type": other, "const": value})) == [
        ("payload.x", "type-changed", "breaking")
    ]


def test_boolean_schemas() -> None:
    assert judged(obj(x=True), obj(x={})) == []
    assert judged(obj(x=True), obj(x=False)) == [("payload.x", "cannot-judge", "breaking")]
    assert judged(obj(x=False), obj(x={"not": {}})) == []


def test_an_export_without_its_format_is_read() -> None:
    unmarked = {k: v for k, v in catalog(entry(OBJECT)).items() if k != "format"}
    assert compare(unmarked, catalog()) == [Change(NAME, "", "type-removed", "breaking", ANY)]


class _Any:
    def __eq__(self, other: object) -> bool:
        return True


ANY: Any = _Any()


def test_what_is_not_an_export_is_refused() -> None:
    with pytest.raises(ValueError, match="the new catalog is not an export of outbox-catalog/1"):
        compare(catalog(), {"asyncapi": "3.0.0"})
    with pytest.raises(ValueError, match="the old catalog"):
        compare({**catalog(), "format": "outbox-catalog/2"}, catalog())


# Strategies of our own (hypothesis-jsonschema does not run with this hypothesis): portable
# schemas of the keywords the rules judge, values valid under them, and edits of a schema.

FIELDS = ("a", "b", "c", "d", "x.y")
WORDS = ("EUR", "USD", "GBP", "JPY")


@st.composite
def leaves(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(
        st.sampled_from(["integer", "number", "string", "boolean", "enum", "const", "null?"])
    )
    node: dict[str, Any]
    if kind in ("integer", "number"):
        node = {"type": kind}
        if draw(st.booleans()):
            node["minimum"] = draw(st.integers(-5, 5))
            if draw(st.booleans()):
                node["maximum"] = node["minimum"] + draw(st.integers(0, 10))
    elif kind == "string":
        node = {"type": "string"}
        if draw(st.booleans()):
            node["maxLength"] = draw(st.integers(1, 8))
    elif kind == "boolean":
        node = {"type": "boolean"}
    elif kind == "enum":
        node = {
            "type": "string",
            "enum": draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=3, unique=True)),
        }
    elif kind == "const":
        node = {"const": draw(st.sampled_from(["x", 1, True]))}
    else:
        inner = draw(st.sampled_from([INT, STR]))
        node = draw(
            st.sampled_from(
                [{"anyOf": [inner, {"type": "null"}]}, {"type": [inner["type"], "null"]}]
            )
        )
    if draw(st.integers(0, 4)) == 0:
        node["description"] = draw(st.sampled_from(["one", "two"]))
    return node


@st.composite
def objects(draw: st.DrawFn, children: st.SearchStrategy[Any]) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=4))
    required = [n for n in names if draw(st.booleans())]
    return obj(tuple(required), draw(st.booleans()), **{n: draw(children) for n in names})


@st.composite
def arrays(draw: st.DrawFn, children: st.SearchStrategy[Any]) -> dict[str, Any]:
    node = {"type": "array", "items": draw(children)}
    if draw(st.booleans()):
        node["maxItems"] = draw(st.integers(0, 3))
    return node


def schemas() -> st.SearchStrategy[dict[str, Any]]:
    nested = st.recursive(leaves(), lambda c: objects(c) | arrays(c), max_leaves=8)
    return objects(nested)


@st.composite
def hoisted(draw: st.DrawFn, schema: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same schema with some of its objects moved to definitions and referred to, as the
    portable form writes a pydantic model's nested models."""
    definitions: dict[str, Any] = {}

    def walk(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        node = {k: _children(k, v, walk) for k, v in node.items()}
        if node.get("type") == "object" and draw(st.booleans()):
            name = f"D{len(definitions)}"
            definitions[name] = node
            return {"$ref": f"#/definitions/{name}"}
        return node

    return walk(schema), definitions


def _children(key: str, value: Any, walk: Any) -> Any:
    if key == "properties":
        return {n: walk(s) for n, s in value.items()}
    if key in ("items", "additionalProperties"):
        return walk(value)
    if key == "anyOf":
        return [walk(s) for s in value]
    return value


def resolved(schema: Any, definitions: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = definitions[schema["$ref"].removeprefix("#/definitions/")]
    return dict(schema)


def values(schema: Any, definitions: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid under a schema of the strategies above; unknown fields never (a tolerant
    reader's contract is with the fields it declares)."""
    node = resolved(schema, definitions)
    if "anyOf" in node:
        return st.one_of([values(b, definitions) for b in node["anyOf"]])
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    kinds = node.get("type")
    if isinstance(kinds, list):
        return st.one_of([values({**node, "type": k}, definitions) for k in kinds])
    low, high = node.get("minimum"), node.get("maximum")
    if kinds == "integer":
        return st.integers(low, high)
    if kinds == "number":
        return st.integers(low, high) | st.floats(low, high, allow_nan=False, allow_infinity=False)
    if kinds == "string":
        return st.text("ab€", max_size=node.get("maxLength", 6))
    if kinds == "object":
        props, need = _patterned(node, definitions), set(node.get("required", ()))
        return st.fixed_dictionaries(
            {n: s for n, s in props.items() if n in need},
            optional={n: s for n, s in props.items() if n not in need},
        )
    if kinds == "array":
        return st.lists(values(node["items"], definitions), max_size=node.get("maxItems", 3))
    return st.booleans() if kinds == "boolean" else st.none()


def _patterned(node: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """The values of an object's fields: those it lists, kept to what a pattern matching the
    name admits too, and a field its pattern ``^z`` admits that it does not list."""
    props = {n: values(s, definitions) for n, s in node.get("properties", {}).items()}
    for pattern, schema in node.get("patternProperties", {}).items():
        fits = document(schema, definitions)
        for name in [n for n in props if re.search(pattern, n)]:
            props[name] = props[name].filter(lambda v, fits=fits: valid(fits, v))
        props.setdefault(pattern.removeprefix("^"), values(schema, definitions))
    return props


def document(schema: Any, definitions: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "definitions": definitions}


def valid(schema: dict[str, Any], value: Any) -> bool:
    return bool(jsonschema.Draft7Validator(schema).is_valid(value))


def tolerant(schema: Any) -> Any:
    """A schema as a tolerant reader applies it: fields it does not declare ignored (so not
    refused), values its enums do not list taken (as long as they have the enum's type)."""
    if isinstance(schema, list):
        return [tolerant(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    node = {k: tolerant(v) for k, v in schema.items() if k not in ("enum", "const")}
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    listed = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if listed is not None and "type" not in node:
        node["type"] = sorted({_json_type(v) for v in listed})
    return node


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string"}[type(value)]


def nodes(schema: Any, definitions: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of a schema and its definitions that is not a reference, in one order."""
    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if not isinstance(node, dict):
            return
        if "$ref" not in node:
            found.append(node)
        for key, value in node.items():
            _children(key, value, walk)

    walk(schema)
    for node in definitions.values():
        walk(node)
    return found


EDITS = (
    "add optional",
    "add required",
    "close",
    "open",
    "remove",
    "deprecate and remove",
    "deprecate",
    "require",
    "unrequire",
    "widen enum",
    "narrow enum",
    "change const",
    "const to enum",
    "to number",
    "to integer",
    "add null",
    "maximum",
    "remove null",
    "maxLength",
    "maxItems",
    "describe",
    "title",
    "add under a pattern",
    "null a reference",
    "unnull a reference",
)


def _edits(node: dict[str, Any]) -> list[str]:
    """The edits that apply to a node."""
    edits = ["describe", "title"]
    kind = node.get("type")
    if kind == "object":
        edits += ["add optional", "add required", "close", "open"]
        if "z" not in node["properties"] and "patternProperties" not in node:
            edits += ["add under a pattern"]
        if node["properties"]:
            edits += ["remove", "deprecate and remove", "deprecate", "require", "unrequire"]
        if any("$ref" in s for s in node["properties"].values()):
            edits += ["null a reference", "unnull a reference"]
    if "enum" in node:
        edits += ["widen enum", "narrow enum"]
    if "const" in node:
        edits += ["change const", "const to enum"]
    if kind in ("integer", "number"):
        edits += ["to number", "to integer", "add null", "maximum"]
    if isinstance(kind, list):
        edits += ["remove null"]
    if kind == "string":
        edits += ["maxLength"]
    if kind == "array":
        edits += ["maxItems"]
    return edits


def _edit(draw: st.DrawFn, how: str, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Apply an edit to ``new`` (and, to deprecate a field first, to ``old``)."""
    props, required = new.get("properties", {}), list(new.get("required", []))
    name = draw(st.sampled_from(sorted(props))) if props else ""
    if how in ("add under a pattern", "null a reference", "unnull a reference"):
        _edit_more(draw, how, old, new)
    elif how in ("add optional", "add required"):
        name = draw(st.sampled_from([f for f in (*FIELDS, "z") if f not in props]))
        props[name] = draw(leaves())
        if how == "add required":
            new["required"] = [*required, name]
    elif how in ("remove", "deprecate and remove"):
        del props[name]
        new["required"] = [n for n in required if n != name]
        if how == "deprecate and remove":
            old["properties"][name]["deprecated"] = True
    elif how == "deprecate":
        props[name]["deprecated"] = True
    elif how in ("require", "unrequire"):
        new["required"] = [n for n in required if n != name] + [name] * (how == "require")
    elif how in ("close", "open"):
        new["additionalProperties"] = how == "open"
    elif how == "widen enum":
        new["enum"] = [*new["enum"], draw(st.sampled_from(["CHF", "SEK"]))]
    elif how == "narrow enum":
        new["enum"] = new["enum"][:-1]
    elif how in ("change const", "const to enum"):
        other = draw(st.sampled_from(["y", 2, False]))
        new.update(
            {"enum": [new.pop("const"), other]} if how == "const to enum" else {"const": other}
        )
    elif how in ("to number", "to integer", "add null", "remove null"):
        kinds = {"to number": "number", "to integer": "integer"}
        new["type"] = kinds.get(how) or (
            [new["type"], "null"] if how == "add null" else new["type"][0]
        )
    elif how in ("maximum", "maxLength", "maxItems"):
        new[how] = new.get(how, new.get("minimum", 0)) + draw(st.sampled_from([-1, 1, 2]))
    else:
        new[how if how != "describe" else "description"] = draw(st.sampled_from(["new", "other"]))


def _edit_more(draw: st.DrawFn, how: str, old: dict[str, Any], new: dict[str, Any]) -> None:
    """An optional field added that a pattern of the old object already matched; a
    reference made nullable (pydantic's ``X | None``), or the reverse."""
    if how == "add under a pattern":
        old["patternProperties"] = {"^z": draw(leaves())}
        new["patternProperties"] = copy.deepcopy(old["patternProperties"])
        new["properties"]["z"] = draw(leaves())
        return
    refs = sorted(n for n, s in new["properties"].items() if "$ref" in s)
    name = draw(st.sampled_from(refs))
    side = new if how == "null a reference" else old
    side["properties"][name] = {"anyOf": [side["properties"][name], {"type": "null"}]}


@st.composite
def edited(
    draw: st.DrawFn, schema: dict[str, Any], definitions: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any], str]:
    """(old, its definitions, new, its definitions, the edit): one edit of a schema."""
    old, old_defs = copy.deepcopy((schema, definitions))
    new, new_defs = copy.deepcopy((schema, definitions))
    olds, news = nodes(old, old_defs), nodes(new, new_defs)
    # The edit first, then a node it applies to: a schema has many leaves to describe, few
    # enums to widen.
    where = {how: [i for i, n in enumerate(olds) if how in _edits(n)] for how in EDITS}
    how = draw(st.sampled_from([how for how, found in where.items() if found]))
    i = draw(st.sampled_from(where[how]))
    _edit(draw, how, olds[i], news[i])
    return old, old_defs, new, new_defs, how


ORACLE = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@ORACLE
@given(st.data())
def test_what_is_judged_safe_is_safe_for_old_events_and_tolerant_readers(
    data: st.DataObject,
) -> None:
    schema, definitions = data.draw(schemas().flatmap(hoisted))
    old, old_defs, new, new_defs, how = data.draw(edited(schema, definitions))
    changes = compare(catalog(entry(old, old_defs)), catalog(entry(new, new_defs)))
    breaking = any(c.breaking for c in changes)
    event(f"{how}: {'breaking' if breaking else 'safe'}")
    if breaking:
        return
    before, after = document(old, old_defs), document(new, new_defs)
    for value in data.draw(st.lists(values(old, old_defs), max_size=4), label="old events"):
        assert valid(before, value)  # the strategy keeps its promise
        assert valid(after, value), (changes, value)
    for value in data.draw(st.lists(values(new, new_defs), max_size=4), label="new events"):
        assert valid(after, value)
        assert valid(tolerant(before), value), (changes, value)


def test_the_oracle_sees_what_breaks() -> None:
    """The checks above can fail: a required field added refuses an old event, a type
    widened gives an old reader what it cannot take, an unknown field or enum value does not."""
    old, new = obj(id=INT), obj(("id", "c"), id=INT, c=STR)
    assert valid(old, {"id": 1}) and not valid(new, {"id": 1})
    assert not valid(tolerant(obj(n=INT)), {"n": 1.5})
    closed = obj(closed=True, s={"type": "string", "enum": ["EUR"]})
    assert valid(tolerant(closed), {"s": "USD", "extra": 1})
    assert not valid(tolerant(closed), {"s": 1})
    assert not valid(tolerant(obj(s={"const": "a"})), {"s": 1})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_hoisting_or_inlining_a_definition_changes_nothing(data: st.DataObject) -> None:
    schema = data.draw(schemas())
    moved, definitions = data.draw(hoisted(schema))
    assert compare(catalog(entry(schema)), catalog(entry(moved, definitions))) == []
    assert compare(catalog(entry(moved, definitions)), catalog(entry(schema))) == []


EXOTIC = st.sampled_from(
    [
        {"anyOf": [INT, STR]},
        {"oneOf": [{"$ref": "#/definitions/Node"}, {"type": "null"}, STR]},
        {**INT, "not": {"const": 1}, "multipleOf": 3},
        {"type": "string", "pattern": "^a", "format": "date", "minLength": 1},
        {"type": "object", "patternProperties": {"^x": INT}, "additionalProperties": STR},
        {"if": {"minimum": 0}, "then": {"maximum": 9}, "else": False},
        {"type": "array", "items": [INT, STR], "additionalItems": False, "uniqueItems": True},
        {"type": "object", "dependencies": {"a": ["b"], "c": INT}, "propertyNames": STR},
        {"$ref": "#/definitions/Node"},
        {"$ref": "#/definitions/Missing"},
        True,
    ]
)


@st.composite
def catalogs(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(["order.created", "order.paid", "é"]), unique=True))
    nested = st.recursive(leaves() | EXOTIC, lambda c: objects(c) | arrays(c), max_leaves=6)
    found = []
    for name in names:
        schema, definitions = draw(objects(nested).flatmap(hoisted))
        definitions["Node"] = TREE
        found.append(
            entry(
                schema,
                definitions,
                name=name,
                deprecated=draw(st.booleans()),
                destinations=sorted(draw(st.sets(st.sampled_from(["a", "b"]), min_size=1))),
                key=draw(st.none() | st.just("the order id")),
                examples=draw(st.lists(st.just({"id": 1}), max_size=1)),
            )
        )
    return catalog(*found)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(catalogs())
def test_a_catalog_against_itself_has_no_change(c: dict[str, Any]) -> None:
    assert compare(c, c) == []
    assert compare(c, copy.deepcopy(c)) == []
