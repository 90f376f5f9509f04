"""Typed relay configuration: a TOML file, with every key also settable from the environment.

Environment variables override the file: ``OUTBOX_DATABASE_URL``, then one ``_`` between a
section and its key, e.g. ``OUTBOX_RELAY_BATCH_SIZE=500``, ``OUTBOX_KAFKA_BOOTSTRAP_SERVERS=…``.
``OUTBOX_DESTINATIONS`` takes a JSON object. Everything is validated at start-up; a bad value
raises :class:`ConfigError` naming the key.

:class:`Settings` holds what the relay itself takes; the kinds of sink add their own sections
(``[kafka]``, ``[webhooks]``) and destination models to the model that validates a
configuration: relay/settings.py assembles it (the sinks build on this package, so it cannot
know them) and loads a configuration with it.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any, Literal

from pydantic import (
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from outbox.dburl import to_asyncpg_dsn
from outbox.queries import check_schema
from relay.config.base import (
    DEFAULT_SNAPSHOT_WARNING,
    MAX_SECONDS,
    Backoff,
    DestinationSettings,
    Duration,
    Section,
)
from relay.config.catalog import CatalogSettings
from relay.config.environment import OurEnvironment
from relay.config.portal import PortalSettings

# Delivered rows are kept this long by default: long enough to answer "was event 123
# delivered, and when?" (`outbox-relay show 123`) during an incident, short enough that even
# 1,000 events/s keep the table to a few million small rows. Set 0 for the fastest relay.
DEFAULT_RETENTION = 3600.0
# The message log of endpoints destinations (deliveries, attempts) is kept this long by
# default: receivers ask "what did you send me last week?", and webhook services keep 30-90
# days. A delivery and its attempt cost about 0.5 KB (docs/endpoints.md).
DEFAULT_MESSAGE_LOG_RETENTION = 30 * 86400.0


class RelaySettings(Section):
    """[relay]: the claim, the lease, retries, retention, start-up and shutdown."""

    schema_: str = Field(
        "public",
        alias="schema",
        min_length=1,
        description=(
            "schema of the outbox table; `OUTBOX_SCHEMA` is the one schema variable of every "
            "command and of the relay (`OUTBOX_RELAY_SCHEMA` still works, with a warning; the "
            "two must not name different schemas)"
        ),
    )
    relay_id: str | None = Field(None, description="defaults to host-pid-random")
    batch_size: int = Field(500, ge=1, le=10_000, description="rows per claim")
    max_in_flight: int = Field(
        2000, ge=1, le=100_000, description="rows claimed and not yet recorded, at most"
    )
    lease: float = Field(
        30.0, ge=1, le=86400, description="seconds a claim is held without heartbeat"
    )
    claims: Literal["auto", "row", "batch"] = Field(
        "auto",
        description="how unordered destinations' fresh rows are claimed: batch (one lease row "
        "per claim, the rows written once, by their outcome: half the dead row versions a held "
        "snapshot keeps, a quarter less database time per event; endpoints destinations claim "
        "by row), row (each row written running, then its outcome), or auto: batch, unless a "
        "relay running when this one starts claims one of its destinations by row (a relay of "
        "an earlier release does); every relay serving a destination must claim it the same "
        "way, see docs/deploying.md",
    )
    poll_interval: float = Field(
        1.0, ge=0.01, le=300, description="seconds between polls when no NOTIFY arrives"
    )
    shutdown_timeout: float = Field(20.0, ge=0, le=86400, description="seconds to drain on SIGTERM")
    max_attempts: int = Field(
        25, ge=1, le=10_000, description="attempts before a row is failed (dead)"
    )
    backoff: Backoff = Backoff()
    unknown_destinations: Literal["wait", "fail"] = Field(
        "wait",
        description="rows naming a destination this relay does not know: leave them pending "
        "(reported) or mark them failed",
    )
    unknown_grace: Duration = Field(
        300.0,
        ge=0,
        description='with unknown_destinations = "fail": how long a row of a destination no '
        "running relay serves waits before it is failed (time for such a relay to start)",
    )
    report_interval: float = Field(
        30.0,
        ge=0.05,
        le=86400,
        description="seconds between checks for rows of unknown destinations",
    )
    pool_size: int = Field(4, ge=2, le=64, description="database connections (plus LISTEN)")
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto",
        description="the event loop: uvloop where it is installed (auto), uvloop or refuse to "
        "start without it, or the standard library's",
    )
    startup_timeout: float = Field(
        60.0,
        ge=0,
        le=MAX_SECONDS,
        description="seconds to keep retrying an unreachable database at start-up",
    )

    retention: Duration = Field(
        DEFAULT_RETENTION,
        ge=0,
        description="how long delivered rows are kept; 0 deletes them as they are recorded",
    )
    message_log_retention: Duration = Field(
        DEFAULT_MESSAGE_LOG_RETENTION,
        ge=0,
        description="how long the message log of endpoints destinations is kept: their ended "
        "deliveries and attempts (what each endpoint was sent, when, and what it answered); "
        "independent of `retention`, which deletes the events and their payloads",
    )
    retention_interval: Duration = Field(
        60.0, ge=0.05, description="seconds between retention runs (one relay at a time)"
    )
    retention_batch_size: int = Field(
        1000, ge=1, le=100_000, description="delivered rows deleted per statement"
    )
    stats_interval: Duration = Field(
        15.0, ge=0.05, description="seconds between pending-row gauge queries"
    )
    snapshot_warning: Duration = Field(
        DEFAULT_SNAPSHOT_WARNING,
        ge=0,
        description="log relay.snapshot.held (and name it in `status` and the console) when "
        "a snapshot or transaction has held back VACUUM of the outbox longer than this; 0: "
        "never (the oldest_snapshot gauges are kept anyway)",
    )

    @property
    def db_schema(self) -> str:
        return self.schema_

    @field_validator("schema_")
    @classmethod
    def _schema_name(cls, v: str) -> str:
        return check_schema(v)

    @model_validator(mode="after")
    def _capacity_fits_batch(self) -> RelaySettings:
        if self.max_in_flight < self.batch_size:
            raise ValueError(
                f"max_in_flight ({self.max_in_flight}) must be >= batch_size ({self.batch_size})"
            )
        return self


class HttpSettings(Section):
    """The relay's own HTTP listener: /metrics, /healthz, /readyz."""

    enabled: bool = Field(
        True,
        description=(
            "serve `/metrics`, `/healthz`, `/readyz`; `false`: no listener (the relay works the "
            "same)"
        ),
    )
    host: str = Field("0.0.0.0", min_length=1, description="address to listen on")  # noqa: S104
    port: int = Field(9090, ge=0, le=65535, description="0 picks a free port (tests)")


class UiSettings(Section):
    """The operator console, served by the relay's listener at /ui (see docs/console.md)."""

    enabled: bool = Field(
        False, description="serve the console at `/ui` on the `[http]` listener (needs a token)"
    )
    read_only: bool = Field(False, description="show everything, refuse every action")
    token: SecretStr | None = Field(
        None,
        description="the token every request needs (at least 16 characters); usually set "
        "through OUTBOX_UI_TOKEN, never in a file others read",
    )
    token_file: str | None = Field(None, description="a file holding the token instead")
    operators: dict[str, SecretStr] | None = Field(
        None,
        description='a token per operator instead of one shared token, `{alice = "…"}`: each '
        "signs in with their own and is named in the log of every action; usually set through "
        'OUTBOX_UI_OPERATORS (a JSON object, `{"alice": "…"}`) or operators_file',
    )
    operators_file: str | None = Field(
        None, description='a TOML file of `name = "token"` lines instead of operators'
    )

    @field_validator("operators")
    @classmethod
    def _operators(cls, v: dict[str, SecretStr] | None) -> dict[str, SecretStr] | None:
        if v is not None:
            from relay.config.tokens import TokenError, check_operators

            try:
                check_operators({n: t.get_secret_value() for n, t in v.items()}, None)
            except TokenError as exc:
                raise ValueError(str(exc)) from None
        return v

    @model_validator(mode="after")
    def _token_when_enabled(self) -> UiSettings:
        named = self.operators is not None or self.operators_file is not None
        if self.operators is not None and self.operators_file is not None:
            raise ValueError("set operators or operators_file, not both")
        if named and (self.token is not None or self.token_file is not None):
            raise ValueError(
                "both a shared token (token, token_file or OUTBOX_UI_TOKEN) and operators are "
                "set: with operators, each signs in with their own token and the shared one "
                "would act without a name; remove the shared token"
            )
        # Inline operators are checked with their field; the files only where they are read.
        if self.enabled and self.operators is None:
            from relay.config.tokens import TokenError, load_operators, load_token

            if self.operators_file is not None:
                try:
                    load_operators(self.operators_file)
                except TokenError as exc:
                    raise ValueError(str(exc)) from None
            elif self.token is None:
                try:
                    load_token(self.token_file)
                except TokenError as exc:
                    raise ValueError(str(exc)) from None
            elif len(self.token.get_secret_value().strip()) < 16:
                raise ValueError("the console's token must have at least 16 characters")
        return self

    def the_token(self) -> str:
        from relay.config.tokens import load_token

        if self.token is not None:
            return self.token.get_secret_value().strip()
        return load_token(self.token_file)

    def credentials(self) -> tuple[str | None, dict[str, str] | None]:
        """What the console checks requests against: the shared token, or the operators and
        their tokens (``build_console(…, token, operators=…)``)."""
        if self.operators is not None:
            return None, {n: t.get_secret_value().strip() for n, t in self.operators.items()}
        if self.operators_file is not None:
            from relay.config.tokens import load_operators

            return None, load_operators(self.operators_file)
        return self.the_token(), None


class Settings(BaseSettings):
    """What the relay takes. The model :func:`load_settings` validates also has a section
    per kind of sink that has one (``kafka``, ``webhooks``: see :meth:`section`), and knows
    each kind's destinations."""

    model_config = SettingsConfigDict(
        env_prefix="OUTBOX_",
        env_nested_delimiter="_",
        env_nested_max_split=1,
        extra="forbid",
        frozen=True,
        allow_inf_nan=False,
    )

    database_url: SecretStr = Field(
        description="postgresql:// or postgresql+asyncpg:// URL; never logged"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="the least severe level that is logged"
    )
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="json, console, or auto (JSON unless stdout is a terminal)"
    )
    relay: RelaySettings = RelaySettings()
    http: HttpSettings = HttpSettings()
    ui: UiSettings = UiSettings()
    portal: PortalSettings = PortalSettings()
    catalog: CatalogSettings = CatalogSettings()
    destinations: dict[str, DestinationSettings] = Field(default_factory=dict)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file arrives as init arguments; the environment overrides it.
        return (OurEnvironment(settings_cls), init_settings)

    @field_validator("database_url")
    @classmethod
    def _postgres_url(cls, v: SecretStr) -> SecretStr:
        to_asyncpg_dsn(v.get_secret_value())  # raises ValueError naming the problem
        return v

    @field_validator("destinations")
    @classmethod
    def _names(cls, v: dict[str, Any]) -> dict[str, Any]:
        for name in v:
            if not name.strip():
                raise ValueError("destination names must be non-empty")
        return v

    @model_validator(mode="after")
    def _console_needs_listener(self) -> Settings:
        if self.ui.enabled and not self.http.enabled:
            raise ValueError(
                "ui.enabled = true serves the console on the [http] listener, which "
                "http.enabled = false turns off: enable both, or run `outbox-relay ui` apart"
            )
        return self

    @model_validator(mode="after")
    def _portal_has_destinations(self) -> Settings:
        if not self.portal.enabled:
            return self
        if not self.http.enabled:
            raise ValueError(
                "portal.enabled = true serves the portal on the [http] listener, which "
                "http.enabled = false turns off: enable both, or run `outbox-relay portal` apart"
            )
        offered = self.portal_destinations()
        if not offered:
            raise ValueError(
                "portal.enabled = true needs an endpoints destination ([destinations.NAME] "
                'kind = "endpoints") for tenants to add endpoints to'
            )
        return self

    def portal_destinations(self) -> tuple[str, ...]:
        """The endpoints destinations the portal offers (ValueError: one that is not)."""
        kinds = {name: getattr(d, "kind", None) for name, d in self.destinations.items()}
        named = self.portal.destinations or [n for n, k in kinds.items() if k == "endpoints"]
        for name in named:
            if kinds.get(name) != "endpoints":
                raise ValueError(
                    f"portal.destinations: {name!r} is not a destination of kind "
                    '"endpoints" in [destinations]'
                )
        return tuple(named)

    @property
    def dsn(self) -> str:
        return to_asyncpg_dsn(self.database_url.get_secret_value())

    def relay_id(self) -> str:
        return self.relay.relay_id or default_relay_id()

    def section(self, name: str) -> Any:
        """A kind of sink's section (``kafka``, ``webhooks``)."""
        return getattr(self, name)


def default_relay_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def named_variables(s: Settings) -> set[str]:
    """Environment variables the configuration names itself (a destination's secret_env)."""
    return {v for d in s.destinations.values() if (v := getattr(d, "secret_env", None))}
