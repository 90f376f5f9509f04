"""Hypothesis strategies from a portable (draft-07) schema: values it takes, and values it
refuses at one known place.

Our own, not hypothesis-jsonschema (0.23.1 fails with this hypothesis: ``'many' object has no
attribute 'more'``). They cover what the catalog's test schemas use: objects (required,
closed or not), arrays (``items`` one or a list, ``minItems``/``maxItems``), strings
(``minLength``/``maxLength``, ``enum``, ``const``, the formats date-time, date and uuid),
integers and numbers with bounds, booleans, null, ``anyOf``/``oneOf`` and ``$ref`` to
``#/definitions/...``. Every value drawn is checked by ``jsonschema`` (the oracle) to be what
it claims, so a strategy that drifted from the schema fails loudly instead of testing nothing.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC
from typing import Any

import jsonschema
from hypothesis import strategies as st

FORMATS = jsonschema.FormatChecker(["date-time", "date", "uuid"])
Schema = dict[str, Any]
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_TEXT = st.characters(codec="utf-8", exclude_categories=("Cs",))


def document(portable: Schema, definitions: Schema) -> Schema:
    """An event type's portable form and definitions as one draft-07 document."""
    return {**portable, "definitions": definitions} if definitions else dict(portable)


def oracle(schema: Schema) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema, format_checker=FORMATS)


def field_path(segments: list[str | int]) -> str:
    out = []
    for s in segments:
        if isinstance(s, int):
            out.append(f"[{s}]")
        elif _IDENTIFIER.match(s):
            out.append(f".{s}")
        else:
            out.append(f"[{json.dumps(s, ensure_ascii=False)}]")
    return "".join(out)


class _Gen:
    def __init__(self, root: Schema) -> None:
        self.root = root

    def deref(self, node: Any) -> Any:
        while isinstance(node, dict) and "$ref" in node:
            name = node["$ref"].removeprefix("#/definitions/")
            node = self.root["definitions"][name]
        if isinstance(node, dict) and len(node.get("allOf", [])) == 1:
            rest = {k: v for k, v in node.items() if k != "allOf"}
            return {**self.deref(node["allOf"][0]), **rest}
        return node

    def valid(self, node: Any, depth: int = 0) -> st.SearchStrategy[Any]:
        node = self.deref(node)
        if node is True or node == {}:
            return st.one_of(st.none(), st.booleans(), st.integers(), st.text(_TEXT, max_size=5))
        if "const" in node:
            return st.just(node["const"])
        if "enum" in node:
            return st.sampled_from(node["enum"])
        for key in ("anyOf", "oneOf"):
            if key in node:
                return st.one_of([self.valid(b, depth + 1) for b in node[key]])
        types = node.get("type", "object")
        types = types if isinstance(types, list) else [types]
        return st.one_of([self._typed(t, node, depth) for t in types])

    def _typed(self, kind: str, node: Schema, depth: int) -> st.SearchStrategy[Any]:
        if kind == "object":
            return self._object(node, depth)
        if kind == "array":
            return self._array(node, depth)
        if kind == "string":
            return _string(node)
        if kind in ("integer", "number"):
            low, high = node.get("minimum"), node.get("maximum")
            if "exclusiveMinimum" in node:
                low = node["exclusiveMinimum"] + 1
            if "exclusiveMaximum" in node:
                high = node["exclusiveMaximum"] - 1
            return st.integers(low, high)
        if kind == "boolean":
            return st.booleans()
        return st.none()

    def _object(self, node: Schema, depth: int) -> st.SearchStrategy[dict[str, Any]]:
        props = node.get("properties", {})
        required = set(node.get("required", []))
        fixed = {k: self.valid(v, depth + 1) for k, v in props.items() if k in required}
        optional = {k: self.valid(v, depth + 1) for k, v in props.items() if k not in required}
        return st.fixed_dictionaries(fixed, optional=optional if depth < 3 else {})

    def _array(self, node: Schema, depth: int) -> st.SearchStrategy[list[Any]]:
        items = node.get("items", {})
        if isinstance(items, list):
            return st.tuples(*(self.valid(i, depth + 1) for i in items)).map(list)
        low = node.get("minItems", 0)
        high = node.get("maxItems", low + (3 if depth < 3 else 0))
        return st.lists(self.valid(items, depth + 1), min_size=low, max_size=high)


def _string(node: Schema) -> st.SearchStrategy[str]:
    fmt = node.get("format")
    if fmt == "date-time":
        return st.datetimes(timezones=st.just(UTC)).map(lambda d: d.isoformat())
    if fmt == "date":
        return st.dates().map(lambda d: d.isoformat())
    if fmt == "uuid":
        return st.uuids().map(str)
    low = node.get("minLength", 0)
    return st.text(_TEXT, min_size=low, max_size=node.get("maxLength", low + 8))


@dataclass(frozen=True)
class Invalid:
    """A value refused at one place: ``field`` as the catalog writes it (``.lines[0].sku``,
    the missing property included, an unexpected one as ``[*]``), ``mutation`` what was done."""

    value: Any
    field: str
    mutation: str


_OTHERS: list[tuple[str, Any]] = [
    ("null", None),
    ("boolean", True),
    ("string", "x"),
    ("number", 1.5),
    ("integer", 7),
    ("array", []),
    ("object", {}),
]


def _of_type(kind: str, allowed: list[str]) -> bool:
    return kind in allowed or (kind == "integer" and "number" in allowed)


def _mutations(gen: _Gen, node: Any, value: Any, at: list[str | int]) -> Iterator[Any]:
    """(path, mutation name, new value at path or a function of the parent) for one value."""
    node = gen.deref(node)
    if not isinstance(node, dict) or any(k in node for k in ("anyOf", "oneOf")):
        return
    types = node.get("type")
    allowed = types if isinstance(types, list) else [types] if types else []
    if allowed and at:  # the payload itself stays an object: enqueue takes no other JSON
        for kind, other in _OTHERS:
            if not _of_type(kind, allowed) and not (kind == "number" and "integer" in allowed):
                yield at, f"retype to {kind}", other
                break
    if "enum" in node and all(isinstance(e, str) for e in node["enum"]):
        yield at, "enum value not listed", "-".join(["not listed", *node["enum"]])
    yield from _bounds(node, value, at)
    if isinstance(value, dict):
        yield from _object_mutations(gen, node, value, at)
    if isinstance(value, list):
        items = node.get("items", {})
        for i, item in enumerate(value):
            sub = items[i] if isinstance(items, list) else items
            yield from _mutations(gen, sub, item, [*at, i])


def _bounds(node: Schema, value: Any, at: list[str | int]) -> Iterator[Any]:
    if isinstance(value, str) and node.get("minLength", 0) > 0:
        yield at, "below minLength", "a" * (node["minLength"] - 1)
    if isinstance(value, str) and "maxLength" in node:
        yield at, "above maxLength", "a" * (node["maxLength"] + 1)
    if isinstance(value, str) and node.get("format") in ("date-time", "date", "uuid"):
        yield at, "not its format", "not a " + node["format"]
    if isinstance(value, int) and not isinstance(value, bool):
        if "minimum" in node:
            yield at, "below minimum", node["minimum"] - 1
        if "maximum" in node:
            yield at, "above maximum", node["maximum"] + 1
    if isinstance(value, list) and node.get("minItems", 0) > 0:
        yield at, "below minItems", value[: node["minItems"] - 1]


def _object_mutations(gen: _Gen, node: Schema, value: dict[str, Any], at: list[str | int]) -> Any:
    for name in node.get("required", []):
        if name in value:
            yield [*at, name], "drop a required field", _DROP
    if node.get("additionalProperties") is False:
        extra = "unexpected_field"
        while extra in node.get("properties", {}):
            extra += "_"
        yield [*at, extra], "add a field where closed", "extra"
    for name, sub in node.get("properties", {}).items():
        if name in value:
            yield from _mutations(gen, sub, value[name], [*at, name])


_DROP = object()


def _apply(value: Any, path: list[str | int], new: Any) -> Any:
    out = copy.deepcopy(value)
    if not path:
        return new
    parent = out
    for step in path[:-1]:
        parent = parent[step]
    if new is _DROP:
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return out


def _error_paths(validator: jsonschema.protocols.Validator, value: Any) -> set[str]:
    """Where the oracle says ``value`` is wrong, written as the catalog writes fields."""
    found = set()
    for error in validator.iter_errors(value):
        path = list(error.absolute_path)
        if error.validator == "required":
            path.append(re.findall(r"'(.*)' is a required property", error.message)[0])
        if error.validator == "additionalProperties":
            path.append(re.findall(r"\('(.*)' was unexpected\)", error.message)[0])
        found.add(field_path(path))
    return found


def valid(schema: Schema) -> st.SearchStrategy[Any]:
    """Values ``schema`` takes (checked by the oracle)."""
    check = oracle(schema)

    def checked(value: Any) -> Any:
        assert check.is_valid(value), (value, list(check.iter_errors(value))[:1])
        return value

    return _Gen(schema).valid(schema).map(checked)


def invalid(schema: Schema) -> st.SearchStrategy[Invalid]:
    """Values ``schema`` refuses, each at the one place a single mutation of a valid value
    broke: a required field dropped, a value retyped, a bound broken, an enum value not
    listed, a field added where the object is closed (checked by the oracle)."""
    gen = _Gen(schema)
    check = oracle(schema)

    @st.composite
    def draw(data: st.DrawFn) -> Invalid:
        value = data(valid(schema))
        options = list(_mutations(gen, schema, value, []))
        if not options:
            from hypothesis import reject

            reject()
        path, mutation, new = data(st.sampled_from(options))
        broken = _apply(value, path, new)
        claimed = field_path(path)
        assert _error_paths(check, broken) == {claimed}, (mutation, claimed, broken)
        if (
            mutation == "add a field where closed"
        ):  # the catalog names no unexpected key: it may be personal data
            claimed = field_path(path[:-1]) + "[*]"
        return Invalid(broken, claimed, mutation)

    return draw()
