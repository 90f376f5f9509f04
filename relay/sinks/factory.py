"""Which sink delivers which destination."""

from __future__ import annotations

from relay.config import KafkaDestination, Settings
from relay.sinks import Sink
from relay.sinks.kafka import KafkaSink


def build_sinks(settings: Settings) -> dict[str, Sink]:
    """Map every configured destination name to the sink instance that delivers it.

    One sink instance per kind is shared by its destinations (one Kafka producer per relay).
    """
    kafka = {n: d for n, d in settings.destinations.items() if isinstance(d, KafkaDestination)}
    routes: dict[str, Sink] = {}
    if kafka:
        sink = KafkaSink(settings.kafka, kafka)
        routes.update(dict.fromkeys(kafka, sink))
    return routes
