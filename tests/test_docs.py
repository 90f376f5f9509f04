"""The README's configuration reference covers every setting the relay accepts."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from relay.config import (
    Backoff,
    Circuit,
    HttpSettings,
    KafkaDestination,
    KafkaSettings,
    RelaySettings,
    Settings,
    WebhookClientSettings,
    WebhookDestination,
)

README = (Path(__file__).parent.parent / "README.md").read_text()


def keys(model: type[BaseModel], prefix: str) -> list[str]:
    return [f"{prefix}{f.alias or name}" for name, f in model.model_fields.items()]


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
    missing = [k for k in expected if f"`{k}`" not in README and k != "destinations"]
    # Keys documented together on one row (ssl files) count once.
    missing = [k for k in missing if not any(k in line for line in README.splitlines())]
    assert not missing, f"README configuration reference lacks: {missing}"


def test_readme_names_the_two_commands_and_ci_runs_the_test_one() -> None:
    assert "./scripts/demo" in README and "./scripts/test" in README
    ci = (Path(__file__).parent.parent / ".ci" / "run").read_text()
    assert "./scripts/test" in ci
