"""The relay's configuration: typed, validated at start-up, from a TOML file and OUTBOX_*
variables. ``settings`` holds the relay's own settings; ``base`` what every part builds on;
``errors`` and ``environment`` the messages and the variables; ``tokens`` the console's
tokens, checked with the rest at start-up; each kind of sink owns its
settings in ``relay/sinks/<kind>/config.py``, and relay/settings.py puts them together and
loads a configuration."""

from relay.config.base import (
    MAX_SECONDS,
    Backoff,
    ConfigError,
    DestinationSettings,
    Duration,
    Section,
)
from relay.config.environment import schema_from_environment, unknown_environment
from relay.config.settings import (
    HttpSettings,
    RelaySettings,
    Settings,
    named_variables,
)

__all__ = [
    "MAX_SECONDS",
    "Backoff",
    "ConfigError",
    "DestinationSettings",
    "Duration",
    "HttpSettings",
    "RelaySettings",
    "Section",
    "Settings",
    "named_variables",
    "schema_from_environment",
    "unknown_environment",
]
