"""`outbox-relay init`: a starter relay.toml that, edited only in its URLs, passes `run --check`;
its destinations are the three kinds, its webhook secret its own."""

from __future__ import annotations

import contextlib
import os
import pty
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from relay.cli import main


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """None of the caller's OUTBOX_* variables: they win over the file under test (a
    developer's OUTBOX_LOG_LEVEL or OUTBOX_KAFKA_BOOTSTRAP_SERVERS would change its verdict)."""
    for name in [n for n in os.environ if n.startswith("OUTBOX_")]:
        monkeypatch.delenv(name)


URLS = {
    "postgresql://outbox_relay@localhost:5432/app": "postgresql://relay@db.internal/shop",
    '["localhost:9092"]': '["kafka-1.internal:9092", "kafka-2.internal:9092"]',
    "https://billing.example.com/webhooks/outbox": "https://billing.internal/hooks",
}


def _edited(text: str) -> str:
    """The starter with every URL edited, each edit checked to have happened: a starter whose
    URLs changed would otherwise be checked unedited, and pass."""
    for old, new in URLS.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    config = tomllib.loads(text)
    assert config["database_url"] == "postgresql://relay@db.internal/shop"
    assert config["kafka"]["bootstrap_servers"][1] == "kafka-2.internal:9092"
    assert config["destinations"]["billing"]["url"] == "https://billing.internal/hooks"
    return text


def test_the_starter_edited_in_its_urls_passes_run_check(tmp_path: Path, clean_env: None) -> None:
    res = CliRunner().invoke(main, ["init"])
    assert res.exit_code == 0, res.output
    text = res.stdout
    assert "Next:" not in text and "outbox-relay migrate --config relay.toml" in res.stderr
    config = tomllib.loads(text)  # stdout is the file alone
    kinds = {d["kind"] for d in config["destinations"].values()}
    assert kinds == {"kafka", "webhook", "endpoints"}
    edited = _edited(text)  # a user's edit: the URLs, nothing else
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


# --- after a hostile review (#32) -----------------------------------------------------------


def test_the_secret_moved_to_the_environment_as_the_starter_says_passes(
    tmp_path: Path, clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _edited(CliRunner().invoke(main, ["init"]).stdout)
    (secrets_line,) = re.findall(r"^secrets = .*$", text, re.M)
    # What the comment above it says to write instead.
    assert 'secret_env = "OUTBOX_BILLING_SECRET" instead of secrets' in text
    path = tmp_path / "relay.toml"
    path.write_text(text.replace(secrets_line, 'secret_env = "OUTBOX_BILLING_SECRET"'))
    check = ["run", "--check", "--config", str(path)]
    res = CliRunner().invoke(main, check)
    assert res.exit_code == 2 and "OUTBOX_BILLING_SECRET" in res.stderr, res.output
    monkeypatch.setenv("OUTBOX_BILLING_SECRET", re.findall(r'"(whsec_[^"]+)"', secrets_line)[0])
    res = CliRunner().invoke(main, check)
    assert res.exit_code == 0, res.output
    assert "warning" not in res.stderr  # the variable it names is not "not a setting"


def test_the_next_steps_say_the_file_holds_a_secret_and_never_show_it(
    clean_env: None,
) -> None:
    res = CliRunner().invoke(main, ["init"])
    (secret,) = re.findall(r'"(whsec_[^"]+)"', res.stdout)
    assert secret not in res.stderr
    # Written by `>` under the usual umask, the file is readable by every user of the machine.
    assert "chmod 600 relay.toml" in res.stderr


def _init_on_a_terminal() -> tuple[str, str]:
    """`outbox-relay init` with its stdout on a terminal (a pty), its stderr on a pipe."""
    primary, secondary = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "relay.cli", "init"],
            stdout=secondary,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
        )
        os.close(secondary)
        secondary = -1
        out = b""
        with contextlib.suppress(OSError):  # EIO once the terminal has no writer
            while chunk := os.read(primary, 65536):
                out += chunk
    finally:
        os.close(primary)
        if secondary != -1:
            os.close(secondary)
    assert proc.returncode == 0, proc.stderr
    return out.decode(), proc.stderr


def test_on_a_terminal_it_says_how_to_keep_the_file() -> None:
    out, err = _init_on_a_terminal()
    assert "[destinations.billing]" in out
    assert "outbox-relay init > relay.toml" in err
    # Off a terminal (redirected, as the hint says) the hint is not repeated.
    res = CliRunner().invoke(main, ["init"])
    assert "outbox-relay init > relay.toml" not in res.stderr
