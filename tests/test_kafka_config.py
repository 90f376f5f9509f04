"""Kafka settings the producer cannot use are refused at load (`run --check` exits 2 naming
the key), and a producer that cannot start, for whatever reason, leaves the sink unavailable
instead of crashing the relay."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from aiokafka.codec import has_lz4, has_snappy, has_zstd
from pydantic import SecretStr

from relay.model import Envelope, Lease, Result
from relay.sinks.kafka.config import KafkaDestination, KafkaSettings
from relay.sinks.kafka.sink import KafkaSink

SASL = {"sasl_plain_username": "relay", "sasl_plain_password": "pw"}
MISSING_CODECS = [
    name
    for name, available in (("snappy", has_snappy), ("lz4", has_lz4), ("zstd", has_zstd))
    if not available()
]


def check(
    tmp_path: Path, kafka: dict[str, Any], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cfg = {
        "database_url": "postgresql://relay@db/app",
        "kafka": {"enable_idempotence": False, **kafka},
        "destinations": {"orders": {"kind": "kafka", "topic": "orders"}},
    }
    path = tmp_path / "relay.toml"
    path.write_text(tomli_w.dumps(cfg))
    return subprocess.run(
        [sys.executable, "-m", "relay.cli", "run", "--check", "--config", str(path)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        timeout=60,
    )


@pytest.mark.parametrize(
    ("kafka", "expected"),
    [
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER", **SASL},
            [
                "kafka.sasl_mechanism: OAUTHBEARER is not supported yet",
                "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512",
            ],
        ),
        (
            {"sasl_mechanism": "PLAIN", **SASL},  # security_protocol stays PLAINTEXT
            ["kafka.sasl_mechanism:", "security_protocol = 'SASL_PLAINTEXT' or 'SASL_SSL'"],
        ),
        (
            {"security_protocol": "SSL", "sasl_mechanism": "SCRAM-SHA-256", **SASL},
            ["kafka.sasl_mechanism:", "(it is 'SSL')"],
        ),
        (
            {"security_protocol": "SASL_SSL", **SASL},
            ["kafka.sasl_mechanism: required with security_protocol = 'SASL_SSL'"],
        ),
        (
            {
                "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "PLAIN",
                "sasl_plain_password": "pw",
            },
            ["kafka.sasl_plain_username: required with sasl_mechanism = 'PLAIN'"],
        ),
        (
            {
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "SCRAM-SHA-512",
                "sasl_plain_username": "relay",
            },
            ["kafka.sasl_plain_password: required with sasl_mechanism = 'SCRAM-SHA-512'"],
        ),
        ({"bootstrap_servers": "kafka:notaport"}, ["kafka.bootstrap_servers:", "port"]),
        ({"bootstrap_servers": "kafka:99999"}, ["kafka.bootstrap_servers:", "1 to 65535"]),
        ({"bootstrap_servers": ["kafka-1:9092", "[::1"]}, ["kafka.bootstrap_servers:"]),
        ({"bootstrap_servers": "kafka-1:9092,"}, ["kafka.bootstrap_servers:", "empty"]),
        ({"bootstrap_servers": []}, ["kafka.bootstrap_servers:"]),
        *(
            ({"compression_type": codec}, ["kafka.compression_type:", "aiokafka[", "gzip"])
            for codec in MISSING_CODECS[:1]
        ),
    ],
)
def test_unusable_kafka_settings_fail_the_check(
    tmp_path: Path, kafka: dict[str, Any], expected: list[str]
) -> None:
    """Each of these passed `run --check`; the producer then raised at start-up (ValueError,
    OverflowError or RuntimeError, none of them caught) and the relay died with a traceback,
    or, for a mechanism without a SASL protocol, connected without authenticating."""
    res = check(tmp_path, kafka)
    assert res.returncode == 2, res.stdout + res.stderr
    for text in expected:
        assert text in res.stderr, res.stderr


def test_an_unsupported_mechanism_from_the_environment_fails_the_check(tmp_path: Path) -> None:
    res = check(
        tmp_path,
        {"security_protocol": "SASL_SSL", **SASL},
        env={"OUTBOX_KAFKA_SASL_MECHANISM": "OAUTHBEARER"},
    )
    assert res.returncode == 2 and "kafka.sasl_mechanism: OAUTHBEARER" in res.stderr


@pytest.mark.parametrize(
    "kafka",
    [
        {},
        {"security_protocol": "SSL"},
        {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN", **SASL},
        {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256", **SASL},
        {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", **SASL},
        {"bootstrap_servers": "kafka-1:9092, kafka-2:9093,kafka-3"},
        {"bootstrap_servers": ["[::1]:9092", "::1", "[fe80::1]", "10.0.0.1:19092"]},
        {"compression_type": "gzip"},
    ],
)
def test_usable_kafka_settings_pass_the_check(tmp_path: Path, kafka: dict[str, Any]) -> None:
    res = check(tmp_path, kafka)
    assert res.returncode == 0, res.stderr


# --- the sink, whatever the producer raises --------------------------------------------------


def envelope(i: int) -> Envelope:
    lease = Lease(time.monotonic() + 60)
    now = time.time()
    return Envelope(i, "orders", None, b"{}", "application/json", {}, 0, now, 1, lease)


# Settings that passed validation: the producer raised OverflowError, RuntimeError or
# ValueError at start-up, which the sink did not catch (validation now refuses them;
# model_construct keeps this test independent of what validation refuses).
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
        assert not sink.available("orders") and not sink.ready("orders")
        sink.breaker.success()  # as if its cool-down had passed: deliver() tries again
        outcomes = await sink.deliver([envelope(1), envelope(2)])
        assert [o.result for o in outcomes] == [Result.DEFER, Result.DEFER]
        assert all(o.error and "Kafka unavailable" in o.error for o in outcomes)
        assert not sink.available("orders")
    finally:
        await sink.close()


async def test_rows_of_another_destination_fail_alone(kafka_bootstrap: str) -> None:
    """A batch that breaks the one-destination contract: the rows this sink has a topic for
    are sent, each other row fails alone with the reason (not the whole batch retried)."""
    from dataclasses import replace

    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, enable_idempotence=False)
    sink = KafkaSink(settings, {"orders": KafkaDestination(kind="kafka", topic="orders")})
    try:
        await sink.start()
        ours, stray = envelope(1), replace(envelope(2), destination="elsewhere")
        outcomes = {o.id: o for o in await sink.deliver([ours, stray])}
        assert outcomes[1].result is Result.DELIVERED, outcomes[1]
        assert outcomes[2].result is Result.FAILED
        assert "'elsewhere' is not a Kafka one" in (outcomes[2].error or "")
    finally:
        await sink.close()
