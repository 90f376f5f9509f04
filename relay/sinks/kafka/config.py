"""The Kafka sink's settings: the producer all Kafka destinations share ([kafka]), and a
destination's topic."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Literal

from aiokafka.codec import has_lz4, has_snappy, has_zstd
from pydantic import (
    BeforeValidator,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from relay.config.base import DestinationSettings, Section

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


class KafkaSettings(Section):
    """The one producer the relay shares between all Kafka destinations."""

    bootstrap_servers: str | list[str] = Field(
        "localhost:9092",
        description=(
            "`host:port` entries, comma-separated string or list (`[::1]:9092` for IPv6; port 9092 "
            "if omitted)"
        ),
    )
    client_id: str = Field(
        "outbox-relay", description="the producer's client id, as the brokers see it"
    )
    # "1" from OUTBOX_KAFKA_ACKS=1 (or acks = "1" in TOML) means 1.
    acks: Annotated[Literal["all", 0, 1, -1], BeforeValidator(_acks)] = Field(
        "all",
        description=(
            "`all`, or `1` (the leader only: a leader failover can lose an acknowledged message); "
            "`0` is refused (nothing would be acknowledged); `-1` means `all`"
        ),
    )
    enable_idempotence: bool = Field(
        True, description='the idempotent producer; needs `acks = "all"`'
    )
    compression_type: Literal["gzip", "snappy", "lz4", "zstd"] | None = Field(
        None,
        description=(
            "compression of the producer's batches; `snappy`, `lz4` and `zstd` need the cramjam "
            "package (`pip install 'aiokafka[snappy]'`), checked at load"
        ),
    )
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
    request_timeout_ms: int = Field(
        30_000,
        ge=1000,
        le=300_000,
        description="milliseconds the producer waits for a broker's answer",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="how the producer connects; the `SASL_` ones need `sasl_mechanism`"
    )
    # OAUTHBEARER is accepted by the type only to be refused with a clear message.
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = (
        Field(
            None,
            validate_default=True,
            description=(
                "`PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512` (`OAUTHBEARER` is not supported yet "
                "and refused); needs `security_protocol` `SASL_PLAINTEXT` or `SASL_SSL`"
            ),
        )
    )
    sasl_plain_username: str | None = Field(
        None, validate_default=True, description="required with a `sasl_mechanism` (for SCRAM too)"
    )
    sasl_plain_password: SecretStr | None = Field(
        None, validate_default=True, description="required with a `sasl_mechanism`; never printed"
    )
    ssl_cafile: str | None = Field(None, description="TLS: the CA certificates file")
    ssl_certfile: str | None = Field(None, description="TLS: the client certificate file")
    ssl_keyfile: str | None = Field(None, description="TLS: the client certificate's key file")

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


class KafkaDestination(DestinationSettings):
    kind: Literal["kafka"] = Field(
        description=(
            "the kind of sink that delivers the destination's rows; it decides which other keys the"
            " destination takes"
        )
    )
    topic: str = Field(
        min_length=1,
        max_length=249,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="the Kafka topic the destination's rows go to",
    )

    @field_validator("topic")
    @classmethod
    def _kafka_topic(cls, v: str) -> str:
        # Kafka's own rule, beside the characters and length above.
        if v in (".", ".."):
            raise ValueError(f"{v!r} is not a valid Kafka topic name")
        return v
