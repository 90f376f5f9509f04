"""relay.event_loop: uvloop where installed, the standard loop on request, a clear refusal."""

from __future__ import annotations

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
