"""The whole configuration: the relay's own settings (relay/config) with each kind of sink's
section and destination model (relay/sinks/registry.py), and the loading of a TOML file and
OUTBOX_* variables into it. Above the sinks, which build their settings on relay.config."""

from __future__ import annotations

import functools
import os
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Union

from pydantic import BaseModel, Field, ValidationError, create_model
from pydantic_settings import SettingsError

from outbox.dburl import url_secrets
from relay.config.base import Backoff, ConfigError
from relay.config.environment import reading_environment, schema_from_environment
from relay.config.errors import echoable_fields, format_errors
from relay.config.settings import HttpSettings, RelaySettings, Settings
from relay.obs import scrub

if TYPE_CHECKING:
    from relay.sinks import SinkKind


def _kinds() -> list[SinkKind]:
    """The kinds of sink, imported when a configuration is first read, not with this module:
    their settings check what the Kafka client can do, and commands that only name their
    options (``--help``) must not load it."""
    from relay.sinks.registry import KINDS

    return list(KINDS.values())


@functools.cache
def settings_model() -> type[Settings]:
    """Settings with each kind of sink's section and destination model."""
    kinds = _kinds()
    destination: Any = Annotated[
        Union[tuple(k.destination for k in kinds)],  # noqa: UP007 - built from the registry
        Field(discriminator="kind"),
    ]
    sections: dict[str, Any] = {
        k.section: (k.settings, Field(default_factory=k.settings))
        for k in kinds
        if k.section and k.settings
    }
    return create_model(
        "Settings",
        __base__=Settings,
        destinations=(dict[str, destination], Field(default_factory=dict)),
        **sections,
    )


def all_models() -> list[type[BaseModel]]:
    """Every model of the configuration, the sinks' included."""
    models: list[type[BaseModel]] = [settings_model(), RelaySettings, Backoff, HttpSettings]
    for kind in _kinds():
        models.append(kind.destination)
        if kind.settings is not None:
            models.append(kind.settings)
            models += [
                f.annotation
                for f in kind.settings.model_fields.values()
                if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
            ]
        models += [
            f.annotation
            for f in kind.destination.model_fields.values()
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
        ]
    return models


@functools.cache
def _echoable() -> frozenset[str]:
    return echoable_fields(all_models())


def _explain(exc: ValidationError) -> str:
    return format_errors(exc, _echoable(), [k.name for k in _kinds()])


def top_level_keys() -> list[str]:
    return list(settings_model().model_fields)


def load_settings(
    path: Path | str | None = None, *, environment: bool = True, **overrides: Any
) -> Settings:
    """Read ``path`` (TOML) if given, apply environment overrides, validate. Without
    ``environment``, no OUTBOX_* variable is read: the file and ``overrides`` are the whole
    configuration (for a tool's relay of its own, like the demo's)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {p} does not exist") from exc
        except OSError as exc:
            raise ConfigError(f"config file {p} cannot be read: {exc}") from exc
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from exc
    data.update(overrides)
    schema = schema_from_environment() if environment else None
    if schema is not None and isinstance(data.get("relay", {}), dict):
        in_file = data.get("relay", {}).get("schema")
        if in_file is not None and in_file != schema:
            raise ConfigError(
                f"relay.schema{' in ' + str(path) if path else ''} ({in_file!r}) and the "
                f"environment's schema ({schema!r}, OUTBOX_SCHEMA) differ; set one"
            )
        data["relay"] = {**data.get("relay", {}), "schema": schema}
    # Found before validating, so that no error message can quote them. (Registering the
    # secrets of a loaded configuration, for the logs, is the relay process's business:
    # relay.cli does it, so that loading a configuration changes nothing global.)
    found = scrub.config_secrets(data) | scrub.environment_secrets(os.environ)
    where = f" in {path}" if path else ""
    # Settings(**data) also takes pydantic-settings' own arguments (_env_file, _secrets_dir,
    # …): a file must not reach them (`_env_file = "/etc/passwd"` would read that file).
    private = sorted(k for k in data if k.startswith("_"))
    if private:
        bad = "\n".join(f"  {k}: unknown key (check its spelling and section)" for k in private)
        raise ConfigError(scrub.hide(f"invalid configuration{where}:\n{bad}", found))
    return _validate(data, where, found, environment)


def _validate(data: dict[str, Any], where: str, found: set[str], environment: bool) -> Settings:
    reading = reading_environment.set(environment)
    try:
        return settings_model()(**data)
    except ValidationError as exc:
        message = f"invalid configuration{where}:\n{_explain(exc)}"
        raise ConfigError(scrub.hide(message, found)) from None
    except SettingsError as exc:
        # An OUTBOX_* variable that should hold JSON (OUTBOX_DESTINATIONS, …) does not parse.
        # Its text names the field, never the value.
        message = f"invalid configuration in the environment: {exc}"
        raise ConfigError(scrub.hide(message, found)) from None
    finally:
        reading_environment.reset(reading)


def settings_secrets(s: Settings) -> set[str]:
    """What the relay must never print: the database password, and what each kind of sink
    says (a SASL password, webhook secrets, configured header values; see relay.obs.scrub for
    the lengths scrubbed)."""
    found = set(url_secrets(s.database_url.get_secret_value()))
    if s.ui.token is not None:
        found.add(s.ui.token.get_secret_value())
    for token in (s.ui.operators or {}).values():
        found.add(token.get_secret_value())
    for kind in _kinds():
        mine = {n: d for n, d in s.destinations.items() if d.kind == kind.name}
        section = s.section(kind.section) if kind.section else None
        found |= kind.secrets(section, mine)
    return found
