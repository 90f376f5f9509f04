"""relay.event_loop: uvloop where installed, the standard loop on request, a clear refusal."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from relay.runtime import loop
from tests.support.signals import ctrl_c_default


async def _kind() -> str:
    return loop.name()


def test_auto_runs_on_uvloop_where_installed() -> None:
    pytest.importorskip("uvloop")
    assert loop.run(_kind(), "auto") == "uvloop"
    assert loop.run(_kind(), "uvloop") == "uvloop"


def test_asyncio_runs_on_the_standard_loop() -> None:
    assert loop.run(_kind(), "asyncio") == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert loop.run(_kind(), "auto") == "asyncio"
    with pytest.raises(loop.LoopUnavailable, match="uvloop is not installed"):
        loop.run(_kind(), "uvloop")


@pytest.mark.parametrize("choice", ["auto", "asyncio"])
def test_sigterm_cancels_a_tools_run_and_its_clean_up_runs(choice: loop.Choice) -> None:
    cleaned: list[str] = []

    async def tool() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(30)
        finally:
            cleaned.append("scratch dropped")

    # What Ctrl-C does here before the run: Python's handler, or ignored in a suite run in the
    # background (tests/support/signals.py).
    ctrl_c = signal.getsignal(signal.SIGINT)
    with pytest.raises(loop.Terminated):
        loop.run(tool(), choice, sigterm_cancels=True)
    assert cleaned == ["scratch dropped"]
    # The handlers are gone with the run: SIGTERM and Ctrl-C are the process's own again.
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is ctrl_c


# A tool whose clean-up takes a moment, signalled again while it runs: it prints what
# finished. Run in a process of its own, where a KeyboardInterrupt cannot stop the test run.
_SIGNALLED_TWICE = """
import asyncio, os, signal, sys
from relay.runtime import loop

async def tool():
    try:
        os.kill(os.getpid(), SIG)
        await asyncio.sleep(30)
    finally:
        os.kill(os.getpid(), SIG)  # pressed again while cleaning up
        await asyncio.sleep(0.3)
        print("scratch dropped", flush=True)

try:
    loop.run(tool(), sys.argv[1], sigterm_cancels=True)
except loop.Terminated:
    print("terminated", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


@pytest.mark.parametrize("choice", ["auto", "asyncio"])
@pytest.mark.parametrize(("name", "said"), [("SIGINT", "interrupted"), ("SIGTERM", "terminated")])
def test_a_second_signal_lets_a_tools_clean_up_finish(
    choice: loop.Choice, name: str, said: str
) -> None:
    code = _SIGNALLED_TWICE.replace("SIG)", f"signal.{name})")
    done = subprocess.run(
        [sys.executable, "-c", code, choice],
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=ctrl_c_default,
    )
    assert done.stdout.splitlines() == ["scratch dropped", said], done.stdout + done.stderr


def test_a_tool_started_with_ctrl_c_ignored_goes_on_ignoring_it() -> None:
    """A shell script's background job inherits SIGINT ignored: the tool keeps it so."""
    code = """
import asyncio, os, signal, sys
from relay.runtime import loop

async def tool():
    os.kill(os.getpid(), signal.SIGINT)
    await asyncio.sleep(0.3)
    return "finished"

print(loop.run(tool(), "auto", sigterm_cancels=True), flush=True)
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert done.stdout == "finished\n", done.stdout + done.stderr
