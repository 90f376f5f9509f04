"""Configuration the relay cannot run with is refused by `run --check` (exit 2, the key
named), and every documented environment variable does what it says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

WHSEC = "whsec_" + "A" * 43 + "="
BASE = "database_url = 'postgresql://x@127.0.0.1/y'\n"


def check(toml: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "relay.toml"
    cfg.write_text(toml)
    return subprocess.run(
        [sys.executable, "-m", "relay.cli", "run", "--config", str(cfg), "--check"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **env},
        timeout=60,
    )


def hook(url: str) -> str:
    return f"[destinations.h]\nkind = 'webhook'\nurl = '{url}'\nsecrets = ['{WHSEC}']\n"


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[relay]\nlease = inf\n", "relay.lease"),
        ("[relay]\nlease = 1e13\n", "relay.lease"),
        ("[relay]\nshutdown_timeout = nan\n", "relay.shutdown_timeout"),
        ("[relay.backoff]\nmax = inf\n", "relay.backoff.max"),
        ("[relay.backoff]\nschedule = [1, 1e13]\n", "relay.backoff.schedule.1"),
        ("[relay]\nretention = '1000000w'\n", "relay.retention"),
        ("[destinations.o]\nkind = 'kafka'\ntopic = '.'\n", "destinations.o.kafka.topic"),
        ("[destinations.o]\nkind = 'kafka'\ntopic = '..'\n", "destinations.o.kafka.topic"),
        (hook("http://example.com:99999/in"), "destinations.h.webhook.url"),
        (hook("http://example.com:0/in"), "destinations.h.webhook.url"),
        (hook("http://exa mple.com/in"), "destinations.h.webhook.url"),
        (hook("http://a..b/in"), "destinations.h.webhook.url"),
        (hook("http://-x-.example/in"), "destinations.h.webhook.url"),
        (hook("https://[::1/in"), "destinations.h.webhook.url"),
        (hook("https://example.com/in") + "retry_after_max = inf\n", "retry_after_max"),
        ("[relay]\nschema = '" + "s" * 57 + "'\n", "relay.schema"),
        # An int4 in SQL: a larger one made the reaper fail for ever.
        ("[relay]\nmax_attempts = 2147483648\n", "relay.max_attempts"),
        ("[destinations.o]\nkind = 'kafka'\ntopic = 'o'\nmax_attempts = 99999\n", "max_attempts"),
        # A few nanoseconds made an idle relay claim and reap in a busy loop.
        ("[relay]\npoll_interval = 1e-9\n", "relay.poll_interval"),
        ("[relay]\nreport_interval = 0.001\n", "relay.report_interval"),
        ("[relay]\nretention_interval = 0.001\n", "relay.retention_interval"),
        ("[relay]\nstats_interval = 0\n", "relay.stats_interval"),
        # An int32 in the produce request: 3e9 could not be sent at all.
        ("[kafka]\nrequest_timeout_ms = 3000000000\n", "kafka.request_timeout_ms"),
        ("[kafka]\nmax_request_size = 3000000000\n", "kafka.max_request_size"),
        # CloudEvents: a source is required, must be a URI-reference, and needs the envelope.
        (
            "[destinations.o]\nkind = 'kafka'\ntopic = 'o'\nenvelope = 'cloudevents'\n",
            "destinations.o.kafka.source",
        ),
        (
            hook("https://example.com/in") + "envelope = 'cloudevents'\nsource = 'a b'\n",
            "destinations.h.webhook.source",
        ),
        (hook("https://example.com/in") + "source = '/orders'\n", "destinations.h.webhook.source"),
        (
            "[destinations.c]\nkind = 'endpoints'\nenvelope = 'cloudevents'\nsource = '/c'\n"
            "cloudevents_mode = 'batch'\n",
            "destinations.c.endpoints.cloudevents_mode",
        ),
    ],
)
def test_values_the_relay_cannot_run_with_are_refused(tmp_path: Path, toml: str, key: str) -> None:
    res = check(BASE + toml, tmp_path)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert key in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize(
    "url",
    [
        "http://[::1]:8080/in",
        "http://10.0.0.1/in",
        "http://svc_name.ns.svc.cluster.local:8080/in",
        "https://例え.jp/in",
        "https://example.com./in",
    ],
)
def test_valid_webhook_urls_pass(tmp_path: Path, url: str) -> None:
    res = check(BASE + hook(url), tmp_path)
    assert res.returncode == 0, res.stderr


def test_a_cloudevents_destination_passes_the_check(tmp_path: Path) -> None:
    toml = (
        "[destinations.o]\nkind = 'kafka'\ntopic = 'o'\nenvelope = 'cloudevents'\n"
        "source = 'https://shop.example/orders'\ncloudevents_mode = 'structured'\n"
        "default_type = 'order.changed'\n"
    )
    res = check(BASE + toml, tmp_path)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize(
    ("value", "expected"), [("1", 1), (" 1", 1), ("-1", -1), ("all", "all"), ("all ", "all")]
)
def test_kafka_acks_from_the_environment_and_as_a_string(value: str, expected: object) -> None:
    from relay.settings import load_settings

    env_style = load_settings(
        None, database_url="postgresql://x@h/y", kafka={"acks": value, "enable_idempotence": False}
    )
    assert env_style.kafka.acks == expected


def test_kafka_acks_variable_passes_the_check(tmp_path: Path) -> None:
    res = check(BASE, tmp_path, OUTBOX_KAFKA_ACKS="1", OUTBOX_KAFKA_ENABLE_IDEMPOTENCE="false")
    assert res.returncode == 0, res.stderr
    # acks = 0: no acknowledgement at all, so nothing could honestly be marked delivered.
    res = check(BASE, tmp_path, OUTBOX_KAFKA_ACKS="0", OUTBOX_KAFKA_ENABLE_IDEMPOTENCE="false")
    assert res.returncode == 2 and "kafka.acks" in res.stderr and "at-least-once" in res.stderr
    res = check(BASE + "[kafka]\nacks = '1'\nenable_idempotence = false\n", tmp_path)
    assert res.returncode == 0, res.stderr


def test_one_schema_variable_serves_run_and_the_ops_commands(tmp_path: Path) -> None:
    res = check(BASE, tmp_path, OUTBOX_SCHEMA="events")
    assert res.returncode == 0 and "schema 'events'" in res.stdout, res.stderr
    res = check(BASE, tmp_path, OUTBOX_RELAY_SCHEMA="events")
    assert res.returncode == 0 and "schema 'events'" in res.stdout, res.stderr
    # Told two different schemas, it says so instead of choosing one.
    res = check(BASE + "[relay]\nschema = 'other'\n", tmp_path, OUTBOX_SCHEMA="events")
    assert res.returncode == 2 and "OUTBOX_SCHEMA" in res.stderr, res.stderr
    res = check(BASE, tmp_path, OUTBOX_SCHEMA="events", OUTBOX_RELAY_SCHEMA="other")
    assert res.returncode == 2 and "set only OUTBOX_SCHEMA" in res.stderr, res.stderr
    # The ops commands read the same variables.
    status = subprocess.run(
        [sys.executable, "-m", "relay.cli", "status", "--database-url", "postgresql://x@h/y"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "OUTBOX_SCHEMA": "events", "OUTBOX_RELAY_SCHEMA": "other"},
        timeout=60,
    )
    assert status.returncode == 2 and "set only OUTBOX_SCHEMA" in status.stderr


def test_unknown_outbox_variables_are_reported(tmp_path: Path) -> None:
    res = check(BASE, tmp_path, OUTBOX_LOGLEVEL="debug", OUTBOX_SHEMA="events")
    assert res.returncode == 0, res.stderr
    assert "OUTBOX_LOGLEVEL (did you mean OUTBOX_LOG_LEVEL?) is not a setting" in res.stderr
    assert "OUTBOX_SHEMA (did you mean OUTBOX_SCHEMA?)" in res.stderr


def test_kubernetes_service_links_are_not_settings(tmp_path: Path) -> None:
    """A Service named outbox-relay, outbox-http or outbox-kafka in the namespace gives every
    pod OUTBOX_RELAY_PORT=tcp://…, OUTBOX_HTTP_PORT=tcp://…: not settings, not typos."""
    links = {
        "OUTBOX_RELAY_PORT": "tcp://10.0.0.7:9090",
        "OUTBOX_RELAY_SERVICE_HOST": "10.0.0.7",
        "OUTBOX_RELAY_SERVICE_PORT": "9090",
        "OUTBOX_RELAY_PORT_9090_TCP": "tcp://10.0.0.7:9090",
        "OUTBOX_RELAY_PORT_9090_TCP_PORT": "9090",
        "OUTBOX_RELAY_PORT_9090_TCP_ADDR": "10.0.0.7",
        "OUTBOX_RELAY_PORT_9090_TCP_PROTO": "tcp",
        "OUTBOX_HTTP_PORT": "tcp://10.0.0.8:9090",
        "OUTBOX_KAFKA_SERVICE_HOST": "10.0.0.9",
    }
    res = check(BASE, tmp_path, **links)
    assert res.returncode == 0, res.stderr
    assert "not a setting" not in res.stderr
    # A real OUTBOX_HTTP_PORT still is one.
    res = check(BASE, tmp_path, OUTBOX_HTTP_PORT="70000")
    assert res.returncode == 2 and "http.port" in res.stderr


def test_variables_the_configuration_names_are_not_reported(tmp_path: Path) -> None:
    toml = BASE + (
        "[destinations.h]\nkind = 'webhook'\nurl = 'https://example.com/in'\n"
        "secret_env = 'OUTBOX_BILLING_SECRET'\n"
    )
    res = check(toml, tmp_path, OUTBOX_BILLING_SECRET=WHSEC, OUTBOX_FAULT_REPORT="/tmp/x.json")
    assert res.returncode == 0, res.stderr
    assert "not a setting" not in res.stderr


def test_a_tools_own_configuration_reads_no_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variables win over a configuration, but not over a tool's relay of its own (the
    demo's): ``environment=False`` reads none, the schema's included."""
    from relay.settings import load_settings

    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://app@db/production")
    monkeypatch.setenv("OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "kafka.prod:9092")
    monkeypatch.setenv("OUTBOX_SCHEMA", "theirs")
    own = {"database_url": "postgresql://x@h/demo", "kafka": {"bootstrap_servers": "h:1"}}
    assert load_settings(None, **own).database_url.get_secret_value().endswith("/production")
    settings = load_settings(None, environment=False, **own)
    assert settings.database_url.get_secret_value() == "postgresql://x@h/demo"
    assert settings.section("kafka").bootstrap_servers == "h:1"
    assert settings.relay.schema_ == "public"
    # Read again by the next load: the setting is per call.
    assert load_settings(None, **own).section("kafka").bootstrap_servers == "kafka.prod:9092"


def test_the_benchmarks_relays_read_no_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark's relay is its own, on its scratch database, as the demo's is: a shell's
    OUTBOX_DATABASE_URL must not point it at that shell's application's outbox."""
    from relay.tools.bench import drain, fanout_setup

    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://app@db/production")
    monkeypatch.setenv("OUTBOX_SCHEMA", "theirs")
    monkeypatch.setenv("OUTBOX_RELAY_BATCH_SIZE", "7")
    scratch = "postgresql://x@h/outbox_bench_1"
    for settings in (
        drain.relay_settings(scratch, 100, None),
        fanout_setup.relay_settings(
            scratch, batch_size=100, max_concurrency=4, endpoints=2, shutdown=5
        ),
    ):
        assert settings.database_url.get_secret_value() == scratch
        assert settings.relay.schema_ == "public"
        assert settings.relay.batch_size == 100
