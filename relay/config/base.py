"""What every part of the configuration builds on: sections, durations, retry policies, and
what a destination of any kind has.

Sinks define their own settings (``relay/sinks/<kind>/config.py``) from these pieces; the
relay's settings are assembled from them in ``relay/config/settings.py``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from relay.cloudevents import source_problem, type_problem
from relay.durations import parse_duration


class ConfigError(Exception):
    """The configuration cannot be used; the message names every bad key."""


# The longest duration any setting takes: ten years. Every delay ends up in a PostgreSQL
# interval added to now() (lease, run_after) or in an asyncio timer; both hold far more, and
# nothing a relay waits for is longer. inf and nan are refused everywhere (allow_inf_nan).
MAX_SECONDS = 10 * 365 * 86400.0

# relay.snapshot_warning's default: a report or a pg_dump may hold a snapshot for minutes on
# purpose, but a minute of dead rows kept is already seen in the claim's latency at a few
# thousand events a second.
DEFAULT_SNAPSHOT_WARNING = 60.0

# Seconds, or a string such as "90s", "15m", "1h", "7d", "1h30m" (see relay.durations).
Duration = Annotated[float, BeforeValidator(parse_duration), Field(le=MAX_SECONDS)]


class Section(BaseModel):
    """A table of the configuration: unknown keys, inf and nan are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Backoff(Section):
    """Delay before retry ``n`` (1-based): ``min(max, base * factor**(n-1))``, ± ``jitter``.

    ``schedule`` (seconds), when set, replaces the formula: retry ``n`` waits ``schedule[n-1]``
    and later retries repeat its last entry.
    """

    base: float = Field(1.0, gt=0, le=MAX_SECONDS, description="seconds before the first retry")
    factor: float = Field(2.0, ge=1, le=1000, description="growth of the delay per attempt")
    max: float = Field(600.0, gt=0, le=MAX_SECONDS, description="cap on one delay, seconds")
    jitter: float = Field(0.2, ge=0, le=1, description="fraction of the delay, random ±")
    schedule: list[Annotated[float, Field(ge=0, le=MAX_SECONDS)]] | None = Field(
        None, description="explicit delays; replaces the formula, the last entry repeats"
    )


class DestinationSettings(Section):
    """What a destination of every kind has: its kind, how its rows are ordered, what blocks
    a key, its retry policy (where unset, the relay's), and the envelope its rows are sent in."""

    # The envelope (envelope, source, cloudevents_mode, default_type) is applied by each sink
    # in its protocol's binding, from what relay/cloudevents.py builds once per destination.

    kind: str = Field(
        description=(
            "the kind of sink that delivers the destination's rows; it decides which other keys the"
            " destination takes"
        )
    )
    ordering: Literal["none", "key"] = Field(
        "none",
        description="key: rows of one key are delivered one at a time, in enqueue (id) order",
    )
    poison_policy: Literal["block", "park"] = Field(
        "block",
        description="with ordering = key, a failed row blocks its key (block) until retried or "
        "skipped, or is set aside so the key moves on (park)",
    )
    max_attempts: int | None = Field(
        None, ge=1, le=10_000, description="attempts before a row is failed; overrides relay's"
    )
    backoff: Backoff | None = Field(None, description="overrides relay.backoff")
    envelope: Literal["none", "cloudevents"] = Field(
        "none",
        description="none: the payload is sent as it is; cloudevents: each row is sent as a "
        "CloudEvent 1.0 (id, source, type, specversion, time), see [CloudEvents](cloudevents.md)",
    )
    # Validated after envelope (declared before them), which each reads.
    source: str | None = Field(
        None,
        validate_default=True,
        description='required with envelope = "cloudevents": the events\' `source` attribute, '
        "a URI-reference such as `/orders-service` or `https://shop.example/orders`",
    )
    cloudevents_mode: Literal["binary", "structured"] = Field(
        "binary",
        description='with envelope = "cloudevents": binary (attributes in `ce-`/`ce_` headers, '
        "the payload sent as it is) or structured (one `application/cloudevents+json` document "
        "holding the attributes and the data)",
    )
    default_type: str | None = Field(
        None,
        description='with envelope = "cloudevents": the `type` of rows enqueued without an '
        "`event_type`; unset, such a row fails with the reason (no type is made up)",
    )

    @field_validator("source")
    @classmethod
    def _source(cls, v: str | None, info: ValidationInfo) -> str | None:
        envelope = info.data.get("envelope")
        if envelope is None:  # itself invalid, and reported
            return v
        if envelope != "cloudevents":
            if v is not None:
                raise ValueError(
                    'is only used with envelope = "cloudevents": add envelope = "cloudevents" '
                    "to send CloudEvents, or remove source"
                )
            return v
        if v is None:
            raise ValueError(
                'required with envelope = "cloudevents": the URI-reference that names where '
                'the events come from, e.g. source = "/orders-service"'
            )
        problem = source_problem(v)
        if problem:
            raise ValueError(
                f'must be a URI-reference (RFC 3986) such as "/orders-service" or '
                f'"https://shop.example/orders"; this one {problem}'
            )
        return v

    # Without validate_default: these run only for keys the configuration sets.
    @field_validator("cloudevents_mode", "default_type")
    @classmethod
    def _with_cloudevents(cls, v: str | None, info: ValidationInfo) -> str | None:
        envelope = info.data.get("envelope")
        if envelope is not None and envelope != "cloudevents":
            raise ValueError(
                f'is only used with envelope = "cloudevents": add envelope = "cloudevents" '
                f"and source, or remove {info.field_name}"
            )
        if info.field_name == "default_type" and v is not None:
            problem = type_problem(v)
            if problem:
                raise ValueError(f"must be a non-empty event type; this one {problem}")
        return v


def package_version() -> str:
    try:
        return version("outbox-relay")
    except PackageNotFoundError:  # running from a checkout that is not installed
        return "0+unknown"
