"""An event type: its name, version, schema and where it travels, checked at declaration.

A pydantic model is declared by the JSON Schema it publishes (serialization mode: what
``model_dump(mode="json")`` produces, i.e. what consumers read), not by the model: that
schema, the one in the catalog's export and the AsyncAPI document, is what validates.
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from outbox.catalog import schemas
from outbox.catalog.schemas import JSONObject, SchemaProblem
from outbox.errors import CatalogError, OutboxValidationError
from outbox.message import MAX_EVENT_TYPE_BYTES, _is_json_type, _label

Mode = Literal["reject", "warn", "off"]
MODES: tuple[str, ...] = get_args(Mode)
JSON_CONTENT = "application/json"


@dataclass(frozen=True)
class EventType:
    """One declared type of event. ``schema`` is the JSON Schema as declared (file references
    bundled in), ``portable`` its draft-07 form and ``definitions`` the definitions hoisted
    out of it (see ``outbox.catalog.schemas.portable``). ``destinations`` are those it may be
    enqueued to (sorted); ``key``, when set, says what the key is and makes it required;
    ``validate`` None means the catalog's mode."""

    name: str
    version: int
    description: str | None
    schema: JSONObject
    portable: JSONObject
    definitions: JSONObject
    destinations: tuple[str, ...]
    examples: tuple[Any, ...] = ()
    deprecated: bool = False
    key: str | None = None
    content_type: str = JSON_CONTENT
    validate: Mode | None = None
    origin: str = ""

    def __post_init__(self) -> None:
        try:
            _label("event_type", self.name, MAX_EVENT_TYPE_BYTES)
        except OutboxValidationError as exc:
            raise CatalogError(f"event type {self.name!r}: the name {exc.message}") from None
        problem = _problem(self)
        if problem:
            raise CatalogError(f"event type {self.name!r}: {problem}")
        object.__setattr__(self, "destinations", tuple(sorted(set(self.destinations))))
        object.__setattr__(self, "examples", tuple(self.examples))

    # --- declaring ----------------------------------------------------------------------------

    @classmethod
    def from_model(
        cls,
        model: Any,
        name: str,
        *,
        destinations: Iterable[str],
        version: int = 1,
        key: str | None = None,
        examples: Iterable[Any] = (),
        deprecated: bool = False,
        validate: Mode | None = None,
        description: str | None = None,
        content_type: str = JSON_CONTENT,
    ) -> EventType:
        """The type of a pydantic model (its class), by the schema it publishes."""
        if not (inspect.isclass(model) and hasattr(model, "model_json_schema")):
            raise CatalogError(f"event type {name!r}: {model!r} is not a pydantic model class")
        schema = model.model_json_schema(mode="serialization")
        if description is None and model.__doc__:
            description = inspect.cleandoc(model.__doc__)
        return _declare(
            name,
            schema,
            None,
            origin=f"pydantic:{model.__module__}.{model.__qualname__}",
            version=version,
            destinations=tuple(destinations),
            key=key,
            examples=tuple(examples),
            deprecated=deprecated,
            validate=validate,
            description=description,
            content_type=content_type,
        )

    @classmethod
    def from_schema(
        cls,
        name: str,
        source: Mapping[str, Any] | str | Path,
        *,
        destinations: Iterable[str],
        version: int = 1,
        key: str | None = None,
        examples: Iterable[Any] = (),
        deprecated: bool = False,
        validate: Mode | None = None,
        description: str | None = None,
        content_type: str = JSON_CONTENT,
        base_dir: str | Path | None = None,
    ) -> EventType:
        """The type of a JSON Schema: a mapping, or the path of a JSON file (a str is a path).
        Relative file references are read now, from the file's folder (a mapping's: ``base_dir``,
        default the working directory); remote ones are refused."""
        if isinstance(source, Mapping):
            schema, origin = dict(source), "schema"
            base = Path(base_dir) if base_dir is not None else Path.cwd()
        else:
            path = Path(source)
            try:
                schema = schemas.read_json(path)
            except SchemaProblem as exc:
                raise CatalogError(f"event type {name!r}: {exc}") from None
            origin, base = str(path), path.resolve().parent
        if not isinstance(schema, dict):
            raise CatalogError(f"event type {name!r}: the schema is not a JSON object")
        return _declare(
            name,
            schema,
            base,
            origin=origin,
            version=version,
            destinations=tuple(destinations),
            key=key,
            examples=tuple(examples),
            deprecated=deprecated,
            validate=validate,
            description=description,
            content_type=content_type,
        )

    # --- export -------------------------------------------------------------------------------

    def export(self) -> JSONObject:
        """This type as the catalog's export holds it: JSON values only."""
        exported: JSONObject = json.loads(
            json.dumps(
                {
                    "name": self.name,
                    "version": self.version,
                    "description": self.description,
                    "schema": self.schema,
                    "portable": self.portable,
                    "definitions": self.definitions,
                    "examples": list(self.examples),
                    "deprecated": self.deprecated,
                    "destinations": list(self.destinations),
                    "key": self.key,
                    "content_type": self.content_type,
                    "validate": self.validate,
                    "origin": self.origin,
                },
                sort_keys=True,
                allow_nan=False,
            )
        )
        return exported

    @classmethod
    def load(cls, data: Mapping[str, Any]) -> EventType:
        """A type from its export (no application code, no pydantic), checked as a declaration
        is (jsonschema-rs, where installed, checks its schema and examples)."""
        name = data.get("name") if isinstance(data, Mapping) else None
        if not isinstance(data, Mapping) or set(data) != EXPORT_KEYS:
            got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
            raise CatalogError(
                f"event type {name!r} in the export: expected keys {sorted(EXPORT_KEYS)}, got {got}"
            )
        try:
            fields = copy.deepcopy(dict(data))
            fields["destinations"] = tuple(_strings(fields["destinations"]))
            if not isinstance(fields["examples"], list):
                raise CatalogError(f"event type {name!r} in the export: examples is no list")
            fields["examples"] = _json_values(str(name), tuple(fields["examples"]))
            loaded = cls(**fields)
            _check_schema(loaded.name, loaded.schema)
        except RecursionError:
            raise CatalogError(f"event type {name!r} in the export: nested too deeply") from None
        _check_compiled(loaded, loading=True)
        return loaded


EXPORT_KEYS = frozenset(
    {
        "name",
        "version",
        "description",
        "schema",
        "portable",
        "definitions",
        "examples",
        "deprecated",
        "destinations",
        "key",
        "content_type",
        "validate",
        "origin",
    }
)


def _strings(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


def _problem(t: EventType) -> str | None:
    """What is wrong with a type's plain fields, if anything."""
    if isinstance(t.version, bool) or not isinstance(t.version, int) or t.version < 1:
        return f"version must be an int >= 1, got {t.version!r}"
    if not t.destinations:
        return "declares no destination"
    if any(not isinstance(d, str) or not d.strip() for d in t.destinations):
        return f"destinations must be non-empty str, got {list(t.destinations)!r}"
    if t.key is not None and (not isinstance(t.key, str) or not t.key.strip()):
        return "key must be a non-empty str (what the key is) or None"
    if not isinstance(t.content_type, str) or not _is_json_type(t.content_type):
        return f"content_type must be application/json or a +json type, got {t.content_type!r}"
    if t.validate is not None and t.validate not in MODES:
        return f"validate must be one of {', '.join(MODES)} or None, got {t.validate!r}"
    if t.description is not None and not isinstance(t.description, str):
        return "description must be a str or None"
    if not isinstance(t.deprecated, bool):
        return "deprecated must be a bool"
    if not isinstance(t.origin, str):
        return "origin must be a str"
    for name in ("schema", "portable", "definitions"):
        if not isinstance(getattr(t, name), dict):
            return f"{name} must be a JSON object"
    return None


def _declare(
    name: str,
    declared: Mapping[str, Any],
    base: Path | None,
    *,
    origin: str,
    examples: tuple[Any, ...],
    description: str | None,
    **fields: Any,
) -> EventType:
    try:
        kind = schemas.dialect(declared)
        schema = schemas.bundle(declared, base, kind)
        _check_schema(name, schema)
        portable, definitions = schemas.portable(schema, kind)
    except SchemaProblem as exc:
        raise CatalogError(f"event type {name!r}: {exc.what} (at {exc.pointer})") from None
    except RecursionError:
        raise CatalogError(f"event type {name!r}: the schema is nested too deeply") from None
    if description is None and isinstance(schema.get("description"), str):
        description = schema["description"]
    event_type = EventType(
        name=name,
        schema=schema,
        portable=portable,
        definitions=definitions,
        examples=_json_values(name, examples),
        description=description,
        origin=origin,
        **fields,
    )
    _check_compiled(event_type, loading=False)
    return event_type


def _json_values(name: str, examples: tuple[Any, ...]) -> tuple[Any, ...]:
    try:
        return tuple(json.loads(json.dumps(e, allow_nan=False)) for e in examples)
    except (TypeError, ValueError) as exc:
        raise CatalogError(f"event type {name!r}: an example is not JSON ({exc})") from None


def _check_schema(name: str, schema: JSONObject) -> None:
    """What the portable form cannot carry, or carry with the same meaning, refused."""
    try:
        schemas.check(schema, schemas.dialect(schema))
    except SchemaProblem as exc:
        raise CatalogError(f"event type {name!r}: {exc.what} (at {exc.pointer})") from None


def _check_compiled(event_type: EventType, *, loading: bool) -> None:
    """The schema against its dialect's metaschema and each example against the schema, by
    jsonschema-rs. Without it, an export loads as it is, but examples cannot be declared:
    they are what consumers copy, so each must be valid, whatever the mode."""
    from outbox.catalog import validation

    name = event_type.name
    if not validation.installed():
        if event_type.examples and not loading:
            raise CatalogError(
                f"event type {name!r}: declaring examples needs jsonschema-rs, which checks "
                "them against the schema: pip install 'outbox-relay[catalog]'"
            )
        return
    validation.check_schema(event_type.schema, name)
    if not event_type.examples:
        return
    validator = validation.compile_schema(event_type.schema, name)
    for i, example in enumerate(event_type.examples):
        problem = validation.first_problem(validator, example)
        if problem is not None:
            raise CatalogError(
                f"event type {name!r}: examples[{i}]{problem.field} "
                f"{problem.message} ({problem.keyword})"
            )
