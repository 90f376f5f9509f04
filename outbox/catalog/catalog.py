"""The catalog: the declared event types, the check at ``enqueue``, the export and its load."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args

from outbox.catalog.types import MODES, EventType, Mode
from outbox.errors import CatalogError, EventSchemaError
from outbox.message import NewMessage, Payload, _is_json_type

if TYPE_CHECKING:
    import jsonschema_rs

Unknown = Literal["allow", "warn", "reject"]
UNKNOWN: tuple[str, ...] = get_args(Unknown)
FORMAT = "outbox-catalog/1"
WARN_EVERY_S = 60.0

log = logging.getLogger("outbox.catalog")
M = TypeVar("M")


class Catalog:
    """Event types declared once: checked at ``enqueue`` (``Outbox(catalog=...)``,
    ``outbox.catalog.use``), exported for the relay and its documents.

    ``validate`` is the mode of the types that name none: ``reject`` refuses an event that
    does not match its type (an ``EventSchemaError`` before any SQL), ``warn`` stores it and
    logs ``outbox.catalog.invalid`` (at most once a minute per type, field and keyword, every
    index of a list counting as one field),
    ``off`` checks nothing. ``unknown`` is what an ``event_type`` the catalog does not
    declare gets; an event without ``event_type`` is never checked."""

    def __init__(
        self,
        title: str = "events",
        version: str = "1",
        validate: Mode = "off",
        unknown: Unknown = "allow",
    ) -> None:
        if validate not in MODES:
            raise CatalogError(f"validate must be one of {', '.join(MODES)}, got {validate!r}")
        if unknown not in UNKNOWN:
            raise CatalogError(f"unknown must be one of {', '.join(UNKNOWN)}, got {unknown!r}")
        if not isinstance(title, str) or not isinstance(version, str):
            raise CatalogError("a catalog's title and version are str")
        self.title = title
        self.version = version
        self.validate: Mode = validate
        self.unknown: Unknown = unknown
        self._types: dict[str, EventType] = {}
        # Compiled on a type's first checked event, once (a race compiles twice, harmlessly).
        self._validators: dict[str, jsonschema_rs.Validator] = {}
        # Types whose schema does not compile (a catalog loaded without jsonschema-rs, say):
        # in warn mode their events go through, the type logged once.
        self._broken: set[str] = set()
        self._warnings = _Throttle(WARN_EVERY_S, time.monotonic)

    # --- declaring --------------------------------------------------------------------------

    def add(self, event_type: EventType) -> EventType:
        if not isinstance(event_type, EventType):
            raise CatalogError(f"add takes an EventType, got {type(event_type).__name__}")
        if event_type.name in self._types:
            raise CatalogError(f"event type {event_type.name!r} is declared twice")
        self._types[event_type.name] = event_type
        return event_type

    def event(
        self,
        name: str,
        *,
        destinations: Iterable[str],
        version: int = 1,
        key: str | None = None,
        examples: Iterable[Any] = (),
        deprecated: bool = False,
        validate: Mode | None = None,
        description: str | None = None,
    ) -> Callable[[M], M]:
        """Declare a pydantic model as event type ``name``; the model is returned as it was."""

        def declare(model: M) -> M:
            self.add(
                EventType.from_model(
                    model,
                    name,
                    destinations=destinations,
                    version=version,
                    key=key,
                    examples=examples,
                    deprecated=deprecated,
                    validate=validate,
                    description=description,
                )
            )
            return model

        return declare

    # --- reading ----------------------------------------------------------------------------

    def get(self, name: str) -> EventType | None:
        return self._types.get(name)

    def __iter__(self) -> Iterator[EventType]:
        return iter(sorted(self._types.values(), key=lambda t: t.name))

    def __len__(self) -> int:
        return len(self._types)

    def __contains__(self, name: object) -> bool:
        return name in self._types

    def for_destination(self, destination: str) -> list[EventType]:
        return [t for t in self if destination in t.destinations]

    def export(self) -> dict[str, Any]:
        """The catalog as JSON values (``format`` ``outbox-catalog/1``): what ``load`` reads
        back, and what the relay's commands take without the application's code."""
        return {
            "format": FORMAT,
            "title": self.title,
            "version": self.version,
            "validate": self.validate,
            "unknown": self.unknown,
            "types": [t.export() for t in self],
        }

    @classmethod
    def load(cls, source: Mapping[str, Any] | str | Path) -> Catalog:
        """A catalog from its export: a mapping, or the path of its JSON file. Each type is
        checked as its declaration was."""
        data: Any = source
        if not isinstance(source, Mapping):
            try:
                data = json.loads(Path(source).read_text(encoding="utf-8"))
            except OSError as exc:
                raise CatalogError(f"catalog {str(source)!r} cannot be read ({exc})") from None
            except ValueError as exc:
                raise CatalogError(f"catalog {str(source)!r} is not JSON ({exc})") from None
            except RecursionError:
                raise CatalogError(f"catalog {str(source)!r} is nested too deeply") from None
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise CatalogError(f"not a catalog export: expected format {FORMAT!r}")
        expected = {"format", "title", "version", "validate", "unknown", "types"}
        if set(data) != expected or not isinstance(data["types"], list):
            raise CatalogError(
                f"catalog export: expected keys {sorted(expected)} (types a list), "
                f"got {sorted(data)}"
            )
        catalog = cls(data["title"], data["version"], data["validate"], data["unknown"])
        for t in data["types"]:
            catalog.add(EventType.load(t))
        return catalog

    # --- the check at enqueue ---------------------------------------------------------------

    def check(self, message: NewMessage, payload: Payload) -> None:
        """Refuse (``reject``) or log (``warn``) an event that is not what its type says.
        Called by ``Outbox`` on an event already built, before any SQL."""
        name = message.event_type
        if name is None:
            return
        event_type = self._types.get(name)
        if event_type is None:
            self._unknown(message, name)
            return
        mode = event_type.validate or self.validate
        if mode == "off":
            return
        problem = self._problem(event_type, message, payload)
        if problem is None:
            return
        if mode == "reject":
            raise problem
        self._warn(problem, message.destination)

    def _unknown(self, message: NewMessage, name: str) -> None:
        if self.unknown == "allow":
            return
        problem = EventSchemaError(
            "event_type",
            f"{name!r} is not a type of the catalog {self.title!r}",
            event_type=name,
            version=None,
            keyword="unknown",
        )
        if self.unknown == "reject":
            raise problem
        self._warn(problem, message.destination)

    def _problem(
        self, t: EventType, message: NewMessage, payload: Payload
    ) -> EventSchemaError | None:
        def refusal(field: str, what: str, keyword: str, path: str = "") -> EventSchemaError:
            return EventSchemaError(
                field,
                f"{what} ({t.name} v{t.version}: {keyword})",
                event_type=t.name,
                version=t.version,
                path=path,
                keyword=keyword,
            )

        if message.destination not in t.destinations:
            listed = ", ".join(repr(d) for d in t.destinations)
            return refusal("destination", f"is not one of the type's ({listed})", "destinations")
        if t.key is not None and not (message.key or "").strip():
            return refusal("key", f"is required: {t.key}", "key")
        if not _is_json_type(message.content_type):
            return refusal("content_type", "is not JSON", "content_type")
        from outbox.catalog import validation

        validator = self._validator(t)
        if validator is None:
            return None
        found = validation.payload_problem(validator, payload, message.payload)
        if found is None:
            return None
        return refusal("payload" + found.field, found.message, found.keyword, found.path)

    def _validator(self, t: EventType) -> jsonschema_rs.Validator | None:
        """The type's validator, compiled once; None for a type in warn mode whose schema does
        not compile (logged ``outbox.catalog.broken`` once): warn never fails the write."""
        from outbox.catalog import validation

        validator = self._validators.get(t.name)
        if validator is not None or t.name in self._broken:
            return validator
        try:
            validator = self._validators[t.name] = validation.compile_schema(t.schema, t.name)
        except CatalogError as exc:
            if (t.validate or self.validate) != "warn":
                raise
            self._broken.add(t.name)
            log.error(
                "outbox.catalog.broken event_type=%s version=%s error=%s", t.name, t.version, exc
            )
            return None
        return validator

    def _warn(self, problem: EventSchemaError, destination: str) -> None:
        name = (
            "outbox.catalog.unknown" if problem.keyword == "unknown" else "outbox.catalog.invalid"
        )
        # Per rule, not per place: every index of a list is the same rule.
        rule = _INDEX.sub("[]", problem.field)
        suppressed = self._warnings.allow((problem.event_type, rule, problem.keyword))
        if suppressed is None:
            return
        log.warning(
            "%s event_type=%s version=%s field=%s keyword=%s destination=%s suppressed=%d",
            name,
            problem.event_type,
            problem.version,
            problem.field,
            problem.keyword,
            destination,
            suppressed,
        )


_INDEX = re.compile(r"\[\d+\]")


class _Throttle:
    """At most one line per subject every ``every`` seconds, with the count held back since.
    Subjects not seen for ``every`` seconds are forgotten (with their count), once there are
    ``keep`` of them, so that the table does not grow with the life of the process."""

    def __init__(self, every: float, clock: Callable[[], float], keep: int = 1024) -> None:
        self.every = every
        self.clock = clock
        self.keep = keep
        self._lock = threading.Lock()
        self._last: dict[tuple[str, ...], float] = {}
        self._held: dict[tuple[str, ...], int] = {}

    def allow(self, subject: tuple[str, ...]) -> int | None:
        """None to hold this one back; else how many were held back before it."""
        now = self.clock()
        with self._lock:
            last = self._last.get(subject)
            if last is not None and now - last < self.every:
                self._held[subject] = self._held.get(subject, 0) + 1
                return None
            if len(self._last) >= self.keep:
                self._forget(now)
            self._last[subject] = now
            return self._held.pop(subject, 0)

    def _forget(self, now: float) -> None:
        for old in [s for s, last in self._last.items() if now - last >= self.every]:
            del self._last[old]
            self._held.pop(old, None)
