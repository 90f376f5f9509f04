"""Whether a catalog's new release keeps its promises to the consumers of the old one
(docs/design/event-catalog.md §6): ``compare(old, new)`` over two ``Catalog.export()``
dicts, pure (no database, no validator), for ``outbox-relay catalog check``.

Types added, removed, deprecated, dropped from a destination, their key, and each type's
payload schema by the rules of ``compat_rules``. A higher ``version`` excuses nothing: the
command's ``--allow TYPE`` does (a decision on the design's open question 3).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from outbox.catalog.compat_rules import Finding, Verdict, schema_changes
from outbox.catalog.compat_schema import canon

__all__ = ["Change", "Verdict", "compare"]

FORMAT = "outbox-catalog/1"


@dataclass(frozen=True, order=True)
class Change:
    """One difference between two releases of a catalog.

    ``path`` is where in the type it lies: ``payload`` and below (``payload.lines[].sku``),
    ``destinations``, ``key``, ``content_type``, ``version``, ``description``, ``examples``,
    or empty for the whole type.
    ``rule`` names the row of §6 that judged it (``required-added``, ``enum-widened``,
    ``cannot-judge``, ...)."""

    type: str
    path: str
    rule: str
    verdict: Verdict
    detail: str

    @property
    def breaking(self) -> bool:
        return self.verdict == "breaking"

    def __str__(self) -> str:
        where = f"{self.type} {self.path}" if self.path else self.type
        return f"{'BREAKING' if self.breaking else 'safe'} {where}: {self.detail}"


def compare(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """Every change from ``old`` to ``new`` (both ``Catalog.export()`` dicts), sorted; an
    empty list when they promise the same. Raises ``ValueError`` for a dict that is not an
    export of this format (an AsyncAPI document is read into one by the command first), or
    for a schema nested too deeply to compare."""
    before, after = _types(old, "old"), _types(new, "new")
    changes: list[Change] = []
    for name in sorted(before.keys() | after.keys()):
        was, now = before.get(name), after.get(name)
        if was is None:
            changes.append(Change(name, "", "type-added", "safe", "type added"))
        elif now is None:
            changes.append(_removed(name, was))
        else:
            try:
                changes += _type_changes(name, was, now)
            except RecursionError:
                # Schemas nested (not referenced) deeper than Python's stack.
                raise ValueError(f"the schema of {name} is nested too deeply to compare") from None
    return sorted(changes)


def _types(catalog: Mapping[str, Any], side: str) -> dict[str, Mapping[str, Any]]:
    if catalog.get("format", FORMAT) != FORMAT or not isinstance(catalog.get("types"), list):
        raise ValueError(f"the {side} catalog is not an export of {FORMAT}")
    return {str(t["name"]): t for t in catalog["types"]}


def _deprecated(entry: Mapping[str, Any]) -> bool:
    return entry.get("deprecated") is True


def _removed(name: str, was: Mapping[str, Any]) -> Change:
    if _deprecated(was):
        return Change(name, "", "type-removed", "safe", "deprecated type removed")
    detail = "type removed (consumers stop receiving it; deprecate first)"
    return Change(name, "", "type-removed", "breaking", detail)


def _type_changes(name: str, was: Mapping[str, Any], now: Mapping[str, Any]) -> list[Change]:
    found = [*_lifecycle(was, now), *_destinations(was, now), *_key(was, now), *_labels(was, now)]
    for key in ("description", "examples"):
        if canon(was.get(key)) != canon(now.get(key)):
            found.append(Finding(key, "annotation", "safe", f"{key} changed"))
    found += schema_changes(was, now)
    return [Change(name, *f) for f in found]


def _labels(was: Mapping[str, Any], now: Mapping[str, Any]) -> list[Finding]:
    found = []
    before, after = was.get("content_type"), now.get("content_type")
    if before != after:
        detail = f"content type {canon(before)} → {canon(after)} (readers of it parse it so)"
        found.append(Finding("content_type", "content-type-changed", "breaking", detail))
    if canon(was.get("version")) != canon(now.get("version")):
        detail = f"version {canon(was.get('version'))} → {canon(now.get('version'))}"
        found.append(Finding("version", "version-changed", "safe", detail))
    return found


def _lifecycle(was: Mapping[str, Any], now: Mapping[str, Any]) -> list[Finding]:
    if _deprecated(now) and not _deprecated(was):
        return [Finding("", "type-deprecated", "safe", "type deprecated")]
    if _deprecated(was) and not _deprecated(now):
        return [Finding("", "type-undeprecated", "safe", "type no longer deprecated")]
    return []


def _destinations(was: Mapping[str, Any], now: Mapping[str, Any]) -> list[Finding]:
    before, after = set(was.get("destinations", ())), set(now.get("destinations", ()))
    found = [
        Finding("destinations", "destination-added", "safe", f"now also sent to {d}")
        for d in sorted(after - before)
    ]
    for dropped in sorted(before - after):
        if _deprecated(was):
            detail = f"deprecated type no longer sent to {dropped}"
            found.append(Finding("destinations", "destination-dropped", "safe", detail))
        else:
            detail = f"no longer sent to {dropped} (its consumers stop receiving it)"
            found.append(Finding("destinations", "destination-dropped", "breaking", detail))
    return found


def _key(was: Mapping[str, Any], now: Mapping[str, Any]) -> list[Finding]:
    before, after = was.get("key"), now.get("key")
    if before == after:
        return []
    if before is None:
        return [
            Finding(
                "key", "key-required", "breaking", "a key is now required (old events have none)"
            )
        ]
    if after is None:
        detail = "a key is no longer required (new events may have none)"
        return [Finding("key", "key-dropped", "breaking", detail)]
    return [Finding("key", "key-described", "safe", "key description changed")]
