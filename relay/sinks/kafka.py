"""Delivering envelopes to Kafka with one aiokafka producer per relay."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    UnsupportedForMessageFormatError,
)
from aiokafka.helpers import create_ssl_context

from relay.breaker import Breaker
from relay.config import KafkaDestination, KafkaSettings
from relay.model import Envelope, Outcome, truncate_error

log = structlog.get_logger("relay.sink.kafka")

# Errors about the message or the topic itself: sending it again gives the same answer.
PERMANENT: tuple[type[BaseException], ...] = (
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    InvalidTopicError,
    TopicAuthorizationFailedError,
    ClusterAuthorizationFailedError,
    UnsupportedForMessageFormatError,
)

OUTBOX_ID = "outbox-id"
CONTENT_TYPE = "content-type"


def describe(exc: BaseException) -> str:
    name = type(exc).__name__
    text = str(exc)
    return f"{name}: {text}" if text and text != name else name


def producer_options(cfg: KafkaSettings) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "bootstrap_servers": cfg.bootstrap_servers,
        "client_id": cfg.client_id,
        "acks": cfg.acks,
        "enable_idempotence": cfg.enable_idempotence,
        "compression_type": cfg.compression_type,
        "linger_ms": cfg.linger_ms,
        "max_batch_size": cfg.max_batch_size,
        "max_request_size": cfg.max_request_size,
        "request_timeout_ms": cfg.request_timeout_ms,
        "security_protocol": cfg.security_protocol,
    }
    if cfg.sasl_mechanism:
        opts["sasl_mechanism"] = cfg.sasl_mechanism
        opts["sasl_plain_username"] = cfg.sasl_plain_username
        if cfg.sasl_plain_password is not None:
            opts["sasl_plain_password"] = cfg.sasl_plain_password.get_secret_value()
    if cfg.security_protocol in ("SSL", "SASL_SSL"):
        ctx: ssl.SSLContext = create_ssl_context(
            cafile=cfg.ssl_cafile, certfile=cfg.ssl_certfile, keyfile=cfg.ssl_keyfile
        )
        opts["ssl_context"] = ctx
    return opts


class KafkaSink:
    """Sends a whole batch, then awaits every result: one slow ack does not serialise the rest.

    When the cluster is unreachable the sink's breaker opens, so the relay stops claiming rows
    for Kafka destinations (they wait as pending, no attempt spent) and probes again later.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        destinations: Mapping[str, KafkaDestination],
        *,
        breaker: Breaker | None = None,
    ) -> None:
        self.settings = settings
        self.topics = {name: d.topic for name, d in destinations.items()}
        self.breaker = breaker or Breaker(threshold=1, cooldown=2.0, max_cooldown=60.0)
        self._producer: AIOKafkaProducer | None = None
        self._start_lock = asyncio.Lock()

    async def start(self) -> None:
        # A broker that is down at start-up must not stop the relay: the first delivery tries
        # again, and until then the breaker keeps Kafka rows pending.
        try:
            await self._ensure_started()
        except (KafkaError, OSError) as exc:
            self._unavailable(exc)

    async def _ensure_started(self) -> AIOKafkaProducer:
        async with self._start_lock:
            if self._producer is None:
                producer = AIOKafkaProducer(**producer_options(self.settings))
                try:
                    await producer.start()
                except BaseException:
                    await producer.stop()
                    raise
                self._producer = producer
                log.info("relay.sink.connected", sink="kafka", bootstrap=self.bootstrap)
            return self._producer

    @property
    def bootstrap(self) -> str:
        b = self.settings.bootstrap_servers
        return b if isinstance(b, str) else ",".join(b)

    def available(self, destination: str) -> bool:
        return self.breaker.allows()

    def _unavailable(self, exc: BaseException) -> None:
        if self.breaker.failure():
            log.warning(
                "relay.sink.unavailable",
                sink="kafka",
                bootstrap=self.bootstrap,
                error=describe(exc),
                retry_in=round(self.breaker.retry_in(), 1),
            )

    def _recovered(self) -> None:
        if self.breaker.success():
            log.info("relay.sink.recovered", sink="kafka", bootstrap=self.bootstrap)

    @staticmethod
    def _headers(env: Envelope) -> list[tuple[str, bytes]]:
        hs = [(k, v.encode()) for k, v in env.headers.items() if k not in (OUTBOX_ID, CONTENT_TYPE)]
        hs.append((OUTBOX_ID, str(env.id).encode()))
        hs.append((CONTENT_TYPE, env.content_type.encode()))
        return hs

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
        try:
            producer = await self._ensure_started()
        except (KafkaError, OSError) as exc:
            self._unavailable(exc)
            wait = max(self.breaker.retry_in(), 1.0)
            reason = f"Kafka unreachable at {self.bootstrap}: {describe(exc)}"
            return [Outcome.defer(e.id, reason, wait) for e in batch]

        outcomes: list[Outcome] = []
        pending: list[tuple[Envelope, asyncio.Future[Any]]] = []
        broken: BaseException | None = None
        for env in batch:
            if broken is not None:
                # The client could not even queue a message (metadata timeout, closed
                # producer): the rest would each wait the same timeout. Retry them later.
                outcomes.append(Outcome.retry(env.id, f"not sent: {describe(broken)}"))
                continue
            topic = self.topics.get(env.destination)
            if topic is None:
                outcomes.append(
                    Outcome.failed(env.id, f"destination {env.destination!r} is not a Kafka one")
                )
                continue
            try:
                fut = await producer.send(
                    topic,
                    value=env.payload,
                    key=env.key.encode() if env.key is not None else None,
                    headers=self._headers(env),
                )
            except PERMANENT as exc:
                outcomes.append(Outcome.failed(env.id, truncate_error(describe(exc))))
            except (KafkaError, OSError) as exc:
                broken = exc
                outcomes.append(Outcome.retry(env.id, truncate_error(describe(exc))))
            else:
                pending.append((env, fut))

        results = await asyncio.gather(*(f for _, f in pending), return_exceptions=True)
        transient = 0
        for (env, _), res in zip(pending, results, strict=True):
            if not isinstance(res, BaseException):
                outcomes.append(Outcome.delivered(env.id))
            elif isinstance(res, PERMANENT):
                outcomes.append(Outcome.failed(env.id, truncate_error(describe(res))))
            elif isinstance(res, asyncio.CancelledError):
                raise res
            else:
                transient += 1
                outcomes.append(Outcome.retry(env.id, truncate_error(describe(res))))

        sent_ok = len(pending) - transient
        if broken is not None or (transient and not sent_ok):
            self._unavailable(broken or next(r for r in results if isinstance(r, BaseException)))
        elif sent_ok:
            self._recovered()
        return outcomes

    async def close(self) -> None:
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await producer.stop()
