"""Routes and sinks as built from the settings: pure, no database or broker (the relay's use
of them is in tests/test_routes.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from relay.config import Backoff, Settings
from relay.pipeline import routes as routes_module
from relay.pipeline.routes import Route, attempt_limits, build_routes, build_sinks
from relay.settings import load_settings
from relay.sinks import Sink, SinkKind
from relay.sinks.kafka.config import KafkaDestination
from relay.sinks.kafka.sink import KafkaSink
from relay.sinks.webhook.sink import WebhookSink
from tests.support.sinks import MemorySink
from tests.webhook_helpers import new_secret

RELAY = {"max_attempts": 7, "backoff": {"base": 4}}
DESTINATIONS: dict[str, Any] = {
    "plain": {"kind": "kafka", "topic": "plain"},
    "ordered": {
        "kind": "kafka",
        "topic": "ordered",
        "ordering": "key",
        "poison_policy": "park",
        "max_attempts": 3,
        "backoff": {"schedule": [1, 2]},
    },
    "blocking": {"kind": "kafka", "topic": "blocking", "ordering": "key"},
    "hook": {"kind": "webhook", "url": "https://hooks.example/in", "secrets": [new_secret()]},
}


def configured(destinations: Mapping[str, Any] = DESTINATIONS) -> Settings:
    return load_settings(
        None, database_url="postgresql://x@127.0.0.1/db", relay=RELAY, destinations=destinations
    )


def test_each_route_holds_its_destination_s_rules_or_the_relay_s() -> None:
    s = configured()
    sink = MemorySink()
    routes = build_routes(s, dict.fromkeys(["plain", "ordered", "blocking"], sink))
    relay_backoff = Backoff(base=4)
    assert s.relay.backoff == relay_backoff
    assert routes == {
        "plain": Route("plain", sink, False, False, 7, relay_backoff),
        "ordered": Route("ordered", sink, True, True, 3, Backoff(schedule=[1, 2])),
        "blocking": Route("blocking", sink, True, False, 7, relay_backoff),
    }
    assert [r.blocks_keys for r in routes.values()] == [False, False, True]


def test_only_destinations_with_a_sink_have_a_route() -> None:
    s = configured()
    sink = MemorySink()
    assert list(build_routes(s, {"ordered": sink})) == ["ordered"]
    assert build_routes(s, {}) == {}


def test_a_sink_for_an_unconfigured_destination_gets_the_relay_s_rules() -> None:
    """A relay given its sinks (tests, the bench) may deliver a destination the settings do
    not list: unordered, blocking nothing, with the relay's attempts and backoff."""
    s = configured()
    sink = MemorySink()
    assert build_routes(s, {"elsewhere": sink}) == {
        "elsewhere": Route("elsewhere", sink, False, False, 7, Backoff(base=4))
    }


def test_attempt_limits_of_every_configured_destination() -> None:
    # The webhook destination has its own default (see WebhookDestination).
    assert attempt_limits(configured()) == {"plain": 7, "ordered": 3, "blocking": 7, "hook": 10}
    assert attempt_limits(configured({})) == {}


def test_one_sink_per_kind_shared_by_its_destinations() -> None:
    s = configured()
    sinks = build_sinks(s)
    assert list(sinks) == ["plain", "ordered", "blocking", "hook"]
    assert isinstance(sinks["plain"], KafkaSink) and isinstance(sinks["hook"], WebhookSink)
    assert sinks["plain"] is sinks["ordered"] is sinks["blocking"]
    kafka_only = build_sinks(configured({"plain": DESTINATIONS["plain"]}))
    assert list(kafka_only) == ["plain"] and isinstance(kafka_only["plain"], KafkaSink)
    assert build_sinks(configured({})) == {}


def test_a_kind_without_a_section_is_built_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """SinkKind.section is optional: such a kind's build is handed None, not a section."""
    built: list[tuple[object, dict[str, Any]]] = []
    sink = MemorySink()

    def build(section: object, destinations: Mapping[str, Any]) -> Sink:
        built.append((section, dict(destinations)))
        return sink

    kind = SinkKind(name="kafka", destination=KafkaDestination, build=build)
    monkeypatch.setattr(routes_module, "KINDS", {"kafka": kind})
    s = configured({"plain": DESTINATIONS["plain"]})
    assert build_sinks(s) == {"plain": sink}
    assert built == [(None, {"plain": s.destinations["plain"]})]
