"""The kinds of sink the relay knows: adding one is a package under relay/sinks/ and a line
here (see docs/architecture.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relay.sinks import Sink, SinkKind, kafka, webhook

if TYPE_CHECKING:
    from relay.config.settings import Settings

KINDS: dict[str, SinkKind] = {k.name: k for k in (kafka.KIND, webhook.KIND)}


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
