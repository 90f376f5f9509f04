"""The keys the AsyncAPI document files things under, and the catalog's schemas moved into it.

AsyncAPI keys must match ``^[A-Za-z0-9.\\-_]+$`` (the parser does not check it), while event
types and destinations may be any text: :func:`escape` maps names to keys injectively, so two
names never share a component or a channel. A type's schema goes to
``components.schemas.<type>`` and its hoisted definitions to ``<type>.<Def>``, with every
``#/definitions/<Def>`` reference rewritten to point there.
"""

from __future__ import annotations

import string
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import unquote

SCHEMAS = "#/components/schemas/"

_SAFE = frozenset(string.ascii_letters + string.digits + ".-")
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas (draft-07;
# dependencies' values are a schema or a list of property names). Every other keyword's value
# is data (const, enum, default, examples) and is never rewritten.
_ONE = frozenset(
    [
        "additionalItems",
        "additionalProperties",
        "contains",
        "propertyNames",
        "if",
        "then",
        "else",
        "not",
        "items",
    ]
)
_MANY = frozenset(("allOf", "anyOf", "oneOf", "items"))
_NAMED = frozenset(("properties", "patternProperties", "definitions", "dependencies"))


def escape(name: str) -> str:
    """``name`` as a key: letters, digits, ``.`` and ``-`` kept, ``_`` doubled, any other
    character ``_x`` and its UTF-8 bytes in hex (their first byte says how many follow, so the
    key reads back as one name only). The empty name is ``_``, which no other name gives."""
    if not name:
        return "_"
    out = []
    for c in name:
        if c in _SAFE:
            out.append(c)
        elif c == "_":
            out.append("__")
        else:
            out.append("_x" + c.encode("utf-8", "surrogatepass").hex())
    return "".join(out)


def schema_keys(types: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str | None], str]:
    """The component key of each type's schema, ``(type, None)``, and of each of its hoisted
    definitions, ``(type, definition)``: ``<type>.<Def>``, unless that is another type's key
    or another definition's (type ``order.Line`` beside type ``order`` with a ``Line``); those
    are ``<type>_.<Def>``, a ``_`` no escaped name has before a ``.``."""
    keys: dict[tuple[str, str | None], str] = {}
    wanted: dict[tuple[str, str | None], str] = {}
    for t in types:
        keys[(t["name"], None)] = escape(t["name"])
        for d in t.get("definitions") or {}:
            wanted[(t["name"], d)] = f"{escape(t['name'])}.{escape(d)}"
    taken = set(keys.values())
    count = Counter(wanted.values())
    for (name, d), key in wanted.items():
        clash = key in taken or count[key] > 1
        keys[(name, d)] = f"{escape(name)}_.{escape(str(d))}" if clash else key
    return keys


def rewrite(schema: Any, ref: Callable[[str], str]) -> Any:
    """``schema`` with each ``$ref`` replaced by ``ref($ref)``, walking schemas only (a
    ``const`` holding ``{"$ref": …}`` is data). ``$id`` is dropped: in a component it would
    change what the references beside it resolve against."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str):
            out[k] = ref(v)
        elif k == "$id":
            continue
        elif k in _MANY and isinstance(v, list):
            out[k] = [rewrite(s, ref) for s in v]
        elif k in _ONE:
            out[k] = rewrite(v, ref)
        elif k in _NAMED and isinstance(v, dict):
            out[k] = {name: rewrite(s, ref) for name, s in v.items()}
        else:
            out[k] = v
    return out


def _unpointer(segment: str) -> str:
    return unquote(segment).replace("~1", "/").replace("~0", "~")


def ref_rewriter(
    type_name: str, keys: Mapping[tuple[str, str | None], str]
) -> Callable[[str], str]:
    """How a reference inside ``type_name``'s schema reads once moved to the components:
    ``#/definitions/<Def>…`` to that definition's component, any other ``#…`` (the schema's
    root, recursion) to the type's own."""

    def ref(target: str) -> str:
        if not target.startswith("#"):
            raise ValueError(
                f"event type {type_name!r}: $ref {target[:200]!r} points outside its schema; "
                "the catalog bundles references, so its export holds local ones only"
            )
        parts = target[1:].split("/")
        if len(parts) >= 3 and parts[0] == "" and parts[1] == "definitions":
            key = keys.get((type_name, _unpointer(parts[2])))
            if key is None:
                raise ValueError(
                    f"event type {type_name!r}: $ref {target[:200]!r} names a definition it "
                    "does not have"
                )
            return SCHEMAS + "/".join([key, *parts[3:]])
        return SCHEMAS + keys[(type_name, None)] + target[1:]

    return ref


def component_schemas(
    types: Iterable[Mapping[str, Any]], keys: Mapping[tuple[str, str | None], str]
) -> dict[str, Any]:
    """``components.schemas``: each type's portable schema and its hoisted definitions."""
    schemas: dict[str, Any] = {}
    for t in types:
        ref = ref_rewriter(t["name"], keys)
        schemas[keys[(t["name"], None)]] = rewrite(t["portable"], ref)
        for d, schema in (t.get("definitions") or {}).items():
            schemas[keys[(t["name"], d)]] = rewrite(schema, ref)
    return schemas
