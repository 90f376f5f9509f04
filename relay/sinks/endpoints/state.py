"""What this relay keeps about one registered endpoint between its deliveries: its request
slots, pace, health, latency and whether it may still be sent to."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from relay.breaker import State
from relay.sinks.endpoints.config import EndpointsDestination
from relay.sinks.endpoints.fairness import Holding, is_slow
from relay.sinks.webhook.requests import Target

NOT_TAKEN_LOG_EVERY = 60.0  # seconds between relay.endpoints.not_taken lines per endpoint


@dataclass(eq=False)
class EndpointState:
    """What this relay keeps about one registered endpoint between deliveries."""

    id: int
    destination: str
    config: EndpointsDestination
    version: tuple[str, str, str | None] = ("", "", None)
    endpoint: Target | None = None
    problem: str | None = None  # why it cannot be sent to now (its secret cannot be read)
    semaphore: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    in_hand: int = 0
    next_send: float = 0.0  # rate limit: the earliest time of the next request
    failing: bool | None = None  # as last written to the table (None: not written yet)
    health_written: float = 0.0
    # When this relay disabled it (410 Gone, disable_after): rows claimed before are not
    # sent. Rows claimed later mean it was enabled again.
    disabled_at: float | None = None
    # Answered 410, not yet disabled in the table: this relay claims nothing more for it.
    gone: bool = False
    last_claimed: float = 0.0
    tenant: str | None = None  # the endpoint's, as its latest read (a claim's, or enabled's)
    event_types: tuple[str, ...] = ()  # the endpoint's, as its latest read
    # When the read that gave tenant and event_types began (monotonic): an older read that
    # ends later does not put back what a newer one saw.
    tenant_read: float = float("-inf")
    tenant_by_enabled: bool = False  # that read was the enabled endpoints' (not a claim's)
    latency: float | None = None  # its requests' moving average, seconds (fairness.average)
    started: list[float] = field(default_factory=list)  # its requests in flight, monotonic
    not_taken: int = 0  # deliveries cancelled as not taken since the last log line
    not_taken_logged: float = -NOT_TAKEN_LOG_EVERY
    rate_limited: bool = False  # as its last claim read it
    put_back_at: float = float("-inf")  # when a delivery was last put back as it turned slow

    def holding(self, now: float) -> Holding:
        """What the fair share plan needs to know of it now."""
        slow = is_slow(self.latency, self.started, now, self.config.budget)
        return Holding(
            self.id,
            self.tenant,
            self.in_hand,
            slow,
            self.config.slow_concurrency,
            known=self.latency is not None,
        )

    @property
    def circuit_open(self) -> bool:
        return self.endpoint is not None and self.endpoint.breaker.state is State.OPEN
