"""Delivering envelopes to Kafka with one aiokafka producer per relay."""

from __future__ import annotations

import asyncio
import ssl
import time
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
    UnknownTopicOrPartitionError,
    UnsupportedForMessageFormatError,
)
from aiokafka.helpers import create_ssl_context
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from outbox.errors import describe
from relay import cloudevents
from relay.breaker import Breaker
from relay.model import Envelope, Outcome, Result, truncate_error
from relay.sinks import SinkBase, misrouted
from relay.sinks.kafka.config import KafkaDestination, KafkaSettings
from relay.sinks.kafka.partitioner import Partitioner

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

# Errors about one topic, not the cluster: they stay with that topic's rows and never open
# the circuit that all Kafka destinations share.
TOPIC_ERRORS: tuple[type[BaseException], ...] = (
    UnknownTopicOrPartitionError,
    InvalidTopicError,
    TopicAuthorizationFailedError,
)

# A message ready to send: its row, key, value and headers.
_Item = tuple[Envelope, bytes | None, bytes, list[tuple[str, bytes]]]
REFUSED_TOPIC_TTL = 30.0

DELIVERED = Result.DELIVERED

OUTBOX_ID = "outbox-id"
CONTENT_TYPE = "content-type"


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


class KafkaSink(SinkBase):
    """Sends a whole batch, then awaits every result: one slow ack does not serialise the rest.

    When the cluster is unreachable the sink's breaker opens, so the relay stops claiming rows
    for Kafka destinations (they wait as pending, no attempt spent) and probes again later.
    """

    kind = "kafka"

    def __init__(
        self,
        settings: KafkaSettings,
        destinations: Mapping[str, KafkaDestination],
        *,
        breaker: Breaker | None = None,
    ) -> None:
        self.settings = settings
        self.topics = {name: d.topic for name, d in destinations.items()}
        # envelope = "cloudevents": built once per destination (None: payloads as they are).
        self.cloudevents = {name: cloudevents.from_config(d) for name, d in destinations.items()}
        self.breaker = breaker or Breaker(threshold=1, cooldown=2.0, max_cooldown=60.0)
        self._producer: AIOKafkaProducer | None = None
        # Topics the cluster answered it does not have or refuses: their rows are not held
        # up by another metadata wait (a request timeout each) for a while.
        self._refused: dict[str, tuple[BaseException, float]] = {}
        self._partitioner = Partitioner()
        self._start_lock = asyncio.Lock()

    async def start(self) -> None:
        # A broker that is down at start-up must not stop the relay: the first delivery tries
        # again, and until then the breaker keeps Kafka rows pending. The same for anything
        # else the producer raises while starting (settings validation refuses what it can
        # foresee): the relay stays up, logs why, and holds no Kafka rows.
        try:
            await self._ensure_started()
        except Exception as exc:
            self._unavailable(exc)

    async def _ensure_started(self) -> AIOKafkaProducer:
        async with self._start_lock:
            if self._producer is None:
                producer = AIOKafkaProducer(
                    **producer_options(self.settings), partitioner=self._partitioner
                )
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

    def ready(self, destination: str) -> bool:
        """For /readyz: the producer is connected and its circuit is not open."""
        return self._producer is not None and self.breaker.allows()

    def circuits(self) -> dict[str, Breaker]:
        """For the outbox_circuit_state metric: one breaker for the whole cluster."""
        return {self.bootstrap: self.breaker}

    def breakers_of(self, destination: str) -> Sequence[Breaker]:
        """Every Kafka destination stands or falls with the cluster."""
        return (self.breaker,) if destination in self.topics else ()

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
        if not env.headers:  # most rows
            return [(OUTBOX_ID, str(env.id).encode()), (CONTENT_TYPE, env.content_type.encode())]
        hs = [(k, v.encode()) for k, v in env.headers.items() if k not in (OUTBOX_ID, CONTENT_TYPE)]
        hs.append((OUTBOX_ID, str(env.id).encode()))
        hs.append((CONTENT_TYPE, env.content_type.encode()))
        return hs

    @staticmethod
    def _message(
        env: Envelope, ce: cloudevents.CloudEvents | None
    ) -> tuple[bytes, list[tuple[str, bytes]]]:
        """The value and headers of ``env``'s message; raises cloudevents.NotSendable."""
        if ce is None:
            return env.payload, KafkaSink._headers(env)
        # The row's own headers stay, but its ce_ headers only as valid extension attributes
        # the relay does not set (binary mode), under their lower-case name: readers refuse
        # the whole event for any other. Structured: none (readers would take it as binary).
        hs: list[tuple[str, bytes]] = []
        attrs: set[str] = set()
        for k, v in env.headers.items():
            if k in (OUTBOX_ID, CONTENT_TYPE):
                continue
            if k[:3].lower() == "ce_":
                attr = ce.row_attribute(env, k, v)
                if attr is not None and attr not in attrs:  # ce_X and ce_x: the first
                    attrs.add(attr)
                    hs.append(("ce_" + attr, v.encode()))
                continue
            hs.append((k, v.encode()))
        value = ce.kafka(env, hs)
        hs.append((OUTBOX_ID, str(env.id).encode()))
        ctype = cloudevents.STRUCTURED_CONTENT_TYPE if ce.structured else env.content_type
        hs.append((CONTENT_TYPE, ctype.encode()))
        return value, hs

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
        if not batch:
            return []
        dest = batch[0].destination
        if dest not in self.topics or any(e.destination != dest for e in batch):
            return await misrouted(batch, self.topics, "Kafka", self.deliver)
        try:
            producer = await self._ensure_started()
        except Exception as exc:
            self._unavailable(exc)
            wait = max(self.breaker.retry_in(), 1.0)
            reason = f"Kafka unavailable at {self.bootstrap}: {describe(exc)}"
            return [Outcome.defer(e.id, reason, wait) for e in batch]

        topic = self.topics[dest]  # one destination per batch: one topic
        outcomes: list[Outcome] = []
        groups, broken = await self._partition(producer, topic, batch, outcomes)
        sends: list[tuple[asyncio.Future[Any], list[_Item]]] = []
        singles: list[_Item] = []
        for partition, items in groups.items():
            if broken is not None:
                outcomes.extend(self._not_sent(item[0], broken) for item in items)
                continue
            try:
                await self._send_batches(producer, topic, partition, items, sends, singles)
            except (KafkaError, OSError) as exc:
                broken = exc
                sent = {i[0].id for _, sent_items in sends for i in sent_items}
                sent |= {i[0].id for i in singles}
                outcomes.extend(
                    self._not_sent(item[0], exc) for item in items if item[0].id not in sent
                )

        results = await asyncio.gather(*(f for f, _ in sends), return_exceptions=True)
        failures: list[BaseException] = []
        for (_, sent_items), res in zip(sends, results, strict=True):
            if not isinstance(res, BaseException):
                outcomes.extend([Outcome(i[0].id, DELIVERED) for i in sent_items])
            elif isinstance(res, asyncio.CancelledError):
                raise res
            elif isinstance(res, PERMANENT) and len(sent_items) > 1:
                # The broker refused the batch as a whole (e.g. its size): find the message at
                # fault by sending them one by one, so the others are not failed with it.
                singles.extend(sent_items)
            else:
                failures.append(res)
                outcomes.extend(self._outcome_for(i[0].id, res) for i in sent_items)
        if singles:
            single_outcomes = await self._send_singly(producer, topic, singles)
            failures.extend(o_exc for _, o_exc in single_outcomes if o_exc is not None)
            outcomes.extend(o for o, _ in single_outcomes)

        delivered = any(o.result is Result.DELIVERED for o in outcomes)
        transient = [f for f in failures if not isinstance(f, (*PERMANENT, *TOPIC_ERRORS))]
        if broken is not None or (transient and not delivered):
            self._unavailable(broken or transient[0])
        elif delivered:
            self._recovered()
        return outcomes

    def _not_sent(self, env: Envelope, exc: BaseException) -> Outcome:
        return Outcome.retry(env.id, truncate_error(f"not sent: {describe(exc)}"))

    @staticmethod
    def _outcome_for(id: int, exc: BaseException) -> Outcome:
        if isinstance(exc, PERMANENT):
            return Outcome.failed(id, truncate_error(describe(exc)))
        return Outcome.retry(id, truncate_error(describe(exc)))

    def _recently_refused(self, topic: str) -> BaseException | None:
        entry = self._refused.get(topic)
        if entry is None or entry[1] < time.monotonic():
            self._refused.pop(topic, None)
            return None
        return entry[0]

    async def _about_the_topic(
        self, producer: AIOKafkaProducer, topic: str, exc: BaseException
    ) -> bool:
        """Whether a metadata error is about ``topic`` rather than the cluster. aiokafka
        raises UnknownTopicOrPartitionError when metadata times out, the cluster being
        unreachable included: only a cluster that answers, without the topic, says the topic
        is at fault."""
        if isinstance(exc, InvalidTopicError | TopicAuthorizationFailedError):
            return True
        if not isinstance(exc, UnknownTopicOrPartitionError):
            return False
        try:
            async with asyncio.timeout(self.settings.request_timeout_ms / 1000):
                cluster = await producer.client.fetch_all_metadata()
        except (KafkaError, OSError, TimeoutError):
            return False  # nobody answers: the cluster, not the topic
        return topic not in cluster.topics()

    def _topic_refused(self, env: Envelope, topic: str, exc: BaseException) -> Outcome:
        """The cluster refuses this topic (not the others): the row's own outcome."""
        where = f"topic {topic!r} of destination {env.destination!r}"
        if isinstance(exc, UnknownTopicOrPartitionError):
            # Someone may still create it: retried, with backoff, until max_attempts.
            return Outcome.retry(
                env.id,
                f"{where} does not exist on {self.bootstrap} (and the cluster does not create "
                f"topics on first use): create it, or fix the topic ({describe(exc)})",
            )
        return Outcome.failed(
            env.id, truncate_error(f"{where} is refused by the cluster: {describe(exc)}")
        )

    async def _partition(
        self,
        producer: AIOKafkaProducer,
        topic: str,
        batch: Sequence[Envelope],
        outcomes: list[Outcome],
    ) -> tuple[dict[int, list[_Item]], BaseException | None]:
        """Group one topic's envelopes by partition, as the producer's own partitioner would.
        Rows that cannot be sent get their outcome in ``outcomes``; the error returned, if
        any, says the cluster cannot be reached."""
        known_bad = self._recently_refused(topic)
        if known_bad is not None:
            outcomes.extend(self._topic_refused(env, topic, known_bad) for env in batch)
            return {}, None
        try:
            # Waits for metadata (creating the topic where the broker does that).
            parts = sorted(await producer.partitions_for(topic))
        except (KafkaError, OSError) as exc:
            if not await self._about_the_topic(producer, topic, exc):
                outcomes.extend(self._not_sent(env, exc) for env in batch)
                return {}, exc
            self._refused[topic] = (exc, time.monotonic() + REFUSED_TOPIC_TTL)
            outcomes.extend(self._topic_refused(env, topic, exc) for env in batch)
            return {}, None
        groups: dict[int, list[_Item]] = {}
        ce = self.cloudevents.get(batch[0].destination)  # one destination per batch
        for env in batch:
            if not env.held():
                # Metadata can take a while: the relay's lease on the row may have run out.
                outcomes.append(Outcome.not_held(env.id))
                continue
            key = env.key.encode() if env.key is not None else None
            if ce is None:
                value, headers = env.payload, self._headers(env)
            else:
                try:
                    value, headers = self._message(env, ce)
                except cloudevents.NotSendable as exc:
                    outcomes.append(Outcome.failed(env.id, truncate_error(str(exc))))
                    continue
            too_large = self._too_large(env, key, value, headers)
            if too_large is not None:
                outcomes.append(too_large)
                continue
            partition = self._partitioner(key, parts, parts)
            groups.setdefault(partition, []).append((env, key, value, headers))
        return groups, None

    def _too_large(
        self, env: Envelope, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]
    ) -> Outcome | None:
        """The producer's own measure (it refuses a message above it in send()): a row is
        refused here exactly when the producer would refuse it."""
        limit = self.settings.max_request_size
        size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers)
        if size <= limit:
            return None
        envelope = ", CloudEvent envelope" if value is not env.payload else ""
        return Outcome.failed(
            env.id,
            f"MessageSizeTooLargeError: the message is {size} bytes with its key, headers"
            f"{envelope} and framing, above kafka.max_request_size ({limit}); it cannot be sent "
            "as it is",
        )

    async def _send_batches(
        self,
        producer: AIOKafkaProducer,
        topic: str,
        partition: int,
        items: list[_Item],
        sends: list[tuple[asyncio.Future[Any], list[_Item]]],
        singles: list[_Item],
    ) -> None:
        builder = producer.create_batch()
        batched: list[_Item] = []
        for item in items:
            _, key, value, headers = item
            if builder.append(key=key, value=value, timestamp=None, headers=headers):
                batched.append(item)
                continue
            if batched:  # the batch is full: ship it and start the next
                sends.append(
                    (await producer.send_batch(builder, topic, partition=partition), batched)
                )
                builder, batched = producer.create_batch(), []
                if builder.append(key=key, value=value, timestamp=None, headers=headers):
                    batched.append(item)
                    continue
            singles.append(item)  # larger than a whole batch: the producer sizes one for it
        if batched:
            sends.append((await producer.send_batch(builder, topic, partition=partition), batched))

    async def _send_singly(
        self, producer: AIOKafkaProducer, topic: str, items: list[_Item]
    ) -> list[tuple[Outcome, BaseException | None]]:
        futures: list[tuple[Envelope, asyncio.Future[Any] | BaseException]] = []
        for env, key, value, headers in items:
            try:
                fut = await producer.send(topic, value=value, key=key, headers=headers)
            except (KafkaError, OSError) as exc:
                futures.append((env, exc))
            else:
                futures.append((env, fut))
        pending = [f for _, f in futures if isinstance(f, asyncio.Future)]
        await asyncio.gather(*pending, return_exceptions=True)
        out: list[tuple[Outcome, BaseException | None]] = []
        for env, f in futures:
            err = f if isinstance(f, BaseException) else f.exception()
            out.append(
                (Outcome.delivered(env.id), None)
                if err is None
                else (self._outcome_for(env.id, err), err)
            )
        return out

    async def close(self) -> None:
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await producer.stop()
