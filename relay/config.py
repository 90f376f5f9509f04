"""Typed relay configuration: a TOML file, with every key also settable from the environment.

Environment variables override the file: ``OUTBOX_DATABASE_URL``, then one ``_`` between a
section and its key, e.g. ``OUTBOX_RELAY_BATCH_SIZE=500``, ``OUTBOX_KAFKA_BOOTSTRAP_SERVERS=…``.
``OUTBOX_DESTINATIONS`` takes a JSON object. Everything is validated at start-up; a bad value
raises :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import difflib
import functools
import ipaddress
import os
import re
import socket
import tomllib
import uuid
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
from aiokafka.codec import has_lz4, has_snappy, has_zstd
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from outbox.dburl import to_asyncpg_dsn, url_secrets
from outbox.queries import check_schema
from relay import secrets
from relay.durations import parse_duration
from relay.signing import decode_secret


class ConfigError(Exception):
    """The configuration cannot be used; the message names every bad key."""


# The longest duration any setting takes: ten years. Every delay ends up in a PostgreSQL
# interval added to now() (lease, run_after) or in an asyncio timer; both hold far more, and
# nothing a relay waits for is longer. inf and nan are refused everywhere (allow_inf_nan).
MAX_SECONDS = 10 * 365 * 86400.0

# Seconds, or a string such as "90s", "15m", "1h", "7d", "1h30m" (see relay.durations).
Duration = Annotated[float, BeforeValidator(parse_duration), Field(le=MAX_SECONDS)]

# Delivered rows are kept this long by default: long enough to answer "was event 123
# delivered, and when?" (`outbox-relay show 123`) during an incident, short enough that even
# 1,000 events/s keep the table to a few million small rows. Set 0 for the fastest relay.
DEFAULT_RETENTION = 3600.0


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Backoff(_Section):
    """Delay before retry ``n`` (1-based): ``min(max, base * factor**(n-1))``, ± ``jitter``.

    ``schedule`` (seconds), when set, replaces the formula: retry ``n`` waits ``schedule[n-1]``
    and later retries repeat its last entry.
    """

    base: float = Field(1.0, gt=0, le=MAX_SECONDS, description="seconds before the first retry")
    factor: float = Field(2.0, ge=1, le=1000)
    max: float = Field(600.0, gt=0, le=MAX_SECONDS, description="cap on one delay, seconds")
    jitter: float = Field(0.2, ge=0, le=1, description="fraction of the delay, random ±")
    schedule: list[Annotated[float, Field(ge=0, le=MAX_SECONDS)]] | None = None


class RelaySettings(_Section):
    schema_: str = Field("public", alias="schema", min_length=1)
    relay_id: str | None = Field(None, description="defaults to host-pid-random")
    batch_size: int = Field(500, ge=1, le=10_000, description="rows per claim")
    max_in_flight: int = Field(
        2000, ge=1, le=100_000, description="rows claimed and not yet recorded, at most"
    )
    lease: float = Field(
        30.0, ge=1, le=86400, description="seconds a claim is held without heartbeat"
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
    retention_interval: Duration = Field(
        60.0, ge=0.05, description="seconds between retention runs (one relay at a time)"
    )
    retention_batch_size: int = Field(
        1000, ge=1, le=100_000, description="delivered rows deleted per statement"
    )
    stats_interval: Duration = Field(
        15.0, ge=0.05, description="seconds between pending-row gauge queries"
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


# What aiokafka can do with the settings the relay passes it. OAUTHBEARER needs a token
# provider object and GSSAPI the gssapi package: neither is wired in yet.
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
SASL_PROTOCOLS = ("SASL_PLAINTEXT", "SASL_SSL")
_CODECS = {"snappy": has_snappy, "lz4": has_lz4, "zstd": has_zstd}


def _bootstrap_problem(server: str) -> str | None:
    """Why aiokafka cannot use ``server`` (host, host:port, [v6]:port or a bare IPv6), or
    None. aiokafka raised ValueError or OverflowError from these at start-up."""
    server = server.strip()
    if not server:
        return "has an empty entry (a stray comma?)"
    if server.startswith("["):
        host, bracket, rest = server[1:].partition("]")
        if not bracket or not host or (rest and not rest.startswith(":")):
            return "has an IPv6 address without its closing ] (write [::1]:9092)"
        port = rest[1:] if rest else None
    elif ":" not in server:
        return None
    else:
        try:
            ipaddress.IPv6Address(server)
        except ValueError:
            pass
        else:
            return None
        host, _, port = server.rpartition(":")
        if not host:
            return "has an entry without a host"
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        return "has a port that is not a number from 1 to 65535"
    return None


def _acks(v: Any) -> Any:
    if isinstance(v, str):
        v = v.strip()
        if v in ("0", "1", "-1"):
            v = int(v)
    if v == 0 and not isinstance(v, bool):
        raise ValueError(
            "acks = 0 marks rows delivered without any acknowledgement from the broker: "
            "at-least-once would not hold; use 'all' (the default) or 1 (the leader only)"
        )
    return v


_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")


def _valid_host(host: str) -> bool:
    """A DNS name (IDNA already applied by httpx) or an IP address, nothing else."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    return len(host) <= 253 and all(_LABEL.match(label) for label in labels)


class KafkaSettings(_Section):
    bootstrap_servers: str | list[str] = "localhost:9092"
    client_id: str = "outbox-relay"
    # "1" from OUTBOX_KAFKA_ACKS=1 (or acks = "1" in TOML) means 1.
    acks: Annotated[Literal["all", 0, 1, -1], BeforeValidator(_acks)] = "all"
    enable_idempotence: bool = True
    compression_type: Literal["gzip", "snappy", "lz4", "zstd"] | None = None
    # Upper bounds: what the Kafka protocol's int32 fields and a sane relay take.
    linger_ms: int = Field(
        0, ge=0, le=10_000, description="keep 0: the relay already sends in batches"
    )
    max_batch_size: int = Field(
        262_144, ge=1024, le=64 * 1024 * 1024, description="producer batch bytes"
    )
    max_request_size: int = Field(
        1_048_576, ge=1024, le=100 * 1024 * 1024, description="largest message, bytes"
    )
    request_timeout_ms: int = Field(30_000, ge=1000, le=300_000)
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    # OAUTHBEARER is accepted by the type only to be refused with a clear message.
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = (
        Field(None, validate_default=True)
    )
    sasl_plain_username: str | None = Field(None, validate_default=True)
    sasl_plain_password: SecretStr | None = Field(None, validate_default=True)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    @field_validator("bootstrap_servers")
    @classmethod
    def _servers(cls, v: str | list[str]) -> str | list[str]:
        servers = v.split(",") if isinstance(v, str) else v
        if not servers:
            raise ValueError("names no server: list at least one host:port")
        for server in servers:
            problem = _bootstrap_problem(server)
            if problem:
                raise ValueError(f"{problem}; write host:port, e.g. kafka-1:9092")
        return v

    @field_validator("compression_type")
    @classmethod
    def _codec_installed(cls, v: str | None) -> str | None:
        available = _CODECS.get(v or "")
        if available is not None and not available():
            raise ValueError(
                f"{v} needs the cramjam package, which is not installed: pip install "
                f"'aiokafka[{v}]', or use compression_type = \"gzip\""
            )
        return v

    @field_validator("sasl_mechanism")
    @classmethod
    def _sasl_mechanism(cls, v: str | None, info: ValidationInfo) -> str | None:
        supported = f"{', '.join(SASL_MECHANISMS[:-1])} or {SASL_MECHANISMS[-1]}"
        if v == "OAUTHBEARER":
            raise ValueError(
                f"OAUTHBEARER is not supported yet; the relay supports {supported} "
                "(with sasl_plain_username and sasl_plain_password)"
            )
        protocol = info.data.get("security_protocol")
        if protocol is None:  # itself invalid, and reported
            return v
        if v is not None and protocol not in SASL_PROTOCOLS:
            raise ValueError(
                f"{v} needs security_protocol = 'SASL_PLAINTEXT' or 'SASL_SSL' (it is "
                f"{protocol!r}): without it the relay would connect without authenticating"
            )
        if v is None and protocol in SASL_PROTOCOLS:
            raise ValueError(f"required with security_protocol = {protocol!r}: {supported}")
        return v

    @field_validator("sasl_plain_username", "sasl_plain_password")
    @classmethod
    def _sasl_credentials(cls, v: Any, info: ValidationInfo) -> Any:
        mechanism = info.data.get("sasl_mechanism")
        if v is None and mechanism in SASL_MECHANISMS:
            raise ValueError(f"required with sasl_mechanism = {mechanism!r}")
        return v

    @model_validator(mode="after")
    def _idempotence_needs_acks_all(self) -> KafkaSettings:
        if self.enable_idempotence and self.acks not in ("all", -1):
            raise ValueError("enable_idempotence = true needs acks = 'all'")
        return self


class _Delivery(_Section):
    """What every destination kind shares: how its rows are ordered and what blocks a key."""

    ordering: Literal["none", "key"] = Field(
        "none",
        description="key: rows of one key are delivered one at a time, in enqueue (id) order",
    )
    poison_policy: Literal["block", "park"] = Field(
        "block",
        description="with ordering = key, a failed row blocks its key (block) until retried or "
        "skipped, or is set aside so the key moves on (park)",
    )


class KafkaDestination(_Delivery):
    kind: Literal["kafka"]
    topic: str = Field(min_length=1, max_length=249, pattern=r"^[A-Za-z0-9._-]+$")
    max_attempts: int | None = Field(
        None, ge=1, le=10_000, description="overrides relay.max_attempts"
    )
    backoff: Backoff | None = None

    @field_validator("topic")
    @classmethod
    def _kafka_topic(cls, v: str) -> str:
        # Kafka's own rule, beside the characters and length above.
        if v in (".", ".."):
            raise ValueError(f"{v!r} is not a valid Kafka topic name")
        return v


def package_version() -> str:
    try:
        return version("outbox-relay")
    except PackageNotFoundError:  # running from a checkout that is not installed
        return "0+unknown"


class WebhookClientSettings(_Section):
    """The one HTTP client the relay shares between all webhook destinations."""

    max_connections: int = Field(
        100, ge=1, description="open connections at most (keep >= sum of max_concurrency)"
    )
    max_keepalive_connections: int = Field(20, ge=0, description="idle connections kept")
    keepalive_expiry: float = Field(
        30.0, gt=0, le=86400, description="seconds an idle connection lives"
    )
    connect_timeout: float = Field(
        5.0, gt=0, le=300, description="seconds for DNS + TCP + TLS; destinations may override"
    )
    max_response_bytes: int = Field(
        4096, ge=0, le=1_048_576, description="response body bytes read, at most"
    )
    user_agent: str = Field(
        default_factory=lambda: f"outbox-relay/{package_version()}", min_length=1
    )


# The Standard Webhooks example schedule, stretched to about two days: the first attempt is
# immediate, then 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h, 10 h, 10 h (≈ 47.6 h in all).
WEBHOOK_SCHEDULE = (5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0, 36000.0, 36000.0)
WEBHOOK_MAX_ATTEMPTS = len(WEBHOOK_SCHEDULE) + 1

# Headers the relay sets itself: configured headers may not replace them.
RESERVED_HEADERS = frozenset(
    {
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
        "content-type",
        "content-length",
        "transfer-encoding",
        "host",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "proxy-authorization",
        "proxy-connection",
    }
)
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


def header_problem(name: str, value: str) -> str | None:
    """Why ``name: value`` cannot be sent as an HTTP header, or None if it can."""
    if not _TOKEN.match(name):
        return f"header name {name!r} is not a valid HTTP token"
    if any(c in value for c in "\r\n\x00"):
        return f"header {name!r} has a line break or NUL in its value"
    return None


class Circuit(_Section):
    """Per-endpoint circuit breaker: stop sending after consecutive failures, then probe."""

    threshold: int = Field(5, ge=1, description="consecutive failures that open the circuit")
    cooldown: float = Field(
        30.0, gt=0, le=MAX_SECONDS, description="seconds open before the first probe"
    )
    max_cooldown: float = Field(
        600.0,
        gt=0,
        le=MAX_SECONDS,
        description="cap on the cool-down, which doubles per failed probe",
    )


class WebhookDestination(_Delivery):
    kind: Literal["webhook"]
    url: str = Field(description="http(s) URL the events are POSTed to")
    secrets: list[SecretStr] = Field(
        default_factory=list, description="whsec_ signing secrets; several while rotating"
    )
    secret_env: str | None = Field(
        None, description="environment variable holding the secret(s), read at start-up"
    )
    timeout: float = Field(15.0, gt=0, le=300, description="seconds per request, in total")
    connect_timeout: float | None = Field(
        None, gt=0, le=300, description="overrides webhooks.connect_timeout"
    )
    max_concurrency: int = Field(16, ge=1, le=1000, description="in-flight requests, at most")
    headers: dict[str, str] = Field(default_factory=dict, repr=False)
    retry_client_errors: bool = Field(
        True, description="retry 3xx and 4xx (but 408/410/425/429); false: fail them at once"
    )
    retry_after_max: float = Field(
        3600.0,
        ge=1,
        le=MAX_SECONDS,
        description="cap on a Retry-After the endpoint asks for, seconds",
    )
    allow_private_networks: bool = Field(
        False, description="allow loopback/private/link-local/... addresses (SSRF guard off)"
    )
    allowed_networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = Field(
        default_factory=list, description="CIDRs allowed although not public, e.g. 10.1.0.0/16"
    )
    circuit: Circuit = Circuit()
    max_attempts: int = Field(WEBHOOK_MAX_ATTEMPTS, ge=1, le=10_000)
    backoff: Backoff = Backoff(schedule=list(WEBHOOK_SCHEDULE), jitter=0.2)

    @model_validator(mode="before")
    @classmethod
    def _secret_from_env(cls, data: Any) -> Any:
        # Read at start-up so a missing variable stops the relay now, not at the first event.
        if not isinstance(data, dict) or data.get("secret_env") is None:
            return data
        if data.get("secrets"):
            raise ValueError("set either secrets or secret_env, not both")
        var = data["secret_env"]
        value = os.environ.get(var) if isinstance(var, str) else None
        if not value or not value.strip():
            raise ValueError(
                f"secret_env names the environment variable {var!r}, which is not set "
                "(or empty); export it or put the secret in secrets"
            )
        # Several secrets (rotation) may be separated by spaces or commas.
        return {**data, "secrets": [s for s in re.split(r"[\s,]+", value) if s]}

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        try:
            url = httpx.URL(v)
        except httpx.InvalidURL as exc:
            # httpx quotes the offending piece, which may be part of a credential (a password
            # read as the port): say what is wrong without it.
            text = str(exc).lower()
            what = next((w for w in ("port", "character", "too long") if w in text), "")
            problem = {
                "port": "its port is not a number from 0 to 65535",
                "character": "it holds a control character",
                "too long": "it is too long",
            }.get(what, "it cannot be parsed")
            raise ValueError(
                f"not a valid URL: {problem} (credentials belong in headers, not in the URL)"
            ) from None
        if url.scheme not in ("http", "https"):
            raise ValueError(f"must be an http:// or https:// URL, not {url.scheme or 'none'!r}")
        if not url.host:
            raise ValueError("has no host")
        if not _valid_host(url.raw_host.decode("ascii", "replace")):
            raise ValueError(
                "its host is not a valid host name or IP address (letters, digits, hyphens "
                "and dots; no spaces or empty labels)"
            )
        if url.port is not None and not 1 <= url.port <= 65535:
            raise ValueError("its port must be a number from 1 to 65535")
        if url.userinfo:
            raise ValueError(
                "must not carry credentials (user:password@); send them in headers, e.g. "
                'headers = { Authorization = "Basic …" }'
            )
        return v

    @field_validator("allowed_networks", mode="before")
    @classmethod
    def _cidrs(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        nets = []
        for item in v:
            if isinstance(item, str):
                try:
                    item = ipaddress.ip_network(item)
                except ValueError as exc:
                    raise ValueError(
                        f"{item!r} is not a network in CIDR form like 10.1.0.0/16 ({exc})"
                    ) from None
            nets.append(item)
        return nets

    @field_validator("secrets")
    @classmethod
    def _whsec(cls, v: list[SecretStr]) -> list[SecretStr]:
        for s in v:
            decode_secret(s.get_secret_value())
        return v

    @field_validator("headers")
    @classmethod
    def _headers(cls, v: dict[str, str]) -> dict[str, str]:
        for name, value in v.items():
            if name.lower() in RESERVED_HEADERS:
                raise ValueError(f"header {name!r} is set by the relay and cannot be configured")
            problem = header_problem(name, value)
            if problem:
                raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _needs_secret(self) -> WebhookDestination:
        if not self.secrets:
            raise ValueError(
                'a webhook destination needs a signing secret: set secrets = ["whsec_…"] '
                'or secret_env = "NAME_OF_ENV_VAR"'
            )
        return self

    def signing_keys(self) -> list[bytes]:
        return [decode_secret(s.get_secret_value()) for s in self.secrets]


Destination = Annotated[KafkaDestination | WebhookDestination, Field(discriminator="kind")]


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
        allow_inf_nan=False,
    )

    database_url: SecretStr
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
    relay: RelaySettings = RelaySettings()
    kafka: KafkaSettings = KafkaSettings()
    http: HttpSettings = HttpSettings()
    # Not "http": that section belongs to the relay's own metrics/health server.
    webhooks: WebhookClientSettings = WebhookClientSettings()
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
        return (_OurEnvironment(settings_cls), init_settings)

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

    def ordered(self, destination: str) -> bool:
        d = self.destinations.get(destination)
        return d is not None and d.ordering == "key"

    def parks_poison(self, destination: str) -> bool:
        d = self.destinations.get(destination)
        return d is not None and d.poison_policy == "park"


def default_relay_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


# Inputs echoed in an error ("got …"): short scalars of settings that cannot hold a secret.
_ECHO_MAX_CHARS = 40


@functools.cache
def _echoable_fields() -> frozenset[str]:
    models: list[type[BaseModel]] = [
        Settings,
        RelaySettings,
        Backoff,
        KafkaSettings,
        KafkaDestination,
        WebhookDestination,
        WebhookClientSettings,
        Circuit,
        HttpSettings,
    ]
    names = {f.alias or n for m in models for n, f in m.model_fields.items()}
    return frozenset(n for n in names if not secrets.SECRET_KEY.search(n))


def _shown(err: Any, loc: tuple[Any, ...]) -> str:
    """`` (got …)`` for an input that is safe to echo, else nothing: only a short scalar of a
    setting that cannot hold a secret, never a table, a list, a dict key's value (destination
    or header names) or anything under a secret-bearing key."""
    if err["type"] in ("missing", "extra_forbidden") or not loc:
        return ""
    last = loc[-1]
    if not isinstance(last, str) or last not in _echoable_fields():
        return ""
    if any(secrets.SECRET_KEY.search(str(p)) for p in loc):
        return ""
    got = err.get("input")
    if isinstance(got, bool | int | float) or (
        isinstance(got, str) and len(got) <= _ECHO_MAX_CHARS and got.isprintable()
    ):
        return f" (got {got!r})"
    return ""


def _message(err: Any, loc: str) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown key (check its spelling and section)"
    if kind == "missing":
        if loc == "database_url":
            return "required (set database_url in the file or OUTBOX_DATABASE_URL)"
        return "required"
    if loc == "destinations" and kind == "dict_type":
        return (
            "must be a table of destinations: write one [destinations.NAME] table per "
            "destination (not [[destinations]], which makes a list)"
        )
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return "must be a table: [section] or key = { … } (not [[…]], which makes a list)"
    if kind == "union_tag_not_found":
        return 'needs kind = "kafka" or kind = "webhook"'
    if kind == "union_tag_invalid":
        tag = (err.get("ctx") or {}).get("tag")
        got = (
            f" (got {tag!r})"
            if isinstance(tag, str) and len(tag) <= _ECHO_MAX_CHARS and tag.isprintable()
            else ""
        )
        return f'kind must be "kafka" or "webhook"{got}'
    error = (err.get("ctx") or {}).get("error")
    if kind == "value_error" and error is not None:
        return str(error)  # our validators' own words, without pydantic's "Value error, "
    msg: str = err["msg"]
    return msg


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        parts = tuple(p for p in err["loc"] if not str(p).startswith("function-after"))
        loc = ".".join(str(p) for p in parts)
        loc = loc.replace("schema_", "schema") or "(top level)"
        msg = _message(err, loc)
        got = err.get("input")
        shown = "" if isinstance(got, str) and got and got in msg else _shown(err, parts)
        lines.append(f"  {loc}: {msg}{shown}")
    return "\n".join(lines)


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


class _OurEnvironment(EnvSettingsSource):
    """The environment, without Kubernetes' service-link variables."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        env = super()._load_env_vars()
        return {k: v for k, v in env.items() if not is_service_link(k.upper(), v)}


# OUTBOX_* variables that are not settings of `run` but are read by the command line (and
# the test suite's report file).
COMMAND_VARIABLES = frozenset({"OUTBOX_CONFIG", "OUTBOX_SCHEMA", "OUTBOX_FAULT_REPORT"})


def schema_from_environment(environ: Mapping[str, str] | None = None) -> str | None:
    """The schema the environment names: OUTBOX_SCHEMA, which every command reads (the ops
    commands' --schema, `run`'s relay.schema), or its `run`-only spelling
    OUTBOX_RELAY_SCHEMA. Both set to different schemas is an error, not a silent choice."""
    env = os.environ if environ is None else environ
    plain, nested = env.get("OUTBOX_SCHEMA"), env.get("OUTBOX_RELAY_SCHEMA")
    if plain is not None and nested is not None and plain != nested:
        raise ConfigError(
            f"OUTBOX_SCHEMA ({plain!r}) and OUTBOX_RELAY_SCHEMA ({nested!r}) name different "
            "schemas; set only OUTBOX_SCHEMA"
        )
    return plain if plain is not None else nested


def unknown_environment(
    settings: Settings | None = None, environ: Mapping[str, str] | None = None
) -> list[str]:
    """OUTBOX_* variables that no setting or command reads, each with a suggestion when one
    is close: a typo there is otherwise silently ignored. (A wrong key inside a section, like
    OUTBOX_RELAY_BATCHSIZE, is already an error.) Variables the configuration names itself
    (a webhook destination's secret_env) and Kubernetes' service links are not reported."""
    env = os.environ if environ is None else environ
    known = {f"OUTBOX_{name.upper()}" for name in Settings.model_fields}
    sections = [f"{k}_" for k in known if k != "OUTBOX_DATABASE_URL"]
    named = set()
    if settings is not None:
        named = {
            d.secret_env
            for d in settings.destinations.values()
            if isinstance(d, WebhookDestination) and d.secret_env
        }
    found = []
    for name in sorted(env):
        if not name.startswith("OUTBOX_") or name in known or name in COMMAND_VARIABLES:
            continue
        if name in named or is_service_link(name, env[name]):
            continue
        if name.startswith("OUTBOX_TEST_") or any(name.startswith(p) for p in sections):
            continue
        close = difflib.get_close_matches(name, [*known, *COMMAND_VARIABLES], n=1)
        found.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return found


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
    schema = schema_from_environment()
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
    found = secrets.config_secrets(data) | secrets.environment_secrets(os.environ)
    where = f" in {path}" if path else ""
    # Settings(**data) also takes pydantic-settings' own arguments (_env_file, _secrets_dir,
    # …): a file must not reach them (`_env_file = "/etc/passwd"` would read that file).
    private = sorted(k for k in data if k.startswith("_"))
    if private:
        bad = "\n".join(f"  {k}: unknown key (check its spelling and section)" for k in private)
        raise ConfigError(secrets.hide(f"invalid configuration{where}:\n{bad}", found))
    try:
        settings = Settings(**data)
    except ValidationError as exc:
        message = f"invalid configuration{where}:\n{_format_errors(exc)}"
        raise ConfigError(secrets.hide(message, found)) from None
    except SettingsError as exc:
        # An OUTBOX_* variable that should hold JSON (OUTBOX_DESTINATIONS, …) does not parse.
        # Its text names the field, never the value.
        message = f"invalid configuration in the environment: {exc}"
        raise ConfigError(secrets.hide(message, found)) from None
    return settings


def settings_secrets(s: Settings) -> set[str]:
    """What the relay must never print: the database password, the SASL password, webhook
    secrets and configured header values (see relay.secrets for the lengths scrubbed)."""
    found = set(url_secrets(s.database_url.get_secret_value()))
    if s.kafka.sasl_plain_password is not None:
        found.add(s.kafka.sasl_plain_password.get_secret_value())
    for d in s.destinations.values():
        if isinstance(d, WebhookDestination):
            found.update(x.get_secret_value() for x in d.secrets)
            found |= secrets.config_secrets({"url": d.url, "headers": d.headers})
    return found
