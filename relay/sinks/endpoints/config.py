"""An endpoints destination's settings: how its events are sent to the endpoints registered
for it at runtime (outbox.endpoints), which hold each endpoint's URL, secret and filters."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from relay.config.base import Duration
from relay.sinks.webhook.config import WebhookRequestSettings

# An endpoint failing without a single success for this long is disabled (Svix's figure).
DISABLE_AFTER = 5 * 86400.0


class EndpointsDestination(WebhookRequestSettings):
    kind: Literal["endpoints"] = Field(
        description=(
            "the kind of sink that delivers the destination's rows; it decides which other keys the"
            " destination takes"
        )
    )
    max_concurrency: int = Field(
        4, ge=1, le=1000, description="in-flight requests per endpoint, at most"
    )
    disable_after: Duration = Field(
        DISABLE_AFTER,
        ge=60,
        description="an endpoint failing for this long without a success is disabled "
        '(seconds, or e.g. "5d"); a 410 Gone disables it at once',
    )

    latency_budget: Duration | None = Field(
        None,
        gt=0,
        description="an endpoint whose requests take longer than this (on average, or one "
        "still in flight) is slow: it gets at most slow_concurrency requests in flight and no "
        "share of the last quarter of the relay's capacity (seconds; default a third of "
        "timeout)",
    )
    slow_concurrency: int = Field(
        1, ge=1, le=1000, description="in-flight requests of a slow endpoint, at most"
    )

    @property
    def budget(self) -> float:
        """Seconds past which an endpoint's requests make it slow."""
        return self.latency_budget if self.latency_budget is not None else self.timeout / 3

    @model_validator(mode="after")
    def _budget_under_timeout(self) -> EndpointsDestination:
        if self.latency_budget is not None and self.latency_budget >= self.timeout:
            raise ValueError(
                f"latency_budget ({self.latency_budget:g} s) must be under timeout "
                f"({self.timeout:g} s): requests that run to their timeout would never count "
                "as slow; lower latency_budget or leave it out (a third of timeout)"
            )
        return self

    @model_validator(mode="after")
    def _unordered(self) -> EndpointsDestination:
        if self.ordering == "key":
            raise ValueError(
                'ordering = "key" is not supported for an endpoints destination: each '
                "endpoint retries on its own schedule, so events reach it out of order; "
                'receivers order by the event\'s own data (remove ordering or set "none")'
            )
        return self
