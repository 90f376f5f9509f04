"""Commands load only what they use: the operations commands start fast, and the library's
package does not load SQLAlchemy until an application uses it."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("sqlalchemy", "aiokafka", "httpx", "relay.relay", "relay.tools")


def imported(code: str) -> set[str]:
    """The modules loaded by the time ``code`` (run in a fresh interpreter) has finished,
    however they were imported."""
    dump = "import atexit, sys; atexit.register(lambda: print(*sys.modules, file=sys.stderr))"
    done = subprocess.run(
        [sys.executable, "-c", f"{dump}\n{code}"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return set(done.stderr.split())


@pytest.mark.parametrize("command", ["status", "retry", "pause", "migrate"])
def test_an_operations_command_loads_neither_the_relay_nor_its_clients(command: str) -> None:
    modules = imported(f"from relay.cli import main; main([{command!r}, '--help'])")
    assert "relay.cli.ops" in modules or "relay.cli.run" in modules  # the command did load
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY or m.startswith(HEAVY))
    assert not heavy, heavy


def test_importing_the_library_loads_sqlalchemy_only_when_used() -> None:
    modules = imported("import outbox; outbox.Status; from outbox.dburl import redact")
    assert "outbox.status" in modules and "sqlalchemy" not in modules
    used = imported("import outbox; outbox.enqueue")
    assert {"sqlalchemy", "outbox.writer"} <= used
