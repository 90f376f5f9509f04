"""What ``outbox-relay catalog check`` says of a catalog on its own, beside a relay's
configuration: the problems a consumer or the relay would meet, before any release compares."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from relay.cloudevents import type_problem

if TYPE_CHECKING:
    from relay.config.settings import Settings

Level = Literal["error", "warning"]


def problems(catalog: Mapping[str, Any], settings: Settings | None) -> list[tuple[Level, str]]:
    """``(level, message)`` per problem of the exported ``catalog``: errors for a type carried
    by a destination ``settings`` does not have, or named so that CloudEvents refuses it on a
    destination with the envelope; a warning for a destination carrying several types with no
    envelope (no header tells them apart). Without ``settings``, none of these is known."""
    out: list[tuple[Level, str]] = []
    if settings is None:
        return out
    carried: dict[str, list[str]] = {}
    for t in catalog["types"]:
        for name in t["destinations"]:
            dest = settings.destinations.get(name)
            if dest is None:
                known = ", ".join(sorted(settings.destinations)) or "none"
                out.append(
                    (
                        "error",
                        f"{t['name']}: destination {name!r} is not configured "
                        f"(configured: {known}); add it or drop it from the type",
                    )
                )
                continue
            carried.setdefault(name, []).append(t["name"])
            why = type_problem(t["name"]) if dest.envelope == "cloudevents" else None
            if why is not None:
                out.append(("error", f"{t['name']}: as a CloudEvents type on {name!r} it {why}"))
    for name, types in sorted(carried.items()):
        if len(types) > 1 and settings.destinations[name].envelope == "none":
            out.append(
                (
                    "warning",
                    f"destination {name!r} carries {len(types)} types ({', '.join(types)}) "
                    'and no header names the type: consider envelope = "cloudevents" (ce-type)',
                )
            )
    return out


def type_warnings(
    catalog: Mapping[str, Any], destination: str | None, event_types: tuple[str, ...]
) -> list[str]:
    """What to tell an operator registering an endpoint for ``event_types`` of
    ``destination`` (None: any): a type the catalog does not declare (with the closest name it
    does), declared for other destinations only, or deprecated. Warnings, never refusals: an
    endpoint may be registered ahead of the release that declares its type."""
    from difflib import get_close_matches

    declared = {t["name"]: t for t in catalog["types"]}
    out = []
    for name in event_types:
        t = declared.get(name)
        if t is None:
            close = get_close_matches(name, list(declared), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            out.append(f"event type {name!r} is not in the catalog{hint}")
        elif destination is not None and destination not in t["destinations"]:
            where = ", ".join(t["destinations"])
            out.append(f"event type {name!r} is declared for {where}, not for {destination!r}")
        elif t.get("deprecated"):
            out.append(f"event type {name!r} is deprecated")
    return out
