"""relay.event_loop: uvloop where installed, the standard loop on request, a clear refusal."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from relay.runtime import loop


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

    with pytest.raises(loop.Terminated):
        loop.run(tool(), choice, sigterm_cancels=True)
    assert cleaned == ["scratch dropped"]
    # The handler is gone with the run: SIGTERM is the process's own again.
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
