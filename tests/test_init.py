"""`outbox-relay init`: a starter relay.toml that, edited only in its URLs, passes `run --check`;
its destinations are the three kinds, its webhook secret its own."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from relay.cli import main


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OUTBOX_DATABASE_URL", "OUTBOX_CONFIG", "OUTBOX_SCHEMA", "OUTBOX_DESTINATIONS"):
        monkeypatch.delenv(name, raising=False)


def test_the_starter_edited_in_its_urls_passes_run_check(tmp_path: Path, clean_env: None) -> None:
    res = CliRunner().invoke(main, ["init"])
    assert res.exit_code == 0, res.output
    text = res.stdout
    assert "Next:" not in text and "outbox-relay migrate --config relay.toml" in res.stderr
    config = tomllib.loads(text)  # stdout is the file alone
    kinds = {d["kind"] for d in config["destinations"].values()}
    assert kinds == {"kafka", "webhook", "endpoints"}
    # A user's edit: the URLs, nothing else.
    edited = (
        text.replace(
            "postgresql://outbox_relay@localhost:5432/app", "postgresql://relay@db.internal/shop"
        )
        .replace('["localhost:9092"]', '["kafka-1.internal:9092", "kafka-2.internal:9092"]')
        .replace("https://billing.example.com/webhooks/outbox", "https://billing.internal/hooks")
    )
    assert edited != text
    (tmp_path / "relay.toml").write_text(edited)
    res = CliRunner().invoke(main, ["run", "--check", "--config", str(tmp_path / "relay.toml")])
    assert res.exit_code == 0, res.output
    assert "configuration OK: 3 destination(s)" in res.stdout


def test_each_starter_has_a_secret_of_its_own(clean_env: None) -> None:
    found = [
        re.findall(r'"(whsec_[A-Za-z0-9+/=]+)"', CliRunner().invoke(main, ["init"]).stdout)
        for _ in range(2)
    ]
    assert len(found[0]) == len(found[1]) == 1
    assert found[0] != found[1]
