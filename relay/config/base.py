"""What every part of the configuration builds on: sections, durations, retry policies, and
what a destination of any kind has.

Sinks define their own settings (``relay/sinks/<kind>/config.py``) from these pieces; the
relay's settings are assembled from them in ``relay/config/settings.py``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from relay.durations import parse_duration


class ConfigError(Exception):
    """The configuration cannot be used; the message names every bad key."""


# The longest duration any setting takes: ten years. Every delay ends up in a PostgreSQL
# interval added to now() (lease, run_after) or in an asyncio timer; both hold far more, and
# nothing a relay waits for is longer. inf and nan are refused everywhere (allow_inf_nan).
MAX_SECONDS = 10 * 365 * 86400.0

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


class Delivery(Section):
    """What a destination of every kind has: its kind, how its rows are ordered, what blocks
    a key, and its retry policy (where unset, the relay's)."""

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


def package_version() -> str:
    try:
        return version("outbox-relay")
    except PackageNotFoundError:  # running from a checkout that is not installed
        return "0+unknown"
