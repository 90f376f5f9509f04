"""Typed relay configuration: a TOML file, with every key also settable from the environment.

Environment variables override the file: ``OUTBOX_DATABASE_URL``, then one ``_`` between a
section and its key, e.g. ``OUTBOX_RELAY_BATCH_SIZE=500``, ``OUTBOX_KAFKA_BOOTSTRAP_SERVERS=…``.
``OUTBOX_DESTINATIONS`` takes a JSON object. Everything is validated at start-up; a bad value
raises :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import os
import socket
import tomllib
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from outbox.dburl import to_asyncpg_dsn
from relay.durations import parse_duration


class ConfigError(Exception):
    """The configuration cannot be used; the message names every bad key."""


# Seconds, or a string such as "90s", "15m", "1h", "7d", "1h30m" (see relay.durations).
Duration = Annotated[float, BeforeValidator(parse_duration)]

# Delivered rows are kept this long by default: long enough to answer "was event 123
# delivered, and when?" (`outbox-relay show 123`) during an incident, short enough that even
# 1,000 events/s keep the table to a few million small rows. Set 0 for the fastest relay.
DEFAULT_RETENTION = 3600.0


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Backoff(_Section):
    """Delay before retry ``n`` (1-based): ``min(max, base * factor**(n-1))``, ± ``jitter``.

    ``schedule`` (seconds), when set, replaces the formula: retry ``n`` waits ``schedule[n-1]``
    and later retries repeat its last entry.
    """

    base: float = Field(1.0, gt=0, description="seconds before the first retry")
    factor: float = Field(2.0, ge=1)
    max: float = Field(600.0, gt=0, description="cap on one delay, seconds")
    jitter: float = Field(0.2, ge=0, le=1, description="fraction of the delay, random ±")
    schedule: list[Annotated[float, Field(ge=0)]] | None = None


class RelaySettings(_Section):
    schema_: str = Field("public", alias="schema", min_length=1)
    relay_id: str | None = Field(None, description="defaults to host-pid-random")
    batch_size: int = Field(500, ge=1, le=10_000, description="rows per claim")
    max_in_flight: int = Field(
        2000, ge=1, le=100_000, description="rows claimed and not yet recorded, at most"
    )
    lease: float = Field(30.0, ge=1, description="seconds a claim is held without heartbeat")
    poll_interval: float = Field(
        1.0, gt=0, le=300, description="seconds between polls when no NOTIFY arrives"
    )
    shutdown_timeout: float = Field(20.0, ge=0, description="seconds to drain on SIGTERM")
    max_attempts: int = Field(25, ge=1, description="attempts before a row is failed (dead)")
    backoff: Backoff = Backoff()
    unknown_destinations: Literal["wait", "fail"] = Field(
        "wait",
        description="rows naming a destination this relay does not know: leave them pending "
        "(reported) or mark them failed",
    )
    report_interval: float = Field(
        30.0, gt=0, description="seconds between checks for rows of unknown destinations"
    )
    pool_size: int = Field(4, ge=2, le=64, description="database connections (plus LISTEN)")
    startup_timeout: float = Field(
        60.0, ge=0, description="seconds to keep retrying an unreachable database at start-up"
    )

    retention: Duration = Field(
        DEFAULT_RETENTION,
        ge=0,
        description="how long delivered rows are kept; 0 deletes them as they are recorded",
    )
    retention_interval: Duration = Field(
        60.0, gt=0, description="seconds between retention runs (one relay at a time)"
    )
    retention_batch_size: int = Field(
        1000, ge=1, le=100_000, description="delivered rows deleted per statement"
    )
    stats_interval: Duration = Field(
        15.0, gt=0, description="seconds between pending-row gauge queries"
    )

    @property
    def db_schema(self) -> str:
        return self.schema_

    @model_validator(mode="after")
    def _capacity_fits_batch(self) -> RelaySettings:
        if self.max_in_flight < self.batch_size:
            raise ValueError(
                f"max_in_flight ({self.max_in_flight}) must be >= batch_size ({self.batch_size})"
            )
        return self


class KafkaSettings(_Section):
    bootstrap_servers: str | list[str] = "localhost:9092"
    client_id: str = "outbox-relay"
    acks: Literal["all", 0, 1, -1] = "all"
    enable_idempotence: bool = True
    compression_type: Literal["gzip", "snappy", "lz4", "zstd"] | None = None
    linger_ms: int = Field(0, ge=0, description="keep 0: the relay already sends in batches")
    max_batch_size: int = Field(262_144, ge=1024, description="producer batch bytes")
    max_request_size: int = Field(1_048_576, ge=1024, description="largest message, bytes")
    request_timeout_ms: int = Field(30_000, ge=1000)
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: SecretStr | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    @model_validator(mode="after")
    def _idempotence_needs_acks_all(self) -> KafkaSettings:
        if self.enable_idempotence and self.acks not in ("all", -1):
            raise ValueError("enable_idempotence = true needs acks = 'all'")
        return self


class KafkaDestination(_Section):
    kind: Literal["kafka"]
    topic: str = Field(min_length=1, max_length=249, pattern=r"^[A-Za-z0-9._-]+$")
    max_attempts: int | None = Field(None, ge=1, description="overrides relay.max_attempts")
    backoff: Backoff | None = None


Destination = Annotated[KafkaDestination, Field(discriminator="kind")]


class HttpSettings(_Section):
    """The relay's own HTTP listener: /metrics, /healthz, /readyz."""

    enabled: bool = True
    host: str = Field("0.0.0.0", min_length=1, description="address to listen on")  # noqa: S104
    port: int = Field(9090, ge=0, le=65535, description="0 picks a free port (tests)")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="OUTBOX_",
        env_nested_delimiter="_",
        env_nested_max_split=1,
        extra="forbid",
        frozen=True,
    )

    database_url: SecretStr
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
    relay: RelaySettings = RelaySettings()
    kafka: KafkaSettings = KafkaSettings()
    http: HttpSettings = HttpSettings()
    destinations: dict[str, Destination] = Field(default_factory=dict)

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
        return (env_settings, init_settings)

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

    @property
    def dsn(self) -> str:
        return to_asyncpg_dsn(self.database_url.get_secret_value())

    def relay_id(self) -> str:
        return self.relay.relay_id or default_relay_id()

    def max_attempts(self, destination: str) -> int:
        d = self.destinations[destination]
        return d.max_attempts or self.relay.max_attempts

    def backoff(self, destination: str) -> Backoff:
        d = self.destinations[destination]
        return d.backoff or self.relay.backoff


def default_relay_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
        loc = loc.replace("schema_", "schema") or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check its spelling and section)"
        elif err["type"] == "missing":
            msg = "required"
            if loc == "database_url":
                msg += " (set database_url in the file or OUTBOX_DATABASE_URL)"
        got = err.get("input")
        shown = (
            ""
            if err["type"] in ("missing", "extra_forbidden") or isinstance(got, dict)
            else (f" (got {got!r})")
        )
        if "url" in loc or "password" in loc or "secret" in loc:
            shown = ""
        lines.append(f"  {loc}: {msg}{shown}")
    return "\n".join(lines)


def load_settings(path: Path | str | None = None, **overrides: Any) -> Settings:
    """Read ``path`` (TOML) if given, apply environment overrides, validate."""
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
    try:
        return Settings(**data)
    except ValidationError as exc:
        where = f" in {path}" if path else ""
        raise ConfigError(f"invalid configuration{where}:\n{_format_errors(exc)}") from exc
