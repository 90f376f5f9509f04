"""The relay's configuration: typed, validated at start-up, from a TOML file and OUTBOX_*
variables. ``settings`` holds the relay's own settings and the loading; ``base`` what every
part builds on; ``errors`` and ``environment`` the messages and the variables; each kind of
sink owns its settings in ``relay/sinks/<kind>/config.py``."""

from relay.config.base import MAX_SECONDS, Backoff, ConfigError, Delivery, Duration, Section
from relay.config.environment import schema_from_environment, unknown_environment
from relay.config.settings import (
    HttpSettings,
    RelaySettings,
    Settings,
    load_settings,
    named_variables,
    settings_model,
    settings_secrets,
    top_level_keys,
)

__all__ = [
    "MAX_SECONDS",
    "Backoff",
    "ConfigError",
    "Delivery",
    "Duration",
    "HttpSettings",
    "RelaySettings",
    "Section",
    "Settings",
    "load_settings",
    "named_variables",
    "schema_from_environment",
    "settings_model",
    "settings_secrets",
    "top_level_keys",
    "unknown_environment",
]
