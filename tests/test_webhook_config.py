"""Webhook destinations and the [webhooks] section: validated at load, secrets never shown."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import pytest

from outbox.webhooks.signing import Signer, decode_secret
from outbox.webhooks.ssrf import is_public
from relay import backoff
from relay.config import ConfigError
from relay.pipeline.routes import build_routes, build_sinks
from relay.settings import load_settings
from relay.sinks.webhook.config import WebhookDestination
from relay.sinks.webhook.sink import WebhookSink
from tests.webhook_helpers import new_secret

DB = "postgresql://root@127.0.0.1:5432/postgres"


def write(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "relay.toml"
    p.write_text(f'database_url = "{DB}"\n' + body)
    return p


def test_webhook_destination_from_toml(tmp_path: Path) -> None:
    secret = new_secret()
    s = load_settings(
        write(
            tmp_path,
            f"""
[webhooks]
connect_timeout = 2
max_connections = 50

[destinations.billing]
kind = "webhook"
url = "https://billing.example.com/hooks/orders?token=abc"
secrets = ["{secret}"]
timeout = 15
max_concurrency = 16
headers = {{ "X-Team" = "orders" }}
""",
        )
    )
    d = s.destinations["billing"]
    assert isinstance(d, WebhookDestination)
    assert d.headers == {"X-Team": "orders"} and d.max_concurrency == 16
    assert s.webhooks.connect_timeout == 2 and s.webhooks.user_agent.startswith("outbox-relay/")
    # The relay reads these per destination: a long schedule over about two days.
    route = build_routes(s, build_sinks(s))["billing"]
    assert route.max_attempts == 10
    schedule = route.backoff.schedule
    assert schedule is not None and schedule[:3] == [5, 300, 1800]
    assert 1 * 86400 <= sum(schedule) <= 3 * 86400
    d1 = backoff.delay(route.backoff, 1)
    assert 4 <= d1 <= 6  # 5 s with jitter
    # No secret in any rendering of the settings.
    for text in (repr(s), str(s), repr(d), str(d.model_dump())):
        assert secret not in text and secret[6:] not in text
    sinks = build_sinks(s)
    assert isinstance(sinks["billing"], WebhookSink)


def test_secret_env_read_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = new_secret(), new_secret()
    monkeypatch.setenv("BILLING_WEBHOOK_SECRET", f"{old} {new}")
    s = load_settings(
        write(
            tmp_path,
            """
[destinations.billing]
kind = "webhook"
url = "https://billing.example.com/hooks"
secret_env = "BILLING_WEBHOOK_SECRET"
""",
        )
    )
    d = s.destinations["billing"]
    assert isinstance(d, WebhookDestination)
    assert d.signing_keys() == [decode_secret(old), decode_secret(new)]
    assert old not in repr(s)


def test_missing_secret_env_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOPE_SECRET", raising=False)
    path = write(
        tmp_path,
        """
[destinations.billing]
kind = "webhook"
url = "https://billing.example.com/hooks"
secret_env = "NOPE_SECRET"
""",
    )
    with pytest.raises(ConfigError, match="NOPE_SECRET") as err:
        load_settings(path)
    assert "destinations.billing" in str(err.value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"url": "ftp://example.com/x"}, "http:// or https://"),
        ({"url": "not a url"}, "url"),
        ({"url": "https://user:pw@example.com/"}, "credentials"),
        ({"secrets": []}, "needs a signing secret"),
        ({"secrets": ["plain-password-123"]}, "whsec_"),
        ({"secrets": ["whsec_c2hvcnQ="]}, "at least 24 random bytes"),
        ({"secrets": ["whsec_***not-base64***"]}, "not base64"),
        ({"headers": {"webhook-signature": "x"}}, "set by the relay"),
        ({"headers": {"bad name": "x"}}, "not a valid HTTP token"),
        ({"allowed_networks": ["10.0.0.0/33"]}, "allowed_networks"),
        ({"timeout": 0}, "timeout"),
        ({"retry_client_error": False}, "unknown key"),
    ],
)
def test_bad_webhook_config_names_the_problem(fields: dict[str, object], message: str) -> None:
    base: dict[str, object] = {
        "kind": "webhook",
        "url": "https://example.com/hook",
        "secrets": [new_secret()],
    }
    with pytest.raises(ConfigError) as err:
        load_settings(database_url=DB, destinations={"hook": {**base, **fields}})
    text = str(err.value)
    assert "destinations.hook" in text and message in text, text
    for s in fields.get("secrets") or []:  # type: ignore[attr-defined]
        assert s not in text


def test_both_secrets_and_secret_env_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOK_SECRET", new_secret())
    with pytest.raises(ConfigError, match="either secrets or secret_env"):
        load_settings(
            database_url=DB,
            destinations={
                "hook": {
                    "kind": "webhook",
                    "url": "https://example.com/",
                    "secrets": [new_secret()],
                    "secret_env": "HOOK_SECRET",
                }
            },
        )


def test_http_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_WEBHOOKS_MAX_RESPONSE_BYTES", "100")
    s = load_settings(database_url=DB)
    assert s.webhooks.max_response_bytes == 100


def test_signer_repr_hides_keys() -> None:
    key = decode_secret(new_secret())
    assert key.hex() not in repr(Signer([key])) and "1 key" in repr(Signer([key]))


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("::ffff:8.8.8.8", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("100.64.0.1", False),  # CGNAT
        ("169.254.169.254", False),  # link-local: cloud metadata
        ("224.0.0.1", False),  # multicast (Python calls it global)
        ("240.0.0.1", False),  # reserved
        ("0.0.0.0", False),
        ("255.255.255.255", False),
        ("192.0.2.1", False),  # documentation
        ("::1", False),
        ("::", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("fec0::1", False),  # site-local
        ("ff02::1", False),
        ("::ffff:127.0.0.1", False),  # IPv4-mapped loopback
        ("::ffff:169.254.169.254", False),
        ("2002:a9fe:a9fe::1", False),  # 6to4 of 169.254.169.254
        ("64:ff9b::7f00:1", False),  # NAT64 of 127.0.0.1
    ],
)
def test_is_public(address: str, public: bool) -> None:
    assert is_public(ipaddress.ip_address(address)) is public


def test_an_endpoints_destination_loads_with_its_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[destinations.customers]\nkind = "endpoints"\ndisable_after = "2d"\nmax_concurrency = 3\n',
    )
    d = load_settings(path).destinations["customers"]
    assert d.kind == "endpoints" and d.disable_after == 2 * 86400 and d.max_concurrency == 3
    assert d.max_attempts == 10 and not d.allow_private_networks  # the webhook defaults


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ('ordering = "key"', "not supported for an endpoints destination"),
        ('url = "https://example.com/"', "url"),  # registered per endpoint, not here
        ('disable_after = "10s"', "disable_after"),
    ],
)
def test_an_endpoints_destination_refuses_what_it_cannot_do(
    tmp_path: Path, extra: str, words: str
) -> None:
    path = write(tmp_path, f'[destinations.customers]\nkind = "endpoints"\n{extra}\n')
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    text = str(caught.value)
    assert "destinations.customers" in text and words in text


def test_an_unknown_kind_names_the_kinds(tmp_path: Path) -> None:
    path = write(tmp_path, '[destinations.customers]\nkind = "carrier-pigeon"\n')
    with pytest.raises(ConfigError, match="got 'carrier-pigeon'") as caught:
        load_settings(path)
    assert '"endpoints"' in str(caught.value)


def test_an_endpoints_latency_budget_is_under_its_timeout() -> None:
    def load(**dest: object) -> object:
        return load_settings(
            None,
            database_url="postgresql://x@127.0.0.1/x",
            destinations={"c": {"kind": "endpoints", **dest}},
        )

    s: Any = load(timeout=6)
    assert s.destinations["c"].budget == 2.0  # a third of the timeout
    assert load(timeout=6, latency_budget=1.5).destinations["c"].budget == 1.5  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"latency_budget \(6 s\) must be under timeout \(5 s\)"):
        load(timeout=5, latency_budget=6)
    with pytest.raises(ConfigError, match="slow_concurrency"):
        load(slow_concurrency=0)
