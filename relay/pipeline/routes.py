"""Where each destination's rows go, and the rules they go by.

A :class:`Route` is read once at start-up from the settings (a destination's own
``ordering``, ``poison_policy``, ``max_attempts`` and ``backoff``, or the relay's) and the sink
built for it, so that the claim, delivery and reaping code ask one object instead of
re-reading the configuration per row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from relay.config import Backoff, Settings
from relay.sinks import Sink
from relay.sinks.registry import KINDS


@dataclass(frozen=True, slots=True)
class Route:
    name: str
    sink: Sink
    ordered: bool  # ordering = "key": one row of a key at a time, in id order
    parks_poison: bool  # poison_policy = "park": a failed head is set aside, its key moves on
    max_attempts: int
    backoff: Backoff

    @property
    def blocks_keys(self) -> bool:
        """A failed row holds up the rest of its key until retried or skipped."""
        return self.ordered and not self.parks_poison


def build_sinks(settings: Settings) -> dict[str, Sink]:
    """The sink of each configured destination: one sink per kind, shared by that kind's
    destinations (one Kafka producer, one HTTP client per relay)."""
    sinks: dict[str, Sink] = {}
    for kind in KINDS.values():
        mine = {n: d for n, d in settings.destinations.items() if d.kind == kind.name}
        if mine:
            section = settings.section(kind.section) if kind.section else None
            sink = kind.build(section, mine)
            sinks.update(dict.fromkeys(mine, sink))
    return sinks


def build_routes(settings: Settings, sinks: Mapping[str, Sink]) -> dict[str, Route]:
    """The route of every destination this relay delivers (those it has a sink for)."""
    rs = settings.relay
    routes = {}
    for name, sink in sinks.items():
        d = settings.destinations.get(name)
        routes[name] = Route(
            name=name,
            sink=sink,
            ordered=d is not None and d.ordering == "key",
            parks_poison=d is not None and d.poison_policy == "park",
            max_attempts=(d.max_attempts if d is not None else None) or rs.max_attempts,
            backoff=(d.backoff if d is not None else None) or rs.backoff,
        )
    return routes


def attempt_limits(settings: Settings) -> dict[str, int]:
    """max_attempts of every configured destination (the reaper counts a lost claim as an
    attempt, and gives up on the row at its destination's limit)."""
    rs = settings.relay
    return {n: d.max_attempts or rs.max_attempts for n, d in settings.destinations.items()}
