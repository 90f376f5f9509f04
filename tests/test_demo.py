"""The README's main command really relays events end to end."""

from __future__ import annotations

import subprocess
import sys
import uuid


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
