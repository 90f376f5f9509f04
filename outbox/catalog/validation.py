"""Checking values against a type's schema with jsonschema-rs, without ever showing a value.

jsonschema-rs (``pip install 'outbox-relay[catalog]'``) is imported on the first compile,
so an application whose types all have validation off never loads it. Validators are built
with ``mask`` (errors say ``[value]`` where the value would be: an error or a log line never
carries a payload's data), ``offline`` (no reference is fetched: schemas were bundled at
declaration) and ``validate_formats`` (2020-12 formats are annotations otherwise).
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


def compile_schema(schema: Mapping[str, Any], name: str) -> jsonschema_rs.Validator:
    """A validator of event type ``name``'s ``schema`` (its dialect from ``$schema``, 2020-12
    without one). A schema that is no valid JSON Schema is a ``CatalogError``."""
    rs = jsonschema_rs_module()
    try:
        validator: jsonschema_rs.Validator = rs.validator_for(
            dict(schema), validate_formats=True, mask=MASK, offline=True
        )
    except rs.ValidationError as exc:
        raise CatalogError(
            f"event type {name!r}: the schema is not a valid JSON Schema ({exc.message})"
        ) from None
    return validator


@dataclass(frozen=True, slots=True)
class Problem:
    """The first error of a value: where (as a field suffix, ``.lines[0].sku``, and as a JSON
    pointer), the keyword, and jsonschema-rs's masked message."""

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
    """The first error of an event's payload: the mapping or list given, read as it is (the
    fast way), or the stored JSON where jsonschema-rs cannot read it as it is (a non-str key,
    which ``json.dumps`` wrote as a string; a mapping that is no dict), and str/bytes payloads
    from their JSON."""
    if isinstance(payload, dict | list):
        rs = jsonschema_rs_module()
        try:
            validator.validate(payload)
        except rs.ValidationError as exc:
            return _problem(exc)
        except ValueError:
            pass  # not readable as it is: below, from the bytes stored
        else:
            return None
    return first_problem(validator, json.loads(stored))


def _problem(exc: jsonschema_rs.ValidationError) -> Problem:
    # Only what the schema names is kept: the error's own ``instance`` holds the value.
    segments: list[str | int] = list(exc.instance_path)
    kind = exc.kind
    keyword = kind.name
    if keyword == "required":
        segments.append(str(getattr(kind, "property", "")))
    elif keyword == "additionalProperties":
        unexpected = sorted(str(u) for u in getattr(kind, "unexpected", []))
        if unexpected:
            segments.append(unexpected[0])
    return Problem(field_path(segments), json_pointer(segments), keyword, exc.message)


def field_path(segments: list[str | int]) -> str:
    """``["lines", 0, "sku", "a.b"]`` → ``.lines[0].sku["a.b"]``."""
    out = []
    for s in segments:
        if isinstance(s, int):
            out.append(f"[{s}]")
        elif _IDENTIFIER.match(s):
            out.append(f".{s}")
        else:
            out.append(f"[{json.dumps(s, ensure_ascii=False)}]")
    return "".join(out)


def json_pointer(segments: list[str | int]) -> str:
    return "".join("/" + str(s).replace("~", "~0").replace("/", "~1") for s in segments)
