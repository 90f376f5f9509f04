"""Checking values against a type's schema with jsonschema-rs, without ever showing a value.

jsonschema-rs (``pip install 'outbox-relay[catalog]'``) is imported on the first compile,
Validators of payloads are built with ``mask`` (errors say ``[value]`` where the value would
be), ``offline`` (no reference is fetched: schemas were bundled at declaration) and
``validate_formats`` (2020-12 formats are annotations otherwise). A payload's keys are data
too: a key the schema does not name (a map's, an unexpected one) is written ``[*]``, and the
messages that would quote one are worded here. An error or a log line never carries a
payload's data.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from outbox.errors import CatalogError

if TYPE_CHECKING:
    import jsonschema_rs

MASK = "[value]"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def jsonschema_rs_module() -> ModuleType:
    try:
        return importlib.import_module("jsonschema_rs")
    except ModuleNotFoundError as exc:
        if exc.name != "jsonschema_rs":
            raise
        raise ModuleNotFoundError(
            "validating events needs jsonschema-rs: pip install 'outbox-relay[catalog]'",
            name="jsonschema_rs",
        ) from exc


def installed() -> bool:
    """Whether jsonschema-rs can be imported (the checks that need it are skipped otherwise)."""
    try:
        jsonschema_rs_module()
    except ModuleNotFoundError:
        return False
    return True


def compile_schema(schema: Mapping[str, Any], name: str) -> jsonschema_rs.Validator:
    """A validator of event type ``name``'s ``schema`` (its dialect from ``$schema``, 2020-12
    without one). A schema that is no valid JSON Schema is a ``CatalogError``."""
    rs = jsonschema_rs_module()
    try:
        validator: jsonschema_rs.Validator = rs.validator_for(
            dict(schema), validate_formats=True, mask=MASK, offline=True
        )
    except ValueError as exc:  # its ValidationError, or "Recursion limit reached"
        raise CatalogError(f"event type {name!r}: the schema is not a valid JSON Schema") from exc
    return validator


def check_schema(schema: Mapping[str, Any], name: str) -> None:
    """``schema`` checked at declaration against its dialect's metaschema, patterns compiled:
    a ``CatalogError`` naming the place in the schema and, unmasked, what is wrong there
    (the author's schema, not a payload), rather than every event failing later."""
    rs = jsonschema_rs_module()
    try:
        rs.validator_for(dict(schema), validate_formats=True, offline=True)
    except rs.ValidationError as exc:
        where = "#" + json_pointer(list(exc.instance_path))
        raise CatalogError(
            f"event type {name!r}: the schema is not a valid JSON Schema: {exc.message} "
            f"(at {where})"
        ) from None
    except ValueError as exc:
        raise CatalogError(f"event type {name!r}: the schema cannot be compiled ({exc})") from None


@dataclass(frozen=True, slots=True)
class Problem:
    """The first error of a value: where (as a field suffix, ``.lines[0].sku``, and as a JSON
    pointer; ``[*]`` and ``*`` for a key the schema does not name), the keyword, and what is
    wrong, in words that carry no value nor key of the payload."""

    field: str
    path: str
    keyword: str
    message: str


def first_problem(validator: jsonschema_rs.Validator, value: Any) -> Problem | None:
    """The first error of ``value`` (a JSON value), or None if it is valid."""
    rs = jsonschema_rs_module()
    try:
        validator.validate(value)
    except rs.ValidationError as exc:
        return _problem(exc)
    return None


def payload_problem(
    validator: jsonschema_rs.Validator, payload: Any, stored: bytes
) -> Problem | None:
    """The first error of an event's payload: a plain dict or list read as it is (the fast
    way), else what is stored, read back. Stored is what consumers get: a dict subclass may
    serialise otherwise than it reads, a non-str key is written as a string (two keys may then
    collide), a str/bytes payload may repeat a key (readers differ on which one wins: refused)."""
    if type(payload) is dict or type(payload) is list:
        rs = jsonschema_rs_module()
        try:
            validator.validate(payload)
        except rs.ValidationError as exc:
            return _problem(exc)
        except ValueError:
            pass  # not readable as it is (a non-str key...): below, from the bytes stored
        else:
            return None
    try:
        value = json.loads(stored, object_pairs_hook=_unique)
    except _DuplicateKey:
        return Problem("", "", "duplicateKey", "an object holds the same key twice")
    return first_problem(validator, value)


class _DuplicateKey(ValueError):
    pass


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise _DuplicateKey
    return found


# Keywords whose masked message names only the schema's values (the rest are worded below).
_SAFE = frozenset(
    {
        "type",
        "enum",
        "const",
        "not",
        "format",
        "pattern",
        "minLength",
        "maxLength",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "uniqueItems",
        "contains",
        "anyOf",
        "oneOf",
        "required",
        "falseSchema",
        "contentEncoding",
        "contentMediaType",
    }
)
# What a property name's refusal may quote: values the schema supplies.
_SCHEMA_VALUES = ("limit", "pattern", "format", "options", "expected_value", "types")
_UNEXPECTED_PROPERTY = frozenset({"additionalProperties", "unevaluatedProperties"})


def _problem(exc: jsonschema_rs.ValidationError) -> Problem:
    keyword = exc.kind.name
    segments = _segments(list(exc.evaluation_path), list(exc.instance_path))
    if keyword == "falseSchema" and exc.evaluation_path[-1:] == ["additionalProperties"]:
        keyword = "additionalProperties"  # jsonschema-rs's word for additionalProperties: false
    if keyword == "required":
        segments.append(str(getattr(exc.kind, "property", "")))  # a name the schema gives
    elif keyword in _UNEXPECTED_PROPERTY:
        segments.append(None)
    return Problem(field_path(segments), json_pointer(segments), keyword, _message(exc, keyword))


def _message(exc: jsonschema_rs.ValidationError, keyword: str) -> str:
    if keyword in _SAFE:
        return exc.message
    if keyword in _UNEXPECTED_PROPERTY:
        return "an unexpected property"
    if keyword in ("additionalItems", "unevaluatedItems"):
        return "an unexpected item"
    if keyword == "propertyNames":
        inner = getattr(exc.kind, "error", None)
        if inner is None:
            return "a property name is not allowed"
        values = inner.kind.as_dict()
        quoted = [json.dumps(values[k], ensure_ascii=False) for k in _SCHEMA_VALUES if k in values]
        detail = " ".join([inner.kind.name, *quoted[:1]])
        return f"a property name is not allowed ({detail})"
    return "does not match the schema"


def _segments(evaluation: list[str | int], instance: list[str | int]) -> list[str | int | None]:
    """The instance path with each key the schema does not name (matched by
    ``additionalProperties`` or ``patternProperties``, or not matched at all) as None: walked
    along the evaluation path, a key is kept only where it is a declared ``properties/<name>``."""
    out: list[str | int | None] = []
    steps = iter(evaluation)
    for step in steps:
        if len(out) == len(instance):
            break
        here = instance[len(out)]
        if step == "properties":
            name = next(steps, None)
            out.append(here if name == here else None)
        elif step in ("patternProperties", "prefixItems"):
            next(steps, None)
            out.append(here if isinstance(here, int) else None)
        elif step in _UNEXPECTED_PROPERTY or step in _ITEMS:
            out.append(here if isinstance(here, int) else None)
        elif step in _NAMED:
            next(steps, None)  # a name or index in the schema, no step in the instance
    # Steps the evaluation path does not account for: indices kept, keys not.
    out.extend(s if isinstance(s, int) else None for s in instance[len(out) :])
    return out


_ITEMS = frozenset({"items", "additionalItems", "contains", "unevaluatedItems"})
_NAMED = frozenset(
    {"$defs", "definitions", "dependentSchemas", "dependencies", "allOf", "anyOf", "oneOf"}
)


def field_path(segments: list[str | int | None]) -> str:
    """``["lines", 0, "sku", "a.b", None]`` → ``.lines[0].sku["a.b"][*]``."""
    out = []
    for s in segments:
        if s is None:
            out.append("[*]")
        elif isinstance(s, int):
            out.append(f"[{s}]")
        elif _IDENTIFIER.match(s):
            out.append(f".{s}")
        else:
            out.append(f"[{json.dumps(s, ensure_ascii=False)}]")
    return "".join(out)


def json_pointer(segments: list[str | int | None]) -> str:
    return "".join(
        "/*" if s is None else "/" + str(s).replace("~", "~0").replace("/", "~1") for s in segments
    )
