"""Reading one side of a compared schema (docs/design/event-catalog.md §6): references followed
inside the type's own ``definitions``, and the shapes pydantic writes brought to one form, so
the rules in ``compat_rules`` compare meaning rather than spelling."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any
from urllib.parse import unquote

# Keywords that describe and never refuse a value: changing them is always safe.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "examples",
        "default",
        "deprecated",
        "$comment",
        "readOnly",
        "writeOnly",
        "$id",
        "$schema",
        "discriminator",
    }
)
# What keeps `anyOf: [X, {"type": "null"}]` from being X with "null" added to its type: a
# keyword that applies to values of every type (a null included).
_APPLIES_TO_ALL = frozenset({"enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "$ref"})


def is_annotation(keyword: str) -> bool:
    return keyword in ANNOTATIONS or keyword.startswith("x-")


_PLAIN_KEYWORD = re.compile(r"[A-Za-z$][A-Za-z0-9_$-]*")


def keyword(name: str) -> str:
    """A keyword's name for a change's detail: as it is when plain, else quoted as JSON (a
    line break or a look-alike letter in it shows)."""
    return name if _PLAIN_KEYWORD.fullmatch(name) else canon(name)


def canon(value: Any) -> str:
    """A value as a string equal for values JSON Schema holds equal (1 and 1.0, any key
    order), so values can be compared and kept in sets."""
    return json.dumps(_plain(value), sort_keys=True, ensure_ascii=False)


def _plain(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def json_type(value: Any) -> str:
    """The JSON Schema type of a JSON value (an integral float is an integer, as in draft-07)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list | tuple) else "object"


def type_set(node: Mapping[str, Any]) -> frozenset[str] | None:
    """The types a node admits, None for any: those of its ``type`` its ``enum`` or ``const``
    values have (an untyped enum of strings admits strings only, and so does one typed
    ``["string", "null"]``). "integer" is dropped beside "number", which holds it."""
    declared = node.get("type")
    listed = values(node)
    found: set[str] | None = None
    if isinstance(declared, str):
        found = {declared}
    elif isinstance(declared, list):
        found = {str(t) for t in declared}
    if listed is not None:
        kinds = {json_type(v) for v in listed}
        if found is not None:
            kinds = {k for k in kinds if k in found or (k == "integer" and "number" in found)}
        found = kinds
    if found is None:
        return None
    if "number" in found:
        found.discard("integer")
    return frozenset(found)


def values(node: Mapping[str, Any]) -> list[Any] | None:
    """The values a node lists (``const`` as a list of one), None when it lists none."""
    if "const" in node:
        return [node["const"]]
    listed = node.get("enum")
    return list(listed) if isinstance(listed, list) else None


def as_node(schema: Any) -> dict[str, Any]:
    """A schema as a dict: ``true`` is ``{}`` and ``false`` refuses everything."""
    if schema is True:
        return {}
    if isinstance(schema, Mapping):
        return dict(schema)
    return {"not": {}}


@dataclass(frozen=True)
class Side:
    """One side of a comparison: a type's portable schema and its hoisted definitions."""

    root: Any
    definitions: Mapping[str, Any]

    def target(self, ref: str) -> Any | None:
        """What a local reference (``#``, ``#/definitions/Line``, any JSON pointer into the
        schema and its definitions) points at; None for one that leaves the type or leads
        nowhere, which is then compared as written."""
        if not ref.startswith("#"):
            return None
        found: Any = self._document
        pointer = unquote(ref[1:])
        if not pointer:
            return self.root
        if not pointer.startswith("/"):
            return None
        for raw in pointer[1:].split("/"):
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(found, Mapping) and part in found:
                found = found[part]
            elif isinstance(found, list) and part.isdigit() and int(part) < len(found):
                found = found[int(part)]
            else:
                return None
        return found

    @cached_property
    def _document(self) -> dict[str, Any]:
        # Built once: a copy per reference followed is quadratic in a long chain.
        return {**as_node(self.root), "definitions": dict(self.definitions)}

    def resolve(
        self, schema: Any, seen: tuple[str, ...] = ()
    ) -> tuple[dict[str, Any], tuple[str, ...]]:
        """A schema with its references followed and its wrappers unwrapped, and the
        references it went through (how a cycle is recognised: by the definitions' names)."""
        node = as_node(schema)
        refs = list(seen)
        while isinstance(node.get("$ref"), str):
            ref = node["$ref"]
            target = self.target(ref)
            if target is None or ref in refs:
                break  # leaves the type, or a loop of bare references: compared as written
            refs.append(ref)
            siblings = {k: v for k, v in node.items() if k != "$ref"}
            node = {**as_node(target), **siblings}
        return self._unwrap(node, tuple(refs))

    def _unwrap(
        self, node: dict[str, Any], refs: tuple[str, ...]
    ) -> tuple[dict[str, Any], tuple[str, ...]]:
        """``allOf: [X]``, ``anyOf: [X]`` as X; ``anyOf: [X, {"type": "null"}]`` (pydantic's
        ``X | None``) as X with "null" added to its type, when nothing else stands beside."""
        wrappers = [k for k in ("allOf", "anyOf", "oneOf") if k in node]
        if len(wrappers) != 1 or any(k != wrappers[0] and not is_annotation(k) for k in node):
            return node, refs
        branches = node[wrappers[0]]
        if not isinstance(branches, list) or not 0 < len(branches) <= 2:
            return node, refs
        nullable = len(branches) == 2
        if nullable:
            nulls = [i for i, b in enumerate(branches) if _is_null(b)]
            if wrappers[0] == "allOf" or len(nulls) != 1:
                return node, refs
            branches = [branches[1 - nulls[0]]]
        resolved, more = self.resolve(branches[0], refs)
        if nullable:
            types = type_set(resolved)
            if types is None or "null" in types or set(resolved) & _APPLIES_TO_ALL:
                return node, refs
            resolved = {**resolved, "type": sorted(types | {"null"})}
        siblings = {k: v for k, v in node.items() if k != wrappers[0]}
        return {**resolved, **siblings}, more


def _is_null(branch: Any) -> bool:
    return (
        isinstance(branch, Mapping)
        and branch.get("type") == "null"
        and all(k == "type" or is_annotation(k) for k in branch)
    )


def show(items: Iterable[Any]) -> str:
    """Values or types for a change's detail, in a stable order."""
    return ", ".join(sorted(canon(v) for v in items))
