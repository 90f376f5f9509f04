"""The webhook sink: each destination an HTTP endpoint, POSTed to and signed the Standard
Webhooks way, with its own concurrency limit and circuit breaker, through one SSRF-guarded
client. Its settings: ``[webhooks]`` (the client) and each destination's endpoint."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relay.obs import scrub
from relay.sinks import Sink, SinkKind
from relay.sinks.webhook.config import WebhookClientSettings, WebhookDestination


def _build(section: WebhookClientSettings, destinations: Mapping[str, Any]) -> Sink:
    from relay.sinks.webhook.sink import WebhookSink  # the HTTP client only where it is used

    return WebhookSink(section, destinations)


def _secrets(section: WebhookClientSettings, destinations: Mapping[str, Any]) -> set[str]:
    found: set[str] = set()
    for d in destinations.values():
        found.update(x.get_secret_value() for x in d.secrets)
        found |= scrub.config_secrets({"url": d.url, "headers": d.headers})
    return found


KIND = SinkKind(
    name="webhook",
    destination=WebhookDestination,
    section="webhooks",  # not "http": that is the relay's own metrics and probes listener
    settings=WebhookClientSettings,
    build=_build,
    secrets=_secrets,
)
