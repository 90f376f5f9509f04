"""One signed request to one endpoint: the request path of the webhook sink and of the
endpoints sink alike.

``RequestPath.target`` builds once what is the same for every request of an endpoint (its
URL, configured headers, signer, address policy, timeouts, CloudEvents envelope, breaker and
request slots); ``RequestPath.send`` then sends one envelope there, with one of the target's
request slots held by the caller, and returns an ``Answer``: the row's outcome, and what the
endpoint answered (for a message log). The circuit (its probe, its verdict), the SSRF guard,
the timeouts and the reading of the answer (answers.py) are all here; what is done with rows
in numbers (batches, their slots and congestion for the webhook sink; claims, paces and the
message log for the endpoints sink) is the sinks' own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog
from yarl import URL

from outbox.errors import describe
from outbox.webhooks.signing import Signer
from outbox.webhooks.ssrf import AddressPolicy, AddressRefused
from relay import cloudevents
from relay.breaker import Breaker, State
from relay.model import Envelope, Outcome, truncate_error
from relay.sinks.webhook.answers import Health, classify
from relay.sinks.webhook.client import literal_refusal, pools, request_url
from relay.sinks.webhook.config import (
    RESERVED_HEADERS,
    WebhookClientSettings,
    WebhookRequestSettings,
    header_problem,
)
from relay.sinks.webhook.deadline import within
from relay.sinks.webhook.http1 import HttpError, Pool, PoolClosed, Pools, host_header

log = structlog.get_logger("relay.sink.webhook")

SENDABLE_TYPES_KEPT = 64  # content types remembered as sendable, at most
CLOSED = "not sent: the relay's request path is closed"

# Called just before a request is sent: why it must not be after all, or None.
Check = Callable[[], str | None]


@dataclass(slots=True, eq=False)
class Target:
    """Where one destination's (or one registered endpoint's) requests go, with what sends
    them there: the URL, the signer, the address policy, the breaker, the request slots.
    (The endpoints applications register are outbox.endpoints.Endpoint.)"""

    name: str
    config: WebhookRequestSettings
    url: URL
    signer: Signer
    policy: AddressPolicy
    # Seconds for the TCP + TLS set-up of a new connection: the attempt's own timer does the
    # rest (see _send).
    connect_timeout: float
    breaker: Breaker
    headers: dict[str, str]  # the configured headers, lower-cased names
    # The URL's host is an IP literal the policy refuses (aiohttp never resolves literals).
    refused: AddressRefused | None
    semaphore: asyncio.Semaphore
    # envelope = "cloudevents": the destination's, built once (None: payloads as they are).
    cloudevents: cloudevents.CloudEvents | None = None
    probe: asyncio.Lock = field(default_factory=asyncio.Lock)
    in_hand: int = 0  # rows handed to WebhookSink.deliver() for it and not yet returned
    # The request line and the Host header, built once.
    start: bytes = b""
    # The pool of its address policy, and the Pools it came from: found once, not hashed out
    # of the policy on every request.
    pool: Pool | None = None
    pools: Pools | None = None

    @property
    def origin(self) -> str:
        # Logged and stored instead of the URL: paths and queries often carry tokens.
        port = self.url.explicit_port
        host = self.url.raw_host or ""
        if ":" in host:
            host = f"[{host}]"
        return f"{self.url.scheme}://{host}" + (f":{port}" if port is not None else "")


@dataclass(slots=True, eq=False)
class Answer:
    """What came of one ``RequestPath.send``: the row's outcome and, when the endpoint
    answered, its answer."""

    outcome: Outcome
    status: int | None = None  # the HTTP status; None: no answer (not sent, transport error)
    body: bytes = b""  # the answer's first bytes, up to webhooks.max_response_bytes
    # Milliseconds from the request's start to its answer or its failure; 0.0: not sent.
    ms: float = 0.0


class RequestPath:
    """Sends one envelope to one target: signed, SSRF-guarded, within the destination's
    timeout, through the client's pools (one per address policy, opened by ``start``)."""

    def __init__(self, http: WebhookClientSettings) -> None:
        # Read when the pools open (start, or the first request): the endpoints sink
        # raises max_connections before that.
        self.http = http
        self._pools: Pools | None = None
        # Closed (the sink stopped): a request still going out is put back unattempted, and
        # opens no pools that nothing would close.
        self._closed = False
        self._sendable_types: set[str] = set()  # content types header_problem passed

    def target(
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
            connect_timeout=d.connect_timeout or self.http.connect_timeout,
            breaker=breaker
            or Breaker(d.circuit.threshold, d.circuit.cooldown, d.circuit.max_cooldown),
            semaphore=semaphore or asyncio.Semaphore(d.max_concurrency),
            headers={k.lower(): v for k, v in d.headers.items()},
            refused=literal_refusal(url.raw_host or "", policy),
            cloudevents=cloudevents.from_config(d),
            start=f"POST {url.raw_path_qs} HTTP/1.1\r\nhost: {host_header(url)}\r\n".encode(),
        )

    async def start(self) -> None:
        self._closed = False
        self._ensure_pools()
        if "max_keepalive_connections" in self.http.model_fields_set:
            log.warning(
                "relay.config.ignored",
                key="webhooks.max_keepalive_connections",
                hint="idle connections close after webhooks.keepalive_expiry; remove the setting",
            )

    async def close(self) -> None:
        self._closed = True
        opened, self._pools = self._pools, None
        if opened is not None:
            await opened.close()

    def _ensure_pools(self) -> Pools:
        if self._pools is None:
            self._pools = pools(self.http)
        return self._pools

    def _pool(self, t: Target) -> Pool:
        opened = self._ensure_pools()
        t.pool, t.pools = opened.get(t.policy), opened
        return t.pool

    async def send(self, t: Target, env: Envelope, check: Check | None = None) -> Answer:
        """Send ``env`` to ``t``, with one of its request slots held by the caller; never
        raises. ``check``, called once every wait (a circuit's probe) is over, just before
        the request, may say why the row must not be sent after all: it is then deferred,
        unattempted, with that reason."""
        if self._closed:
            return Answer(Outcome.defer(env.id, CLOSED, 0.0))
        client = t.pool
        if client is None or t.pools is not self._pools:
            client = self._pool(t)  # the first request, or the pools were reopened
        try:
            # Checked after the wait for a slot: the circuit may have opened meanwhile.
            state = t.breaker.state
            if state is State.HALF_OPEN:
                # One probe at a time; the others wait for its verdict.
                async with t.probe:
                    state = t.breaker.state
                    if state is State.HALF_OPEN:
                        return await self._send_held(client, t, env, check)
            if state is State.OPEN:
                return Answer(self._defer(t, env))
            # It may have waited for a slot past the relay's lease: then not ours to send.
            return await self._send_held(client, t, env, check)
        except Exception as exc:
            # A bug in the request path: keep it to this row (retried later), loudly.
            log.exception("relay.webhook.unexpected_error", destination=t.name, row=env.id)
            return Answer(Outcome.retry(env.id, truncate_error(f"relay error: {describe(exc)}")))

    async def _send_held(
        self,
        client: Pool,
        t: Target,
        env: Envelope,
        check: Check | None,
    ) -> Answer:
        if not env.held():
            return Answer(Outcome.not_held(env.id))
        if check is not None and (why := check()) is not None:
            return Answer(Outcome.defer(env.id, why, 0.0))
        return await self._send(client, t, env)

    @staticmethod
    def _defer(t: Target, env: Envelope) -> Outcome:
        wait = max(t.breaker.retry_in(), 1.0)
        return Outcome.defer(
            env.id, f"circuit open for {t.origin} (destination {t.name!r}); not attempted", wait
        )

    def headers(self, t: Target, env: Envelope) -> dict[str, str] | str:
        """The request headers (before its timestamp and signature), or why the row's
        headers cannot be sent."""
        # What a row's or the configuration's headers may replace.
        headers = {"user-agent": self.http.user_agent, "accept-encoding": "identity"}
        if env.headers:
            ce = t.cloudevents
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
        headers.update(t.headers)  # the endpoint's configuration wins over a row's header
        # A row written with plain SQL may hold anything in content_type (enqueue refuses it).
        # Checked once per value: a relay sees a handful, and this is every request's path.
        ct = env.content_type
        if ct not in self._sendable_types:
            problem = header_problem("content-type", ct)
            if problem:
                return f"row content_type cannot be sent: {problem}"
            if len(self._sendable_types) < SENDABLE_TYPES_KEPT:
                self._sendable_types.add(ct)
        headers["content-type"] = ct
        # Signed as it is sent (see _send), so the prefix is part of the signed id. Read from
        # the [webhooks] settings here, the one request path of webhook and endpoints
        # destinations alike.
        prefix = self.http.id_prefix
        headers["webhook-id"] = prefix + str(env.id) if prefix else str(env.id)
        return headers

    def _request(self, t: Target, env: Envelope) -> tuple[dict[str, str], bytes] | Answer:
        """The signed request's headers and body, or the Answer of a row that cannot be sent."""
        if t.refused is not None:
            return Answer(self._refused(t, env, t.refused))
        headers = self.headers(t, env)
        if isinstance(headers, str):
            return Answer(Outcome.failed(env.id, truncate_error(headers)))
        body = env.payload
        if t.cloudevents is not None:
            try:
                body = t.cloudevents.http(env, headers)
            except cloudevents.NotSendable as exc:
                return Answer(Outcome.failed(env.id, truncate_error(str(exc))))
        timestamp = int(time.time())
        headers["webhook-timestamp"] = str(timestamp)
        # Signed over exactly the bytes sent: the CloudEvent document in structured mode.
        headers["webhook-signature"] = t.signer.sign(headers["webhook-id"], timestamp, body)
        return headers, body

    async def _send(self, client: Pool, t: Target, env: Envelope) -> Answer:
        request = self._request(t, env)
        if isinstance(request, Answer):
            return request
        headers, body = request
        try:
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            if head.count("\n") != len(headers) or head.count("\r") != len(headers):
                # Every value was checked where it came from; this is the last line against
                # one that adds a header of its own (request smuggling), wherever it came from.
                raise ValueError("a header value holds a line break")
            data = [t.start, f"{head}content-length: {len(body)}\r\n\r\n".encode(), body]
        except (UnicodeEncodeError, ValueError) as exc:
            # A configured header's text (a row's is checked in headers()).
            return Answer(
                Outcome.failed(env.id, truncate_error(f"request not sendable: {describe(exc)}"))
            )
        started = time.monotonic()
        try:
            # One timer bounds the whole attempt: the wait for a pooled connection, the DNS
            # lookup (in the connect step), the request and the answer's read.
            response = await within(
                t.config.timeout,
                client.request(t.url, data, self.http.max_response_bytes, t.connect_timeout),
            )
        except AddressRefused as exc:
            return Answer(self._refused(t, env, exc), ms=(time.monotonic() - started) * 1000)
        except TimeoutError:
            took = time.monotonic() - started
            return self._transport_failure(
                t,
                env,
                f"timed out after {took:.1f} s (destination timeout {t.config.timeout:g} s)",
                took,
            )
        except PoolClosed:
            # Closed (the sink stops) before the request went out: not an attempt.
            return Answer(Outcome.defer(env.id, CLOSED, 0.0))
        except (HttpError, OSError) as exc:
            # Connect, DNS, TLS (an untrusted certificate gets fixed: a retry, and the endpoint
            # counted down), read errors and answers that are not HTTP.
            took = time.monotonic() - started
            text = str(exc) if isinstance(exc, HttpError) else describe(exc)
            return self._transport_failure(t, env, f"{text} after {took * 1000:.0f} ms", took)
        latency_ms = (time.monotonic() - started) * 1000
        body = response.body
        outcome, health = classify(env, response, body, latency_ms, t.origin, t.config)
        self._record(t, health, outcome.error)
        return Answer(outcome, response.status, body, latency_ms)

    @staticmethod
    def _refused(t: Target, env: Envelope, exc: AddressRefused) -> Outcome:
        return Outcome.failed(
            env.id,
            truncate_error(
                f"refused by the SSRF guard: {exc}. If this endpoint is meant to be "
                f"internal, set allow_private_networks = true or allowed_networks = "
                # An endpoint registered at runtime is named "destination#id".
                f'["<cidr>"] on destination {t.name.partition("#")[0]!r}'
            ),
        )

    def _transport_failure(self, t: Target, env: Envelope, what: str, took: float) -> Answer:
        error = truncate_error(f"{what} ({t.origin})")
        self._record(t, Health.DOWN, error)
        return Answer(Outcome.retry(env.id, error), ms=took * 1000)

    @staticmethod
    def _record(t: Target, health: Health, error: str | None) -> None:
        breaker = t.breaker
        if health is Health.UP:
            if breaker.success():
                log.info("relay.webhook.circuit_closed", destination=t.name, endpoint=t.origin)
        elif health is Health.DOWN:
            was = breaker.state
            opened = breaker.failure()
            if opened or (was is State.HALF_OPEN and breaker.state is State.OPEN):
                log.warning(
                    "relay.webhook.circuit_opened" if opened else "relay.webhook.probe_failed",
                    destination=t.name,
                    endpoint=t.origin,
                    retry_in=round(breaker.retry_in(), 1),
                    error=error,
                )


__all__ = ["Answer", "Check", "RequestPath", "Target"]
