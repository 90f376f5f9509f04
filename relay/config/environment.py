"""The configuration's environment: the variables that are settings, those that are not
(Kubernetes' service links, the command line's own), and the one schema variable."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping
from contextvars import ContextVar

from pydantic_settings import EnvSettingsSource

from outbox.endpoint_secrets import KEY_VARIABLE, REQUIRE_VARIABLE
from outbox.logs import early_logger
from relay.config.base import ConfigError

# Variables Kubernetes adds for every Service in the namespace: a Service named outbox-relay
# gives OUTBOX_RELAY_PORT=tcp://10.0.0.7:9090, OUTBOX_RELAY_SERVICE_HOST=…, which would read as
# settings (relay.port: unknown key) and stop the relay.
_LINK_NAME = re.compile(r"_SERVICE_(HOST|PORT)|_PORT_\d+_(TCP|UDP|SCTP)")
_LINK_VALUE = re.compile(r"^(tcp|udp|sctp)://", re.I)


def is_service_link(name: str, value: str | None) -> bool:
    if _LINK_NAME.search(name):
        return True
    # OUTBOX_HTTP_PORT is a setting too: a link only when it holds what Kubernetes puts.
    return name.endswith("_PORT") and bool(value and _LINK_VALUE.match(value.strip()))


# Whether a configuration being loaded reads OUTBOX_* variables at all (load_settings'
# ``environment``). A tool that builds the whole configuration of a relay of its own (the demo)
# reads none: the variables of the shell it runs in name that shell's application's database and
# broker, and they override what a configuration says.
reading_environment: ContextVar[bool] = ContextVar("reading_environment", default=True)


class OurEnvironment(EnvSettingsSource):
    """The environment, without Kubernetes' service-link variables."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        if not reading_environment.get():
            return {}
        env = super()._load_env_vars()
        return {k: v for k, v in env.items() if not is_service_link(k.upper(), v)}


# OUTBOX_* variables that are not settings of `run` but are read by the command line (and
# the test suite's report file).
COMMAND_VARIABLES = frozenset({"OUTBOX_CONFIG", "OUTBOX_SCHEMA", "OUTBOX_FAULT_REPORT"})

# Read by outbox.endpoint_secrets, in the relay (the endpoints sink opens the secrets) as in
# every application and command that writes them: one value for all, so not a relay setting.
LIBRARY_VARIABLES = frozenset({KEY_VARIABLE, REQUIRE_VARIABLE})


SCHEMA_VARIABLE = "OUTBOX_SCHEMA"
DEPRECATED_SCHEMA_VARIABLE = "OUTBOX_RELAY_SCHEMA"

# Whether reading the schema logs the deprecation of OUTBOX_RELAY_SCHEMA as a structlog event,
# the relay's way. The commands print it on stderr instead (relay.cli.options) and set this to
# False while they read the schema or load a configuration.
log_schema_deprecation: ContextVar[bool] = ContextVar("log_schema_deprecation", default=True)

# Whether the configuration is being read to document it (`outbox-relay catalog asyncapi`,
# `catalog check`), not to run it: in CI, beside no database, with no webhook secret in the
# environment. A `secret_env` that is not set then stands for a placeholder secret; nothing of
# it reaches the document, and nothing else is relaxed.
documenting: ContextVar[bool] = ContextVar("documenting", default=False)

# The placeholder: a well-formed whsec_ secret of zero bytes that signs nothing anyone uses.
PLACEHOLDER_SECRET = "whsec_" + "A" * 43 + "="


def schema_deprecation(environ: Mapping[str, str] | None = None) -> str | None:
    """What to tell someone who set OUTBOX_RELAY_SCHEMA (still read, for now), or None."""
    env = os.environ if environ is None else environ
    if env.get(DEPRECATED_SCHEMA_VARIABLE) is None:
        return None
    return (
        f"{DEPRECATED_SCHEMA_VARIABLE} is deprecated and will stop working in a future "
        f"release: set {SCHEMA_VARIABLE} instead (the one schema variable of `run` and every "
        "command)"
    )


def schema_from_environment(environ: Mapping[str, str] | None = None) -> str | None:
    """The schema the environment names: OUTBOX_SCHEMA, which every command reads (the ops
    commands' --schema, `run`'s relay.schema), or its deprecated spelling OUTBOX_RELAY_SCHEMA
    (logged as the warning event ``relay.config.deprecated_variable``, see
    ``log_schema_deprecation``). Both set to different schemas is an error, not a silent
    choice."""
    env = os.environ if environ is None else environ
    plain, nested = env.get(SCHEMA_VARIABLE), env.get(DEPRECATED_SCHEMA_VARIABLE)
    if plain is not None and nested is not None and plain != nested:
        raise ConfigError(
            f"OUTBOX_SCHEMA ({plain!r}) and OUTBOX_RELAY_SCHEMA ({nested!r}) name different "
            "schemas; set only OUTBOX_SCHEMA"
        )
    if nested is not None and log_schema_deprecation.get():
        _log_deprecation(DEPRECATED_SCHEMA_VARIABLE, SCHEMA_VARIABLE)
    return plain if plain is not None else nested


def _log_deprecation(variable: str, use: str) -> None:
    # The relay reads its configuration before it sets up its logs: until then the event goes
    # to stderr, so that stdout stays the relay's log stream (or `run --check`'s answer).
    early_logger("relay").warning(
        "relay.config.deprecated_variable",
        variable=variable,
        use=use,
        action=f"rename {variable} to {use}; it will stop working in a future release",
    )


def unknown_environment(
    known: Iterable[str], named: Iterable[str] = (), environ: Mapping[str, str] | None = None
) -> list[str]:
    """OUTBOX_* variables that no setting (``known``: the top-level keys) or command reads,
    each with a suggestion when one is close: a typo there is otherwise silently ignored. (A
    wrong key inside a section, like OUTBOX_RELAY_BATCHSIZE, is already an error.) Variables
    the configuration names itself (``named``: a destination's secret_env) and Kubernetes'
    service links are not reported."""
    env = os.environ if environ is None else environ
    known = {f"OUTBOX_{name.upper()}" for name in known}
    sections = [f"{k}_" for k in known if k != "OUTBOX_DATABASE_URL"]
    named = set(named)
    found = []
    for name in sorted(env):
        if not name.startswith("OUTBOX_") or name in known or name in COMMAND_VARIABLES:
            continue
        if name in LIBRARY_VARIABLES:
            continue
        if name in named or is_service_link(name, env[name]):
            continue
        if name.startswith("OUTBOX_TEST_") or any(name.startswith(p) for p in sections):
            continue
        close = difflib.get_close_matches(
            name, [*known, *COMMAND_VARIABLES, *LIBRARY_VARIABLES], n=1
        )
        found.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return found
