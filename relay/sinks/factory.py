"""Which sink delivers which destination."""

from __future__ import annotations

from relay.config import KafkaDestination, Settings, WebhookDestination
from relay.sinks import Sink
from relay.sinks.kafka import KafkaSink
from relay.sinks.webhook import WebhookSink


def build_sinks(settings: Settings) -> dict[str, Sink]:
    """Map every configured destination name to the sink instance that delivers it.

    One sink instance per kind is shared by its destinations (one Kafka producer, one HTTP
    client per relay).
    """
    kafka = {n: d for n, d in settings.destinations.items() if isinstance(d, KafkaDestination)}
    webhooks = {n: d for n, d in settings.destinations.items() if isinstance(d, WebhookDestination)}
    routes: dict[str, Sink] = {}
    if kafka:
        sink = KafkaSink(settings.kafka, kafka)
        routes.update(dict.fromkeys(kafka, sink))
    if webhooks:
        hooks = WebhookSink(settings.webhooks, webhooks)
        routes.update(dict.fromkeys(webhooks, hooks))
    return routes
