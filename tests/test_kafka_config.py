"""A producer that cannot start, for whatever reason, leaves the Kafka sink unavailable
instead of crashing the relay."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from aiokafka.codec import has_lz4, has_snappy, has_zstd
from pydantic import SecretStr

from relay.config import KafkaDestination, KafkaSettings
from relay.model import Envelope, Result
from relay.sinks.kafka import KafkaSink

MISSING_CODECS = [
    name
    for name, available in (("snappy", has_snappy), ("lz4", has_lz4), ("zstd", has_zstd))
    if not available()
]


# --- the sink, whatever the producer raises --------------------------------------------------


def envelope(i: int) -> Envelope:
    return Envelope(i, "orders", None, b"{}", "application/json", {}, 0, datetime.now(UTC))


# Settings that pass validation: the producer raised OverflowError, RuntimeError or
# ValueError at start-up, which the sink did not catch (model_construct keeps this test
# independent of what validation refuses).
UNSTARTABLE = [
    {"bootstrap_servers": "127.0.0.1:99999"},
    {"bootstrap_servers": "127.0.0.1:notaport"},
    {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "OAUTHBEARER",
        "sasl_plain_username": "relay",
        "sasl_plain_password": SecretStr("pw"),
    },
    *({"compression_type": codec} for codec in MISSING_CODECS[:1]),
]


@pytest.mark.parametrize("broken", UNSTARTABLE)
async def test_a_producer_that_cannot_start_leaves_the_sink_unavailable(
    broken: dict[str, Any],
) -> None:
    """start() does not raise (the relay would exit with a traceback), deliver() defers the
    batch without spending an attempt, and the breaker stops further claims."""
    fields = KafkaSettings().model_dump()
    fields.update(enable_idempotence=False, request_timeout_ms=1000, **broken)
    settings = KafkaSettings.model_construct(**fields)
    sink = KafkaSink(settings, {"orders": KafkaDestination(kind="kafka", topic="orders")})
    try:
        await sink.start()
        assert not sink.available("orders") and not sink.ready()
        sink.breaker.success()  # as if its cool-down had passed: deliver() tries again
        outcomes = await sink.deliver([envelope(1), envelope(2)])
        assert [o.result for o in outcomes] == [Result.DEFER, Result.DEFER]
        assert all(o.error and "Kafka unavailable" in o.error for o in outcomes)
        assert not sink.available("orders")
    finally:
        await sink.close()
