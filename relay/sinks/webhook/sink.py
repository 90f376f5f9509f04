"""Delivering envelopes to HTTP webhooks, signed the Standard Webhooks way.

Each destination is an *endpoint* with its own concurrency limit and circuit breaker, and a
batch is split per endpoint with the groups running concurrently: a slow or dead endpoint
holds only its own rows. Every request goes through one shared, SSRF-guarded client.
"""

from __future__ import annotations

import asyncio
import enum
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import httpx
import structlog

from outbox.errors import describe
from relay.breaker import Breaker, State
from relay.model import Envelope, Outcome, truncate_error
from relay.sinks.webhook.client import POLICY, build_client
from relay.sinks.webhook.config import (
    RESERVED_HEADERS,
    WebhookClientSettings,
    WebhookDestination,
    header_problem,
)
from relay.sinks.webhook.signing import Signer
from relay.sinks.webhook.ssrf import AddressPolicy, AddressRefused

log = structlog.get_logger("relay.sink.webhook")

BODY_IN_ERROR = 512  # response bytes kept in last_error
RETRY_AFTER_STATUSES = frozenset({429, 503})
TRANSIENT_STATUSES = frozenset({408, 425, 429})
MIN_RETRY_AFTER = 1.0  # "Retry-After: 0" must not become a hot loop
# An endpoint holding this many times its max_concurrency in rows is not offered more.
CONGESTION_FACTOR = 4
BUSY_RETRY_IN = 1.0


class Health(enum.Enum):
    """What an attempt says about the endpoint, for its circuit breaker."""

    UP = "up"
    DOWN = "down"
    UNKNOWN = "unknown"  # e.g. a 400 about one message: the endpoint answers, but not well


@dataclass(eq=False)
class Endpoint:
    name: str
    config: WebhookDestination
    url: httpx.URL
    signer: Signer
    policy: AddressPolicy
    timeout: httpx.Timeout
    breaker: Breaker
    semaphore: asyncio.Semaphore
    probe: asyncio.Lock = field(default_factory=asyncio.Lock)
    in_hand: int = 0  # rows handed to deliver() for this endpoint and not yet returned

    @property
    def congested(self) -> bool:
        return self.in_hand >= self.config.max_concurrency * CONGESTION_FACTOR

    @property
    def origin(self) -> str:
        # Logged and stored instead of the URL: paths and queries often carry tokens.
        return f"{self.url.scheme}://{self.url.netloc.decode('ascii')}"


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds from ``now`` that a ``Retry-After`` value asks for (delta-seconds or HTTP date)."""
    if value is None:
        return None
    value = value.strip()
    if re.fullmatch(r"\d+(\.\d+)?", value):
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT by definition
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def snippet(body: bytes) -> str:
    text = body[:BODY_IN_ERROR].decode("utf-8", "replace")
    return " ".join(text.split())


class WebhookSink:
    """POSTs each envelope to its destination's URL; one outcome per envelope, never raises."""

    kind = "webhook"

    def __init__(
        self,
        http: WebhookClientSettings,
        destinations: Mapping[str, WebhookDestination],
        *,
        client: httpx.AsyncClient | None = None,
        slot_wait: float = 5.0,
    ) -> None:
        """``slot_wait``: seconds a row waits for one of its endpoint's request slots.

        The relay records a batch's outcomes when ``deliver`` returns, so rows queued behind
        a slow endpoint would hold every other endpoint's results (and the relay's in-flight
        capacity). Rows that get no slot in time are deferred instead, unattempted.
        """
        self.http = http
        self.slot_wait = slot_wait
        self.endpoints = {name: self._endpoint(name, d) for name, d in destinations.items()}
        self._client = client
        self._own_client = client is None

    def _endpoint(self, name: str, d: WebhookDestination) -> Endpoint:
        return Endpoint(
            name=name,
            config=d,
            url=httpx.URL(d.url),
            signer=Signer(d.signing_keys()),
            policy=AddressPolicy(d.allow_private_networks, tuple(d.allowed_networks)),
            timeout=httpx.Timeout(
                d.timeout, connect=d.connect_timeout or self.http.connect_timeout
            ),
            breaker=Breaker(d.circuit.threshold, d.circuit.cooldown, d.circuit.max_cooldown),
            semaphore=asyncio.Semaphore(d.max_concurrency),
        )

    def circuits(self) -> dict[str, Breaker]:
        """For the outbox_circuit_state metric: one breaker per endpoint (scheme://host:port,
        never the path or query, which may carry tokens)."""
        return {f"{name} {ep.origin}": ep.breaker for name, ep in self.endpoints.items()}

    async def start(self) -> None:
        self._ensure_client()
        wanted = sum(ep.config.max_concurrency for ep in self.endpoints.values())
        if wanted > self.http.max_connections:
            # Endpoints would then wait on each other for connections: not isolated.
            log.warning(
                "relay.webhook.pool_too_small",
                max_connections=self.http.max_connections,
                sum_of_max_concurrency=wanted,
                hint="raise webhooks.max_connections",
            )

    def _ensure_client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = build_client(self.http)
        return self._client

    def available(self, destination: str) -> bool:
        ep = self.endpoints.get(destination)
        return ep is None or (ep.breaker.state is not State.OPEN and not ep.congested)

    def ready(self, destination: str) -> bool:
        return self.available(destination)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None and self._own_client:
            await client.aclose()

    # --- delivering ------------------------------------------------------------------------

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
        """One destination's rows (the Sink contract), each POSTed on its own, at most
        ``max_concurrency`` at a time."""
        if not batch:
            return []
        ep = self.endpoints[batch[0].destination]
        client = self._ensure_client()
        # Counted before the first await: the relay asks available() right after handing a
        # batch over, and must see these rows already, or it claims more for a busy endpoint.
        ep.in_hand += len(batch)
        try:
            outcomes = await asyncio.gather(*(self._attempt(client, ep, e) for e in batch))
        finally:
            ep.in_hand -= len(batch)
        self._log_group(ep, outcomes)
        return outcomes

    @staticmethod
    def _log_group(ep: Endpoint, outcomes: list[Outcome]) -> None:
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

    async def _attempt(self, client: httpx.AsyncClient, ep: Endpoint, env: Envelope) -> Outcome:
        try:
            try:
                async with asyncio.timeout(self.slot_wait):
                    await ep.semaphore.acquire()
            except TimeoutError:
                return Outcome.defer(
                    env.id,
                    f"endpoint {ep.origin} busy: no free request slot within "
                    f"{self.slot_wait:g} s (max_concurrency {ep.config.max_concurrency}); "
                    "not attempted",
                    BUSY_RETRY_IN,
                )
            try:
                # Checked after the wait for a slot: the circuit may have opened meanwhile.
                state = ep.breaker.state
                if state is State.HALF_OPEN:
                    # One probe at a time; the others wait for its verdict.
                    async with ep.probe:
                        state = ep.breaker.state
                        if state is State.HALF_OPEN:
                            return await self._send_held(client, ep, env)
                if state is State.OPEN:
                    return self._defer(ep, env)
                # It may have waited for a slot past the relay's lease: then not ours to send.
                return await self._send_held(client, ep, env)
            finally:
                ep.semaphore.release()
        except Exception as exc:
            # A bug in this sink: keep it to this row (retried later), loudly.
            log.exception("relay.webhook.unexpected_error", destination=ep.name, row=env.id)
            return Outcome.retry(env.id, truncate_error(f"relay error: {describe(exc)}"))

    async def _send_held(self, client: httpx.AsyncClient, ep: Endpoint, env: Envelope) -> Outcome:
        if not env.held():
            return Outcome.not_held(env.id)
        return await self._send(client, ep, env)

    def _defer(self, ep: Endpoint, env: Envelope) -> Outcome:
        wait = max(ep.breaker.retry_in(), 1.0)
        return Outcome.defer(
            env.id, f"circuit open for {ep.origin} (destination {ep.name!r}); not attempted", wait
        )

    def _headers(self, ep: Endpoint, env: Envelope) -> httpx.Headers | str:
        """The request headers, or why the row's headers cannot be sent."""
        headers = httpx.Headers()
        for name, value in env.headers.items():
            if name.lower() in RESERVED_HEADERS:
                continue  # would clash with what the relay sets
            problem = header_problem(name, value)
            if problem:
                return f"row header cannot be sent: {problem}"
            # Blanks around a field value are not part of it in HTTP, and h11 refuses to send
            # them: the row failed as "not sendable" although Kafka carries the same header.
            headers[name] = value.strip(" \t")
        for name, value in ep.config.headers.items():
            headers[name] = value  # the endpoint's configuration wins over a row's header
        headers["content-type"] = env.content_type
        headers["webhook-id"] = str(env.id)
        return headers

    async def _send(self, client: httpx.AsyncClient, ep: Endpoint, env: Envelope) -> Outcome:
        headers = self._headers(ep, env)
        if isinstance(headers, str):
            return Outcome.failed(env.id, truncate_error(headers))
        timestamp = int(time.time())
        headers["webhook-timestamp"] = str(timestamp)
        headers["webhook-signature"] = ep.signer.sign(str(env.id), timestamp, env.payload)

        started = time.monotonic()
        try:
            # httpx timeouts are per phase; this bounds the whole attempt.
            async with asyncio.timeout(ep.config.timeout):
                async with client.stream(
                    "POST",
                    ep.url,
                    content=env.payload,
                    headers=headers,
                    timeout=ep.timeout,
                    extensions={POLICY: ep.policy},
                ) as response:
                    body = await self._read_capped(response)
        except AddressRefused as exc:
            return Outcome.failed(
                env.id,
                truncate_error(
                    f"refused by the SSRF guard: {exc}. If this endpoint is meant to be "
                    f"internal, set allow_private_networks = true or allowed_networks = "
                    f'["<cidr>"] on destination {ep.name!r}'
                ),
            )
        except TimeoutError:
            took = time.monotonic() - started
            return self._transport_failure(
                ep,
                env,
                f"timed out after {took:.1f} s (destination timeout {ep.config.timeout:g} s)",
            )
        except httpx.LocalProtocolError as exc:
            # We could not even form the request from this row: retrying gives the same.
            return Outcome.failed(env.id, truncate_error(f"request not sendable: {describe(exc)}"))
        except httpx.HTTPError as exc:  # connect/DNS/read errors, httpx's own timeouts
            took = time.monotonic() - started
            return self._transport_failure(ep, env, f"{describe(exc)} after {took * 1000:.0f} ms")
        latency_ms = (time.monotonic() - started) * 1000
        outcome, health = self._classify(ep, env, response, body, latency_ms)
        self._record(ep, health, outcome.error)
        return outcome

    async def _read_capped(self, response: httpx.Response) -> bytes:
        cap = self.http.max_response_bytes
        body = bytearray()
        if cap:
            async for chunk in response.aiter_raw():
                body += chunk
                if len(body) >= cap:
                    break  # the rest is not read; the connection is then not reused
        return bytes(body[:cap])

    def _transport_failure(self, ep: Endpoint, env: Envelope, what: str) -> Outcome:
        error = truncate_error(f"{what} ({ep.origin})")
        self._record(ep, Health.DOWN, error)
        return Outcome.retry(env.id, error)

    def _classify(
        self,
        ep: Endpoint,
        env: Envelope,
        response: httpx.Response,
        body: bytes,
        latency_ms: float,
    ) -> tuple[Outcome, Health]:
        status = response.status_code
        if 200 <= status < 300:
            return Outcome.delivered(env.id, status_class=_class_of(status)), Health.UP
        error = f"HTTP {status} in {latency_ms:.0f} ms from {ep.origin}"
        if status in (301, 302, 303, 307, 308) and "location" in response.headers:
            error += " (redirects are not followed; point the destination at the final URL)"
        text = snippet(body)
        if text:
            error += f": {text}"
        error = truncate_error(error)

        if status == 410:
            return Outcome.failed(env.id, error, status_class=_class_of(status)), Health.UNKNOWN
        if status in TRANSIENT_STATUSES or status >= 500:
            retry_in = None
            if status in RETRY_AFTER_STATUSES:
                asked = parse_retry_after(response.headers.get("retry-after"))
                if asked is not None:
                    retry_in = min(max(asked, MIN_RETRY_AFTER), ep.config.retry_after_max)
            health = Health.UNKNOWN if status == 425 else Health.DOWN
            return Outcome.retry(env.id, error, retry_in, status_class=_class_of(status)), health
        # Other 4xx, 3xx, and odd codes: retried by default, as Svix and Hook0 do, since
        # such answers are often a deployment mistake that gets fixed.
        if ep.config.retry_client_errors:
            return Outcome.retry(env.id, error, status_class=_class_of(status)), Health.UNKNOWN
        return Outcome.failed(env.id, error, status_class=_class_of(status)), Health.UNKNOWN

    def _record(self, ep: Endpoint, health: Health, error: str | None) -> None:
        breaker = ep.breaker
        if health is Health.UP:
            if breaker.success():
                log.info("relay.webhook.circuit_closed", destination=ep.name, endpoint=ep.origin)
        elif health is Health.DOWN:
            was = breaker.state
            opened = breaker.failure()
            if opened or (was is State.HALF_OPEN and breaker.state is State.OPEN):
                log.warning(
                    "relay.webhook.circuit_opened" if opened else "relay.webhook.probe_failed",
                    destination=ep.name,
                    endpoint=ep.origin,
                    retry_in=round(breaker.retry_in(), 1),
                    error=error,
                )


__all__ = ["WebhookSink", "parse_retry_after"]


def _class_of(status: int) -> str:
    """An HTTP status as its class, the label of the attempts metric: 503 -> "5xx"."""
    return f"{status // 100}xx"
