"""Running the relay's coroutine on the event loop its settings choose.

uvloop cuts the relay's CPU per event on both sinks (docs/performance.md); it is a dependency
on Linux, and ``relay.event_loop = "asyncio"`` turns it off (to debug, or where it misbehaves).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")

Choice = Literal["auto", "uvloop", "asyncio"]


class LoopUnavailable(RuntimeError):
    pass


class Terminated(Exception):
    """The run was cancelled by SIGTERM (see run's ``sigterm_cancels``)."""


def loop_factory(choice: Choice) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory for ``asyncio.Runner``; None for the standard library's loop."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise LoopUnavailable(
                'relay.event_loop = "uvloop" but uvloop is not installed; install it '
                '(pip install uvloop) or set relay.event_loop = "auto"'
            ) from None
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: Choice, *, sigterm_cancels: bool = False) -> T:
    """Run ``main`` on the chosen loop. With ``sigterm_cancels``, SIGTERM cancels it as Ctrl-C
    does, so its ``finally`` blocks run (a tool's scratch database and broker go with it),
    and Terminated is raised: by default SIGTERM kills the process where it stands."""
    try:
        factory = loop_factory(choice)
    except LoopUnavailable:
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        if not sigterm_cancels:
            return runner.run(main)
        return runner.run(_cancelled_by_sigterm(main))


async def _cancelled_by_sigterm(main: Coroutine[Any, Any, T]) -> T:
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(main)
    terminated = False

    def on_sigterm() -> None:
        nonlocal terminated
        terminated = True
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await task
    except asyncio.CancelledError:
        if terminated:
            raise Terminated from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def name() -> str:
    """The running loop's kind, for the start-up log line."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"
