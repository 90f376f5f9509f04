"""The rules of docs/design/event-catalog.md §6 over one event type's schema, old against new.

Consumers are tolerant readers: they ignore fields and enum values they do not know. Old
events must stay valid under the new schema (replays, retained topics) and new events under
the old one, save for what such a reader ignores. What no rule here can judge (``anyOf`` and
its kin, a keyword unknown to the rules) is breaking when it differs, and named.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from outbox.catalog.compat_schema import (
    Side,
    canon,
    is_annotation,
    keyword,
    show,
    type_set,
    values,
)

Verdict = Literal["breaking", "safe"]

# Bounds by the direction that tightens them.
MAXIMA = ("maxLength", "maxItems", "maxProperties", "maximum", "exclusiveMaximum")
MINIMA = ("minLength", "minItems", "minProperties", "minimum", "exclusiveMinimum")
# Keywords holding subschemas no rule here can compare by meaning.
COMBINATORS = (
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "patternProperties",
    "dependencies",
    "propertyNames",
    "contains",
)
# Keywords a rule below reads; any other that differs cannot be judged.
_JUDGED = frozenset(
    {
        "type",
        "enum",
        "const",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "additionalItems",
        "multipleOf",
        "pattern",
        "format",
        "uniqueItems",
        "definitions",  # hoisted by the portable form; what refers to them is compared
        "$defs",
        *MAXIMA,
        *MINIMA,
        *COMBINATORS,
    }
)

_OLD_MAY_FAIL = "old events may not fit"
_NEW_MAY_FAIL = "old readers' storage may not fit new events"
_CANNOT_JUDGE = "cannot judge: no subset test; --allow if intended"
# Pairs of schemas one type's comparison may look at: shared definitions are compared once
# per pair, so only a schema built to be costly gets near it.
WORK_LIMIT = 20_000
# A bound's value that bounds nothing: the same as leaving it out.
_NO_BOUND = {"minLength": "0", "minItems": "0", "minProperties": "0", "uniqueItems": "false"}


class Finding(NamedTuple):
    path: str
    rule: str
    verdict: Verdict
    detail: str


def schema_changes(old_type: Mapping[str, Any], new_type: Mapping[str, Any]) -> list[Finding]:
    """How the payload schema of two versions of one type (export entries) differs."""
    walk = _Walk(
        Side(old_type.get("portable", {}), old_type.get("definitions") or {}),
        Side(new_type.get("portable", {}), new_type.get("definitions") or {}),
    )
    walk.node(walk.old.root, walk.new.root, "payload")
    walk.run()
    return walk.found


def member(path: str, name: str) -> str:
    """A field's path: ``payload.lines``, or ``payload["a.b"]`` for a name that is not an
    ASCII identifier (as an ``EventSchemaError`` names it; a look-alike letter shows)."""
    plain = name.isascii() and name.isidentifier()
    return f"{path}.{name}" if plain else f"{path}[{canon(name)}]"


@dataclass
class _Budget:
    left: int = WORK_LIMIT
    spent: bool = False


@dataclass
class _Walk:
    """A comparison, breadth first from a queue rather than by recursion, so a long chain of
    references costs no stack. A pair reached through a reference is compared once, by what
    its two sides hold (not by the references' names: ``Node`` and ``Node | None`` differ):
    that ends a cycle, and a definition shared by many fields is not compared once a path."""

    old: Side
    new: Side
    found: list[Finding] = field(default_factory=list)
    budget: _Budget = field(default_factory=_Budget)
    seen: set[tuple[str, str]] = field(default_factory=set)
    queue: deque[tuple[Any, Any, str]] = field(default_factory=deque)

    def add(self, path: str, rule: str, verdict: Verdict, detail: str) -> None:
        self.found.append(Finding(path, rule, verdict, detail))

    def node(self, old_schema: Any, new_schema: Any, path: str) -> None:
        self.queue.append((old_schema, new_schema, path))

    def inner(self) -> _Walk:
        """A walk of its own (a combinator's branches), on the same budget."""
        return _Walk(self.old, self.new, budget=self.budget)

    def run(self) -> None:
        while self.queue:
            old_schema, new_schema, path = self.queue.popleft()
            if self.budget.left <= 0:
                if not self.budget.spent:
                    detail = f"more than {WORK_LIMIT} schemas to compare ({_CANNOT_JUDGE})"
                    self.add(path, "cannot-judge", "breaking", detail)
                self.budget.spent = True
                self.queue.clear()
                return
            self.budget.left -= 1
            self._compare(old_schema, new_schema, path)

    def _compare(self, old_schema: Any, new_schema: Any, path: str) -> None:
        old, old_refs = self.old.resolve(old_schema)
        new, new_refs = self.new.resolve(new_schema)
        if old_refs or new_refs:
            pair = (canon(old), canon(new))
            if pair in self.seen:
                return  # compared already, or being compared: its findings are there
            self.seen.add(pair)
        for rule in _RULES:
            rule(self, old, new, path)


Rule = Callable[[_Walk, dict[str, Any], dict[str, Any], str], None]


def _annotations(w: _Walk, old: dict[str, Any], new: dict[str, Any], path: str) -> None:
    for key in sorted(k for k in old.keys() | new.keys() if is_annotation(k)):
        if key not in new:
            w.add(path, "annotation", "safe", f"{keyword(key)} removed")
        elif key not in old:
            w.add(path, "annotation", "safe", f"{keyword(key)} added")
        elif canon(old[key]) != canon(new[key]):
            w.add(path, "annotation", "safe", f"{keyword(key)} changed")


def _types(w: _Walk, old: dict[str, Any], new: dict[str, Any], path: str) -> None:
    before, after = type_set(old), type_set(new)
    if before == after:
        return
    if before is None or after is None:
        why = _OLD_MAY_FAIL if after is not None else "old readers may get a value of any type"
    else:
        gained, lost = sorted(after - before), sorted(before - after)
        parts = [f"old events may be {', '.join(lost)}"] if lost else []
        parts += [f"old readers may get {', '.join(gained)}"] if gained else []
        why = "; ".join(parts)
    shown = [", ".join(sorted(t)) if t is not None else "any" for t in (before, after)]
    w.add(path, "type-changed", "breaking", f"type {shown[0]} → {shown[1]} ({why})")


def _enums(w: _Walk, old: dict[str, Any], new: dict[str, Any], path: str) -> None:
    before, after = values(old), values(new)
    if before is None and after is None:
        return
    word = "const" if "const" in old or "const" in new else "enum"
    if before is None:
        w.add(path, "enum-narrowed", "breaking", f"{word} added (old events may hold others)")
        return
    if after is None:
        w.add(path, "enum-widened", "safe", f"{word} removed (tolerant reader)")
        return
    keys_before, keys_after = {canon(v) for v in before}, {canon(v) for v in after}
    lost = [v for v in before if canon(v) not in keys_after]
    gained = [v for v in after if canon(v) not in keys_before]
    if lost:
        detail = f"{word} loses {show(lost)} (old events may hold it)"
        w.add(path, "enum-narrowed", "breaking", detail)
    if gained:
        w.add(path, "enum-widened", "safe", f"{word} gains {show(gained)} (tolerant reader)")


def _bounds(w: _Walk, old: dict[str, Any], new: dict[str, Any], path: str) -> None:
    for key in (*MAXIMA, *MINIMA, "multipleOf", "pattern", "format", "uniqueItems"):
        before, after = _bound(old, key), _bound(new, key)
        if canon(before) == canon(after):
            continue
        way = _direction(key, before, after)
        why = {"tightened": _OLD_MAY_FAIL, "loosened": _NEW_MAY_FAIL}.get(
            way, f"{_OLD_MAY_FAIL}; {_NEW_MAY_FAIL}"
        )
        written = (old.get(key), new.get(key))
        shown = [canon(v) if v is not None else "none" for v in written]
        w.add(path, f"bound-{way}", "breaking", f"{key} {shown[0]} → {shown[1]} ({why})")


def _bound(node: dict[str, Any], key: str) -> Any:
    value = node.get(key)
    return None if value is not None and _NO_BOUND.get(key) == canon(value) else value


def _direction(key: str, before: Any, after: Any) -> str:
    """Whether a bound's change admits fewer values ("tightened"), more ("loosened"), or
    neither ("changed": a new pattern, a multipleOf neither divides)."""
    if key == "uniqueItems":
        return "tightened" if after else "loosened"
    if before is None or after is None:
        return "tightened" if before is None else "loosened"
    if not (_number(before) and _number(after)):
        return "changed"
    if key == "multipleOf":
        if before <= 0 or after <= 0:
            return "changed"
        if (after / before).is_integer():
            return "tightened"
        return "loosened" if (before / after).is_integer() else "changed"
    smaller = after < before
    return "tightened" if smaller == (key in MAXIMA) else "loosened"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _closed(node: dict[str, Any]) -> bool:
    return node.get("additionalProperties", True) is False


def _extra(node: dict[str, Any]) -> Any | None:
    """The schema of a node's additional properties, None when they are free or refused."""
    extra = node.get("additionalProperties", True)
    return None if extra is True or extra is False or extra == {} else extra


def _fields(w: _Walk, old: dict[str, Any], new: dict[str, Any], path: str) -> None:
    old_props, new_props = _properties(old), _properties(new)
    old_req, new_req = _required(old), _required(new)
    for name in sorted(old_props.keys() | new_props.keys() | old_req | new_req):
        at = member(path, name)
        if name not in old_props and name not in old_req:
            governing = _governing(w, old, name, at)
            _added(w, old, name, name in new_req, governing is None, at)
            for schema in governing or ():
                w.node(schema, new_props.get(name, {}), at)
        elif name not in new_props and name not in new_req:
            governing = _governing(w, new, name, at)
            closed = _closed(new) and governing is None
            _removed(w, old_props.get(name, {}), name in old_req, closed, at)
            for schema in governing or ():
                w.node(old_props.get(name, {}), schema, at)
        else:
            if name in old_req and name not in new_req:
                w.add(
                    at, "required-to-optional", "breaking", "now optional (new events may lack it)"
                )
            elif name in new_req and name not in old_req:
                w.add(
                    at, "optional-to-required", "breaking", "now required (old events may lack it)"
                )
            w.node(old_props.get(name, {}), new_props.get(name, {}), at)


def _properties(node: dict[str, Any]) -> dict[str, Any]:
    props = node.get("properties")
    return dict(props) if isinstance(props, Mapping) else {}


def _required(node: dict[str, Any]) -> set[str]:
    required = node.get("required")
    return {str(n) for n in required} if isinstance(required, list) else set()


def _governing(w: _Walk, node: dict[str, Any], name: str, at: str) -> list[Any] | None:
    """The schemas a field ``node`` does not list must fit: those of the patterns its name
    matches (unanchored, as JSON Schema's), else the additional properties' (then None when
    they are free or refused)."""
    patterns = node.get("patternProperties")
    matched = []
    for pattern, schema in patterns.items() if isinstance(patterns, Mapping) else ():
        try:
            hit = re.search(str(pattern), name) is not None
        except re.error:
            detail = f"pattern {canon(pattern)} unreadable here ({_CANNOT_JUDGE})"
            w.add(at, "cannot-judge", "breaking", detail)
            continue
        if hit:
            matched.append(schema)
    if matched:
        return matched
    extra = _extra(node)
    return None if extra is None else [extra]


def _name_fits(w: _Walk, node: dict[str, Any], name: str) -> bool | None:
    """Whether ``name`` fits the node's ``propertyNames``; None when no rule here can tell."""
    if "propertyNames" not in node:
        return True
    names = w.old.resolve(node["propertyNames"])[0]
    if any(k not in _NAME_KEYWORDS and not is_annotation(k) for k in names):
        return None
    types, listed = type_set(names), values(names)
    try:
        pattern = re.search(str(names["pattern"]), name) if "pattern" in names else True
    except re.error:
        return None
    shortest, longest = names.get("minLength", 0), names.get("maxLength", len(name))
    if not (_number(shortest) and _number(longest)):
        return None
    return (
        (types is None or "string" in types)
        and (listed is None or canon(name) in {canon(v) for v in listed})
        and bool(pattern)
        and shortest <= len(name) <= longest
    )


_NAME_KEYWORDS = frozenset({"type", "enum", "const", "pattern", "minLength", "maxLength"})


def _added(
    w: _Walk, old: dict[str, Any], name: str, required: bool, unmatched: bool, at: str
) -> None:
    fits = _name_fits(w, old, name)
    if required:
        w.add(at, "required-added", "breaking", "required field added (old events lack it)")
    elif fits is None:
        detail = f"the old propertyNames may refuse the name ({_CANNOT_JUDGE})"
        w.add(at, "cannot-judge", "breaking", detail)
    elif not fits:
        detail = "optional field added whose name the old propertyNames refuses"
        w.add(at, "optional-added", "breaking", detail)
    elif unmatched and _closed(old):
        detail = "optional field added to a closed object (additionalProperties: false)"
        w.add(at, "optional-added", "breaking", detail)
    else:
        w.add(at, "optional-added", "safe", "optional field added (tolerant reader)")


def _removed(w: _Walk, schema: Any, required: bool, closed: bool, at: str) -> None:
    deprecated = w.old.resolve(schema)[0].get("deprecated") is True
    if required:
        detail = "required field removed (readers of it get nothing; deprecate first)"
    elif closed:
        detail = "field removed from a closed object (old events holding it fail)"
    elif not deprecated:
        detail = "optional field removed without being deprecated first (readers get nothing)"
    else:
        w.add(at, "field-removed", "safe", "deprecated optional field removed")
        return
    w.add(at, "field-removed", "breaking", detail)


def _additional(w: _Walk, old: dict[str, Any], new: dict[str, Any], path: str) -> None:
    before, after = _extra(old), _extra(new)
    if _closed(old) == _closed(new) and before is None and after is None:
        return
    if not _closed(old) and not _closed(new):
        w.node(before or {}, after or {}, f"{path}.*")
        return
    shown = [
        "false" if _closed(n) else "a schema" if e is not None else "true"
        for n, e in ((old, before), (new, after))
    ]
    why = "old extras now invalid" if _closed(new) else "a closed schema promised no other field"
    detail = f"additionalProperties {shown[0]} → {shown[1]} ({why})"
    w.add(path, "additional-properties", "breaking", detail)


def _sequence(node: dict[str, Any]) -> tuple[list[Any], Any]:
    """A node's items as (a schema per leading position, the schema of the rest)."""
    items = node.get("items", {})
    if isinstance(items, list):
        return items, node.get("additionalItems", {})
    return [], items


def _items(w: _Walk, old: dict[str, Any], new: dict[str, Any], path: str) -> None:
    if not {"items", "additionalItems"} & (old.keys() | new.keys()):
        return
    (old_lead, old_rest), (new_lead, new_rest) = _sequence(old), _sequence(new)
    for i in range(max(len(old_lead), len(new_lead))):
        before = old_lead[i] if i < len(old_lead) else old_rest
        after = new_lead[i] if i < len(new_lead) else new_rest
        w.node(before, after, f"{path}[{i}]")
    w.node(old_rest, new_rest, f"{path}[]")


def _combinators(w: _Walk, old: dict[str, Any], new: dict[str, Any], path: str) -> None:
    for key in COMBINATORS:
        if key not in old and key not in new:
            continue
        inner = w.inner()
        alike = _alike(inner, key, old.get(key), new.get(key), path)
        inner.run()
        if not alike or any(f.rule != "annotation" for f in inner.found):
            w.add(path, "cannot-judge", "breaking", f"{key} differs ({_CANNOT_JUDGE})")
        else:
            w.found.extend(inner.found)  # a description inside a branch: safe as anywhere


def _alike(w: _Walk, key: str, before: Any, after: Any, path: str) -> bool:
    """Whether a combinator's two values have the same shape, comparing the schemas they hold
    into ``w``: branch by branch, pattern by pattern, or the one schema."""
    if before is None or after is None:
        return False
    if key in ("patternProperties", "dependencies"):
        if not (isinstance(before, Mapping) and isinstance(after, Mapping)):
            return canon(before) == canon(after)
        if before.keys() != after.keys():
            return False
        return all(_same(w, before[k], after[k], path) for k in sorted(before))
    if key in ("allOf", "anyOf", "oneOf"):
        if not (isinstance(before, list) and isinstance(after, list)):
            return canon(before) == canon(after)
        if len(before) != len(after):
            return False
        return all(_same(w, b, a, path) for b, a in zip(before, after, strict=True))
    return _same(w, before, after, path)


def _same(w: _Walk, before: Any, after: Any, path: str) -> bool:
    if isinstance(before, list) or isinstance(after, list):
        return canon(before) == canon(after)  # a dependency's list of names
    w.node(before, after, path)
    return True


def _unjudged(w: _Walk, old: dict[str, Any], new: dict[str, Any], path: str) -> None:
    for key in sorted(old.keys() | new.keys()):
        if key in _JUDGED or is_annotation(key):
            continue
        if canon(old.get(key)) != canon(new.get(key)):
            w.add(path, "cannot-judge", "breaking", f"{keyword(key)} differs ({_CANNOT_JUDGE})")


_RULES: tuple[Rule, ...] = (
    _annotations,
    _types,
    _enums,
    _bounds,
    _fields,
    _additional,
    _items,
    _combinators,
    _unjudged,
)
