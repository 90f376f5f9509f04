"""Delivering envelopes to HTTP webhooks, signed the Standard Webhooks way.

Each destination is an *endpoint* with its own concurrency limit and circuit breaker, and a
batch is split per endpoint with the groups running concurrently: a slow or dead endpoint
holds only its own rows. Each request goes through the request path (requests.py, shared
with the endpoints sink), over one SSRF-guarded client (client.py). What is the same for
every request of an endpoint (its URL, configured headers, timeouts, its CloudEvents
envelope) is built once, so a request costs its signature and little else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import structlog

from relay.breaker import Breaker, State
from relay.model import Envelope, Outcome
from relay.sinks import SinkBase, misrouted
from relay.sinks.webhook.answers import parse_retry_after
from relay.sinks.webhook.config import WebhookClientSettings, WebhookDestination
from relay.sinks.webhook.requests import RequestPath, Target

log = structlog.get_logger("relay.sink.webhook")

# An endpoint holding this many times its max_concurrency in rows is not offered more.
CONGESTION_FACTOR = 4
BUSY_RETRY_IN = 1.0


class WebhookSink(SinkBase):
    """POSTs each envelope to its destination's URL; one outcome per envelope, never raises."""

    kind = "webhook"

    def __init__(
        self,
        http: WebhookClientSettings,
        destinations: Mapping[str, WebhookDestination],
        *,
        slot_wait: float = 5.0,
    ) -> None:
        """``slot_wait``: seconds a row waits for one of its endpoint's request slots.

        The relay records a batch's outcomes when ``deliver`` returns, so rows queued behind
        a slow endpoint would hold every other endpoint's results (and the relay's in-flight
        capacity). Rows that get no slot in time are deferred instead, unattempted.
        """
        self.http = http
        self.slot_wait = slot_wait
        self.requests = RequestPath(http)
        self.endpoints = {
            name: self.requests.target(name, d, d.url, d.signing_keys())
            for name, d in destinations.items()
        }
        # Set to a list to collect each answered request's latency in ms (the benchmark).
        self.latencies: list[float] | None = None

    def circuits(self) -> dict[str, Breaker]:
        """For the outbox_circuit_state metric: one breaker per endpoint (scheme://host:port,
        never the path or query, which may carry tokens)."""
        return {f"{name} {ep.origin}": ep.breaker for name, ep in self.endpoints.items()}

    def breakers_of(self, destination: str) -> Sequence[Breaker]:
        endpoint = self.endpoints.get(destination)
        return (endpoint.breaker,) if endpoint is not None else ()

    async def start(self) -> None:
        await self.requests.start()
        wanted = sum(ep.config.max_concurrency for ep in self.endpoints.values())
        if wanted > self.http.max_connections:
            # Endpoints would then wait on each other for connections: not isolated.
            log.warning(
                "relay.webhook.pool_too_small",
                max_connections=self.http.max_connections,
                sum_of_max_concurrency=wanted,
                hint="raise webhooks.max_connections",
            )

    def available(self, destination: str) -> bool:
        ep = self.endpoints.get(destination)
        return ep is None or (
            ep.breaker.state is not State.OPEN
            and ep.in_hand < ep.config.max_concurrency * CONGESTION_FACTOR
        )

    def ready(self, destination: str) -> bool:
        return self.available(destination)

    async def close(self) -> None:
        await self.requests.close()

    # --- delivering ------------------------------------------------------------------------

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
        """One destination's rows (the Sink contract), each POSTed on its own, at most
        ``max_concurrency`` at a time."""
        if not batch:
            return []
        dest = batch[0].destination
        ep = self.endpoints.get(dest)
        if ep is None or any(e.destination != dest for e in batch):
            return await misrouted(batch, self.endpoints, "webhook", self.deliver)
        # Counted before the first await: the relay asks available() right after handing a
        # batch over, and must see these rows already, or it claims more for a busy endpoint.
        ep.in_hand += len(batch)
        try:
            outcomes = await self._walk(ep, batch)
        finally:
            ep.in_hand -= len(batch)
        self._log_group(ep, outcomes)
        return outcomes

    async def _walk(self, ep: Target, batch: Sequence[Envelope]) -> list[Outcome]:
        """Up to ``max_concurrency`` workers walk the batch in order, each taking one of the
        endpoint's request slots before its next row: a few tasks per batch, not one per row.
        Rows no worker started within ``slot_wait`` (the endpoint was busy with other
        batches) are deferred, unattempted."""
        outcomes: list[Outcome | None] = [None] * len(batch)
        rows = iter(range(len(batch)))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.slot_wait
        send = self.requests.send
        latencies = self.latencies

        async def worker() -> None:
            while await self._slot(ep, deadline):
                try:
                    # A row not started by the deadline is deferred, even when this worker
                    # has a slot: it would wait behind the endpoint's pace for its turn.
                    i = next(rows, None) if loop.time() < deadline else None
                    if i is None:
                        return
                    answer = await send(ep, batch[i])
                    outcomes[i] = answer.outcome
                    if latencies is not None and answer.status is not None:
                        latencies.append(answer.ms)
                finally:
                    ep.semaphore.release()

        workers = min(len(batch), ep.config.max_concurrency)
        if workers == 1:
            await worker()
        else:
            await asyncio.gather(*(worker() for _ in range(workers)))
        return [o or self._busy(ep, env) for o, env in zip(outcomes, batch, strict=True)]

    @staticmethod
    async def _slot(ep: Target, deadline: float) -> bool:
        """Take a request slot of the endpoint; False if none came free by ``deadline``."""
        if not ep.semaphore.locked():
            await ep.semaphore.acquire()  # free: no wait, and no timer to arm
            return True
        try:
            async with asyncio.timeout_at(deadline):
                await ep.semaphore.acquire()
        except TimeoutError:
            return False
        return True

    def _busy(self, ep: Target, env: Envelope) -> Outcome:
        return Outcome.defer(
            env.id,
            f"endpoint {ep.origin} busy: no free request slot within {self.slot_wait:g} s "
            f"(max_concurrency {ep.config.max_concurrency}); not attempted",
            BUSY_RETRY_IN,
        )

    @staticmethod
    def _log_group(ep: Target, outcomes: list[Outcome]) -> None:
        gone = [o.id for o in outcomes if o.error and o.error.startswith("HTTP 410")]
        if gone:
            log.warning(
                "relay.webhook.gone",
                destination=ep.name,
                endpoint=ep.origin,
                rows=len(gone),
                hint="the endpoint answered 410 Gone: its rows are failed; remove or fix it",
            )
        refused = [o for o in outcomes if o.error and o.error.startswith("refused")]
        if refused:
            log.warning(
                "relay.webhook.refused",
                destination=ep.name,
                endpoint=ep.origin,
                rows=len(refused),
                error=refused[0].error,
            )


__all__ = ["WebhookSink", "parse_retry_after"]
