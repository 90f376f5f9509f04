"""The endpoints sink: fan-out as the sink's delivery, and the deliveries as a source.

For the relay, an endpoints destination is a sink like any other: its events are claimed,
"delivered" and recorded. Delivering one here means writing its deliveries, one per
matching endpoint, and recording the event as delivered, in one statement per batch (FAN_OUT:
a crash never leaves a batch fanned out but not recorded, to be fanned out again); its
payload stays until its deliveries end (the retention guard in relay/db/queries/). The
deliveries are a source of claimable rows (source.py) that the relay's own pipeline claims,
holds, renews, records, reaps and releases, and this sink sends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from outbox.errors import describe
from relay.breaker import Breaker, State
from relay.db.store import DB_ERRORS
from relay.model import Envelope, Outcome, Result
from relay.sinks import Host, SinkBase, misrouted
from relay.sinks.endpoints import at_rest
from relay.sinks.endpoints.config import EndpointsDestination
from relay.sinks.endpoints.source import DeliverySource
from relay.sinks.endpoints.store import DeliveryStore
from relay.sinks.source import SendingSource
from relay.sinks.webhook.config import WebhookClientSettings
from relay.sinks.webhook.requests import RequestPath

log = structlog.get_logger("relay.sink.endpoints")

FAN_OUT_RETRY = 2.0


class EndpointsSink(SinkBase):
    kind = "endpoints"

    def __init__(
        self, http: WebhookClientSettings, destinations: Mapping[str, EndpointsDestination]
    ) -> None:
        self.destinations = dict(destinations)
        self.requests = RequestPath(http)  # its requests go as the webhook sink's do
        # A key that is not one, or encryption required without a key: refused here, before
        # the relay connects (OutboxError, saying what to set).
        self.secret_box = at_rest.secret_box()
        self.source: DeliverySource | None = None  # built once attached

    def attach(self, host: Host) -> None:
        """Called by the relay once the database is reached, before any claim."""
        max_in_flight = host.max_in_flight
        # Each endpoint's requests are bounded by its max_concurrency and all of them by the
        # deliveries held (max_in_flight): a pool smaller than that would make healthy
        # endpoints wait for connections slow ones hold, and time out against their own
        # budget. Opened by start(), after this.
        http = self.requests.http
        if http.max_connections < max_in_flight:
            self.requests.http = http.model_copy(update={"max_connections": max_in_flight})
        source = DeliverySource(
            DeliveryStore(host.store),
            self.requests,
            self.destinations,
            max_in_flight=max_in_flight,
            poll_interval=host.poll_interval,
            secret_box=self.secret_box,
        )
        source.paused = host.paused
        source.on_room = host.wake
        source.metrics = host.metrics
        self.source = source

    @property
    def deliveries(self) -> DeliveryStore | None:
        """Its statements over the relay's pool, once attached (benchmarks time them)."""
        return self.source.store if self.source is not None else None

    def sources(self) -> Sequence[SendingSource[Any]]:
        return (self.source,) if self.source is not None else ()

    async def start(self) -> None:
        await self.requests.start()
        if self.source is not None:
            try:
                await at_rest.warn_unencrypted(self.source.store.store, self.secret_box)
            except DB_ERRORS as exc:  # only a check: never what stops the relay
                log.warning("relay.endpoints.secrets_check_failed", error=describe(exc))

    def wake(self) -> None:
        """A NOTIFY: endpoints were added, changed or enabled."""
        if self.source is not None:
            self.source.endpoints_changed()

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
        """Fan a batch of events out into deliveries; one outcome per event."""
        if not batch:
            return []
        if any(e.destination not in self.destinations for e in batch):
            return await misrouted(batch, self.destinations, "endpoints", self.deliver)
        if self.source is None:
            return [Outcome.retry(e.id, "endpoints sink not attached to a database") for e in batch]
        held = [e for e in batch if e.held()]
        outcomes = [Outcome.not_held(e.id) for e in batch if not e.held()]
        if not held:
            return outcomes
        try:
            matched = await self.source.fan_out(held, NO_MATCH)
        except DB_ERRORS as exc:
            # Not written (or, if the answer was lost after a commit, written: then the
            # completer finds the rows recorded already and counts them as not its own).
            error = f"fan-out to endpoints failed: {describe(exc)}"
            return outcomes + [Outcome.retry(e.id, error, FAN_OUT_RETRY) for e in held]
        for e in held:
            found = matched.get(e.id)
            if found is None:
                # No longer this relay's (its lease ran out): nothing was written for it.
                outcomes.append(Outcome.not_held(e.id))
            elif found:
                outcomes.append(Outcome(e.id, Result.DELIVERED, recorded=True))
            else:
                # Recorded, not failed and not retried: nobody subscribed to it.
                outcomes.append(Outcome(e.id, Result.DELIVERED, NO_MATCH, recorded=True))
        return outcomes

    def claim_limit(self, destination: str, limit: int) -> int:
        """Events are claimed as their deliveries can be sent at once (fanned out into
        endpoints' room, DeliverySource.fan_out): claimed faster, their deliveries would wait
        to be claimed one by one. As many as asked while no endpoint is known to be fast."""
        if self.source is None:
            return limit
        fits = self.source.fan_out_fits(destination, limit)
        if fits is None or fits >= limit:
            return limit
        self.source.held_back.add(destination)
        return fits

    def available(self, destination: str) -> bool:
        return True

    def ready(self, destination: str) -> bool:
        return True

    def circuits(self) -> dict[str, Breaker]:
        """Circuits that are not closed only: with thousands of endpoints, one series each
        would swamp the metrics; a missing endpoint's circuit is closed."""
        states = self.source.states.values() if self.source is not None else ()
        return {
            f"{s.endpoint.name} {s.endpoint.origin}": s.endpoint.breaker
            for s in states
            if s.endpoint is not None and s.endpoint.breaker.state is not State.CLOSED
        }

    def breakers_of(self, destination: str) -> Sequence[Breaker]:
        """None stands for a destination as a whole: each endpoint has its own."""
        return ()

    async def close(self) -> None:
        await self.requests.close()


NO_MATCH = "no endpoint matched (none enabled for its destination, tenant and event type)"
