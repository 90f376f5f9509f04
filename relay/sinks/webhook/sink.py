"""Delivering envelopes to HTTP webhooks, signed the Standard Webhooks way.

Each destination is an *endpoint* with its own concurrency limit and circuit breaker, and a
batch is split per endpoint with the groups running concurrently: a slow or dead endpoint
holds only its own rows. Every request goes through one shared, SSRF-guarded client
(client.py). What is the same for every request of an endpoint (its URL, configured headers,
timeouts, its CloudEvents envelope) is built once, so a request costs its signature and little
else.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
import structlog
from yarl import URL

from outbox.errors import describe
from outbox.webhooks.signing import Signer
from outbox.webhooks.ssrf import AddressPolicy, AddressRefused
from relay import cloudevents
from relay.breaker import Breaker, State
from relay.model import Envelope, Outcome, truncate_error
from relay.sinks import SinkBase, misrouted
from relay.sinks.webhook.answers import Health, classify, parse_retry_after, transport_text
from relay.sinks.webhook.client import Sessions, literal_refusal, request_url
from relay.sinks.webhook.config import (
    RESERVED_HEADERS,
    WebhookClientSettings,
    WebhookDestination,
    WebhookRequestSettings,
    header_problem,
)

log = structlog.get_logger("relay.sink.webhook")

# Called just before a request is sent: why it must not be after all, or None.
Check = Callable[[], str | None]
# Called with each answer received (row, HTTP status, body, latency in ms): a sink that keeps
# a message log of its own (the endpoints sink) takes them there.
Answered = Callable[[Envelope, int, bytes, float], None]

# An endpoint holding this many times its max_concurrency in rows is not offered more.
CONGESTION_FACTOR = 4
BUSY_RETRY_IN = 1.0


@dataclass(eq=False)
class Target:
    """Where one destination's (or one registered endpoint's) requests go, with what sends
    them there: the URL, the signer, the address policy, the breaker, the request slots.
    (The endpoints applications register are outbox.endpoints.Endpoint.)"""

    name: str
    config: WebhookRequestSettings
    url: URL
    signer: Signer
    policy: AddressPolicy
    timeout: aiohttp.ClientTimeout
    breaker: Breaker
    headers: dict[str, str]  # the configured headers, lower-cased names
    # The URL's host is an IP literal the policy refuses (aiohttp never resolves literals).
    refused: AddressRefused | None
    semaphore: asyncio.Semaphore
    # envelope = "cloudevents": the destination's, built once (None: payloads as they are).
    cloudevents: cloudevents.CloudEvents | None = None
    probe: asyncio.Lock = field(default_factory=asyncio.Lock)
    in_hand: int = 0  # rows handed to deliver() for this endpoint and not yet returned

    @property
    def congested(self) -> bool:
        return self.in_hand >= self.config.max_concurrency * CONGESTION_FACTOR

    @property
    def origin(self) -> str:
        # Logged and stored instead of the URL: paths and queries often carry tokens.
        port = self.url.explicit_port
        host = self.url.raw_host or ""
        if ":" in host:
            host = f"[{host}]"
        return f"{self.url.scheme}://{host}" + (f":{port}" if port is not None else "")


def _unheard(env: Envelope, status: int, body: bytes, latency_ms: float) -> None:
    """No message log: an answer is read for its outcome alone."""


class WebhookSink(SinkBase):
    """POSTs each envelope to its destination's URL; one outcome per envelope, never raises."""

    kind = "webhook"

    def __init__(
        self,
        http: WebhookClientSettings,
        destinations: Mapping[str, WebhookDestination],
        *,
        slot_wait: float = 5.0,
        on_answer: Answered | None = None,
    ) -> None:
        """``slot_wait``: seconds a row waits for one of its endpoint's request slots;
        ``on_answer``: see Answered.

        The relay records a batch's outcomes when ``deliver`` returns, so rows queued behind
        a slow endpoint would hold every other endpoint's results (and the relay's in-flight
        capacity). Rows that get no slot in time are deferred instead, unattempted.
        """
        self.http = http
        self.slot_wait = slot_wait
        self.on_answer: Answered = on_answer or _unheard
        self.endpoints = {name: self._endpoint(name, d) for name, d in destinations.items()}
        self._sessions: Sessions | None = None
        # Set to a list to collect each answered request's latency in ms (the benchmark).
        self.latencies: list[float] | None = None

    def _endpoint(self, name: str, d: WebhookDestination) -> Target:
        return self.endpoint(name, d, d.url, d.signing_keys())

    def endpoint(
        self,
        name: str,
        d: WebhookRequestSettings,
        url_text: str,
        keys: Sequence[bytes],
        *,
        breaker: Breaker | None = None,
        semaphore: asyncio.Semaphore | None = None,
    ) -> Target:
        """An endpoint to send to: ``url_text`` signed with ``keys``, under ``d``'s rules.
        ``breaker`` and ``semaphore``: kept from an earlier version of the endpoint (one
        registered at runtime whose URL or secret changed)."""
        url = request_url(url_text)
        policy = AddressPolicy(d.allow_private_networks, tuple(d.allowed_networks))
        return Target(
            name=name,
            config=d,
            url=url,
            signer=Signer(keys),
            policy=policy,
            # Only the TCP + TLS set-up of a new connection: the attempt's own timer does the
            # rest (see _send).
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=None,
                sock_connect=d.connect_timeout or self.http.connect_timeout,
            ),
            breaker=breaker
            or Breaker(d.circuit.threshold, d.circuit.cooldown, d.circuit.max_cooldown),
            semaphore=semaphore or asyncio.Semaphore(d.max_concurrency),
            headers={k.lower(): v for k, v in d.headers.items()},
            refused=literal_refusal(url.raw_host or "", policy),
            cloudevents=cloudevents.from_config(d),
        )

    def circuits(self) -> dict[str, Breaker]:
        """For the outbox_circuit_state metric: one breaker per endpoint (scheme://host:port,
        never the path or query, which may carry tokens)."""
        return {f"{name} {ep.origin}": ep.breaker for name, ep in self.endpoints.items()}

    def breakers_of(self, destination: str) -> Sequence[Breaker]:
        endpoint = self.endpoints.get(destination)
        return (endpoint.breaker,) if endpoint is not None else ()

    async def start(self) -> None:
        self._ensure_sessions()
        if "max_keepalive_connections" in self.http.model_fields_set:
            log.warning(
                "relay.config.ignored",
                key="webhooks.max_keepalive_connections",
                hint="idle connections close after webhooks.keepalive_expiry; remove the setting",
            )
        wanted = sum(ep.config.max_concurrency for ep in self.endpoints.values())
        if wanted > self.http.max_connections:
            # Endpoints would then wait on each other for connections: not isolated.
            log.warning(
                "relay.webhook.pool_too_small",
                max_connections=self.http.max_connections,
                sum_of_max_concurrency=wanted,
                hint="raise webhooks.max_connections",
            )

    def _ensure_sessions(self) -> Sessions:
        if self._sessions is None:
            self._sessions = Sessions(self.http)
        return self._sessions

    def available(self, destination: str) -> bool:
        ep = self.endpoints.get(destination)
        return ep is None or (ep.breaker.state is not State.OPEN and not ep.congested)

    def ready(self, destination: str) -> bool:
        return self.available(destination)

    async def close(self) -> None:
        sessions, self._sessions = self._sessions, None
        if sessions is not None:
            await sessions.close()

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
        client = self._ensure_sessions().get(ep.policy)
        # Counted before the first await: the relay asks available() right after handing a
        # batch over, and must see these rows already, or it claims more for a busy endpoint.
        ep.in_hand += len(batch)
        try:
            outcomes = await self._walk(client, ep, batch)
        finally:
            ep.in_hand -= len(batch)
        self._log_group(ep, outcomes)
        return outcomes

    async def _walk(
        self, client: aiohttp.ClientSession, ep: Target, batch: Sequence[Envelope]
    ) -> list[Outcome]:
        """Up to ``max_concurrency`` workers walk the batch in order, each taking one of the
        endpoint's request slots before its next row: a few tasks per batch, not one per row.
        Rows no worker started within ``slot_wait`` (the endpoint was busy with other
        batches) are deferred, unattempted."""
        outcomes: list[Outcome | None] = [None] * len(batch)
        rows = iter(range(len(batch)))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.slot_wait

        async def worker() -> None:
            while await self._slot(ep, deadline):
                try:
                    # A row not started by the deadline is deferred, even when this worker
                    # has a slot: it would wait behind the endpoint's pace for its turn.
                    i = next(rows, None) if loop.time() < deadline else None
                    if i is None:
                        return
                    outcomes[i] = await self._attempt(client, ep, batch[i])
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

    async def _attempt(
        self,
        client: aiohttp.ClientSession,
        ep: Target,
        env: Envelope,
        check: Check | None = None,
    ) -> Outcome:
        """One row, with a request slot held."""
        try:
            # Checked after the wait for a slot: the circuit may have opened meanwhile.
            state = ep.breaker.state
            if state is State.HALF_OPEN:
                # One probe at a time; the others wait for its verdict.
                async with ep.probe:
                    state = ep.breaker.state
                    if state is State.HALF_OPEN:
                        return await self._send_held(client, ep, env, check)
            if state is State.OPEN:
                return self._defer(ep, env)
            # It may have waited for a slot past the relay's lease: then not ours to send.
            return await self._send_held(client, ep, env, check)
        except Exception as exc:
            # A bug in this sink: keep it to this row (retried later), loudly.
            log.exception("relay.webhook.unexpected_error", destination=ep.name, row=env.id)
            return Outcome.retry(env.id, truncate_error(f"relay error: {describe(exc)}"))

    async def attempt(self, ep: Target, env: Envelope, check: Check | None = None) -> Outcome:
        """Send one row to ``ep``, with one of its request slots held by the caller; one
        outcome, never raises. ``check``, called once every wait (a circuit's probe) is over,
        just before the request, may say why the row must not be sent after all: it is then
        deferred, unattempted, with that reason."""
        return await self._attempt(self._ensure_sessions().get(ep.policy), ep, env, check)

    async def _send_held(
        self,
        client: aiohttp.ClientSession,
        ep: Target,
        env: Envelope,
        check: Check | None = None,
    ) -> Outcome:
        if not env.held():
            return Outcome.not_held(env.id)
        if check is not None and (why := check()) is not None:
            return Outcome.defer(env.id, why, 0.0)
        return await self._send(client, ep, env)

    def _defer(self, ep: Target, env: Envelope) -> Outcome:
        wait = max(ep.breaker.retry_in(), 1.0)
        return Outcome.defer(
            env.id, f"circuit open for {ep.origin} (destination {ep.name!r}); not attempted", wait
        )

    def _headers(self, ep: Target, env: Envelope) -> dict[str, str] | str:
        """The request headers, or why the row's headers cannot be sent."""
        headers: dict[str, str] = {}
        if env.headers:
            ce = ep.cloudevents
            for name, value in env.headers.items():
                lower = name.lower()
                if lower in RESERVED_HEADERS:
                    continue  # would clash with what the relay sets
                if ce is not None and lower.startswith("ce-"):
                    # An extension attribute (binary mode), if a valid one the relay does not
                    # set; its value %-encoded as the relay's own attributes (exactly the
                    # row's value once decoded). Structured: none (receivers would read the
                    # request as binary).
                    attr = ce.row_attribute(env, name, value)
                    if attr is not None:
                        headers["ce-" + attr] = cloudevents.http_header_value(value)
                    continue
                problem = header_problem(name, value)
                if problem:
                    return f"row header cannot be sent: {problem}"
                # Blanks around a field value are not part of it in HTTP; a row failed as
                # "not sendable" for them once, although Kafka carries the same header.
                headers[lower] = value.strip(" \t")
        headers.update(ep.headers)  # the endpoint's configuration wins over a row's header
        headers["content-type"] = env.content_type
        # Signed as it is sent (see _send), so the prefix is part of the signed id. Read from
        # the [webhooks] settings here, the one request path of webhook and endpoints
        # destinations alike.
        prefix = self.http.id_prefix
        headers["webhook-id"] = prefix + str(env.id) if prefix else str(env.id)
        return headers

    async def _send(self, client: aiohttp.ClientSession, ep: Target, env: Envelope) -> Outcome:
        if ep.refused is not None:
            return self._refused(ep, env, ep.refused)
        headers = self._headers(ep, env)
        if isinstance(headers, str):
            return Outcome.failed(env.id, truncate_error(headers))
        body = env.payload
        if ep.cloudevents is not None:
            try:
                body = ep.cloudevents.http(env, headers)
            except cloudevents.NotSendable as exc:
                return Outcome.failed(env.id, truncate_error(str(exc)))
        timestamp = int(time.time())
        headers["webhook-timestamp"] = str(timestamp)
        # Signed over exactly the bytes sent: the CloudEvent document in structured mode.
        headers["webhook-signature"] = ep.signer.sign(headers["webhook-id"], timestamp, body)

        started = time.monotonic()
        try:
            # One timer bounds the whole attempt: the wait for a pooled connection, the DNS
            # lookup (our resolver runs in the connect step), the request and the body read.
            # aiohttp's own total and connect timeouts would arm two more per request.
            async with asyncio.timeout(ep.config.timeout):
                async with client.post(
                    ep.url,
                    data=body,
                    headers=headers,
                    timeout=ep.timeout,
                    allow_redirects=False,
                ) as response:
                    body = await self._read_capped(response)
        except AddressRefused as exc:
            return self._refused(ep, env, exc)
        except TimeoutError:
            took = time.monotonic() - started
            return self._transport_failure(
                ep,
                env,
                f"timed out after {took:.1f} s (destination timeout {ep.config.timeout:g} s)",
            )
        except aiohttp.InvalidURL as exc:
            return Outcome.failed(env.id, truncate_error(f"request not sendable: {describe(exc)}"))
        except (aiohttp.ClientError, OSError) as exc:
            # Connect, DNS, TLS (an untrusted certificate gets fixed: a retry, and the endpoint
            # counted down) and read errors. Before ValueError: aiohttp's certificate error is
            # one too.
            took = time.monotonic() - started
            return self._transport_failure(
                ep, env, f"{transport_text(exc)} after {took * 1000:.0f} ms"
            )
        except ValueError as exc:
            # We could not even form the request from this row: retrying gives the same.
            return Outcome.failed(env.id, truncate_error(f"request not sendable: {describe(exc)}"))
        latency_ms = (time.monotonic() - started) * 1000
        if self.latencies is not None:
            self.latencies.append(latency_ms)
        self.on_answer(env, response.status, body, latency_ms)
        outcome, health = classify(env, response, body, latency_ms, ep.origin, ep.config)
        self._record(ep, health, outcome.error)
        return outcome

    @staticmethod
    def _refused(ep: Target, env: Envelope, exc: AddressRefused) -> Outcome:
        return Outcome.failed(
            env.id,
            truncate_error(
                f"refused by the SSRF guard: {exc}. If this endpoint is meant to be "
                f"internal, set allow_private_networks = true or allowed_networks = "
                # An endpoint registered at runtime is named "destination#id".
                f'["<cidr>"] on destination {ep.name.partition("#")[0]!r}'
            ),
        )

    async def _read_capped(self, response: aiohttp.ClientResponse) -> bytes:
        cap = self.http.max_response_bytes
        body = bytearray()
        while len(body) < cap:
            chunk = await response.content.read(cap - len(body))
            if not chunk:
                break
            body += chunk
        # Unread bytes, if any, are not drained: the connection is closed instead of reused.
        return bytes(body)

    def _transport_failure(self, ep: Target, env: Envelope, what: str) -> Outcome:
        error = truncate_error(f"{what} ({ep.origin})")
        self._record(ep, Health.DOWN, error)
        return Outcome.retry(env.id, error)

    def _record(self, ep: Target, health: Health, error: str | None) -> None:
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
