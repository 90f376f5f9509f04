"""`outbox-relay endpoints portal-key` and `portal-token`: what they print opens the portal for
the tenant named, with the key of --key-file or OUTBOX_PORTAL_KEY only."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from outbox.endpoints import portal_tokens as pt
from relay.cli import main


def cli(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, ["endpoints", *args], env=env)


@pytest.fixture
def key(monkeypatch: pytest.MonkeyPatch) -> str:
    made = cli("portal-key")
    assert made.exit_code == 0, made.output
    value = made.stdout.strip()
    monkeypatch.setenv(pt.KEY_VARIABLE, value)
    return value


def test_a_new_key_is_a_valid_key_and_a_new_one_each_time() -> None:
    first, second = (cli("portal-key").stdout.strip() for _ in range(2))
    assert first != second
    pt.PortalKeys.parse(f"{first},{second}")


def test_the_token_printed_opens_the_tenants_portal(key: str) -> None:
    out = cli("portal-token", "acme", "--ttl", "10m")
    assert out.exit_code == 0, out.output
    access = pt.verify_portal_token(out.stdout.strip(), key=key)
    assert access.tenant == "acme" and access.write
    left = (access.expires - datetime.now(UTC)).total_seconds()
    assert 590 < left <= 600


def test_read_only_schema_and_json(key: str) -> None:
    out = cli("portal-token", "acme", "--read-only", "--schema", "billing", "--json")
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    access = pt.verify_portal_token(got["token"], key=key, schema="billing")
    assert not access.write and got["write"] is False
    assert got["token_id"] == access.token_id and got["url"] is None


def test_the_link_carries_the_token_in_its_fragment(key: str) -> None:
    out = cli("portal-token", "acme", "--url", "https://hooks.example.com/portal")
    base, token = out.stdout.strip().split("/#token=")
    assert base == "https://hooks.example.com/portal"
    assert pt.verify_portal_token(token, key=key).tenant == "acme"
    bad = cli("portal-token", "acme", "--url", "https://hooks.example.com/#x")
    assert bad.exit_code == 2 and "fragment" in bad.output


def test_the_key_file_signs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pt.KEY_VARIABLE, raising=False)
    new, old = pt.new_portal_key(), pt.new_portal_key()
    path = tmp_path / "portal.key"
    path.write_text(f"{new},{old}\n")
    out = cli("portal-token", "acme", "--key-file", str(path))
    assert out.exit_code == 0, out.output
    assert pt.verify_portal_token(out.stdout.strip(), key=new).tenant == "acme"


def test_without_a_key_the_error_names_where_to_put_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pt.KEY_VARIABLE, raising=False)
    out = cli("portal-token", "acme")
    assert out.exit_code == 2
    assert "--key-file" in out.output and "OUTBOX_PORTAL_KEY" in out.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--ttl", "8d"], "7 days"),
        (["--ttl", "soon"], "not a duration"),
        (["--ttl", "0"], "from 1 s"),
    ],
)
def test_bad_options_are_named(key: str, args: list[str], says: str) -> None:
    out = cli("portal-token", "acme", *args)
    assert out.exit_code == 2 and says in out.output, out.output


def test_a_bad_tenant_or_key_file_is_named_without_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(pt.KEY_VARIABLE, raising=False)
    path = tmp_path / "portal.key"
    short = "opk_" + pt._b64(b"s" * 16)
    path.write_text(short)
    out = cli("portal-token", "acme", "--key-file", str(path))
    assert out.exit_code == 2 and "fewer than 32" in out.output
    assert short[4:] not in out.output
    assert cli("portal-token", "acme", "--key-file", str(tmp_path / "none")).exit_code == 2
    monkeypatch.setenv(pt.KEY_VARIABLE, pt.new_portal_key())
    assert "control character" in cli("portal-token", "a\x01b").output
