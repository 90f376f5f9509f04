"""Running the relay's coroutine on the event loop its settings choose.

uvloop cuts the relay's CPU per event on both sinks (docs/performance.md); it is a dependency
on Linux, and ``relay.event_loop = "asyncio"`` turns it off (to debug, or where it misbehaves).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")

Choice = Literal["auto", "uvloop", "asyncio"]


class LoopUnavailable(RuntimeError):
    pass


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


def run(main: Coroutine[Any, Any, T], choice: Choice) -> T:
    try:
        factory = loop_factory(choice)
    except LoopUnavailable:
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def name() -> str:
    """The running loop's kind, for the start-up log line."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"
