"""The Kafka sink: one aiokafka producer per relay, a batch per partition, an outcome per
message. Its settings: ``[kafka]`` (the producer) and each destination's ``topic``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relay.sinks import Sink, SinkKind
from relay.sinks.kafka.config import KafkaDestination, KafkaSettings


def _build(section: KafkaSettings, destinations: Mapping[str, Any]) -> Sink:
    from relay.sinks.kafka.sink import KafkaSink  # aiokafka only where it is used

    return KafkaSink(section, destinations)


def _secrets(section: KafkaSettings, destinations: Mapping[str, Any]) -> set[str]:
    password = section.sasl_plain_password
    return {password.get_secret_value()} if password is not None else set()


KIND = SinkKind(
    name="kafka",
    destination=KafkaDestination,
    section="kafka",
    settings=KafkaSettings,
    build=_build,
    secrets=_secrets,
)
