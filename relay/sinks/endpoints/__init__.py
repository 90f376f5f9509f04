"""The endpoints sink: each event of an ``endpoints`` destination fans out, after its commit,
into one delivery per matching endpoint registered at runtime (outbox.endpoints), and each
delivery is POSTed, signed with its endpoint's secret, retried and logged on its own.

It shares the ``[webhooks]`` HTTP client settings with the webhook sink."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relay.obs import scrub
from relay.sinks import Sink, SinkKind
from relay.sinks.endpoints.config import EndpointsDestination
from relay.sinks.webhook.config import WebhookClientSettings


def _build(section: WebhookClientSettings, destinations: Mapping[str, Any]) -> Sink:
    from relay.sinks.endpoints.sink import EndpointsSink  # the HTTP client only where used

    return EndpointsSink(section, destinations)


def _secrets(section: WebhookClientSettings, destinations: Mapping[str, Any]) -> set[str]:
    found: set[str] = set()
    for d in destinations.values():
        found |= scrub.config_secrets({"headers": d.headers})
    return found


def _check() -> None:
    """The secrets' key and requirement (OUTBOX_ENDPOINT_SECRET_KEY / _REQUIRE, shared with
    the applications) are part of the configuration: a bad one stops `run --check` and `run`
    as a bad setting does."""
    from relay.sinks.endpoints.at_rest import secret_box

    secret_box()


KIND = SinkKind(
    name="endpoints",
    destination=EndpointsDestination,
    section="webhooks",
    settings=WebhookClientSettings,
    build=_build,
    secrets=_secrets,
    check=_check,
)
