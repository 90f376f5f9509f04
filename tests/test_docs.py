"""The README's configuration reference covers every setting the relay accepts."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from relay.config import Backoff, HttpSettings, RelaySettings, Settings
from relay.sinks.kafka.config import KafkaDestination, KafkaSettings
from relay.sinks.webhook.config import Circuit, WebhookClientSettings, WebhookDestination

README = (Path(__file__).parent.parent / "README.md").read_text()


def keys(model: type[BaseModel], prefix: str) -> list[str]:
    """The settings of ``model``: its fields, without the sections (tables) it contains,
    which are checked key by key on their own."""
    out = []
    for name, f in model.model_fields.items():
        kind = f.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            continue  # a section such as relay.backoff
        if name == "destinations":
            continue  # a table of destinations, each documented key by key
        out.append(f"{prefix}{f.alias or name}")
    return out


def test_every_setting_is_documented() -> None:
    expected = (
        keys(Settings, "")
        + keys(RelaySettings, "relay.")
        + keys(Backoff, "relay.backoff.")
        + keys(KafkaSettings, "kafka.")
        + keys(HttpSettings, "http.")
        + keys(KafkaDestination, "destinations.NAME.")
        + keys(WebhookDestination, "destinations.NAME.")
        + keys(Circuit, "destinations.NAME.circuit.")
        + keys(WebhookClientSettings, "webhooks.")
    )
    assert "relay.lease" in expected and "relay.backoff" not in expected
    # Each key in backticks, as the reference tables write them: a key that merely appears
    # inside another word or sentence does not count.
    missing = [k for k in expected if f"`{k}`" not in README]
    assert not missing, f"README configuration reference lacks: {missing}"


def test_readme_names_the_two_commands_and_ci_runs_the_test_one() -> None:
    assert "./scripts/demo" in README and "./scripts/test" in README
    ci = (Path(__file__).parent.parent / ".ci" / "run").read_text()
    assert "./scripts/test" in ci
