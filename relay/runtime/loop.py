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
    and Terminated is raised: by default SIGTERM kills the process where it stands. Then a
    signal after the first (Ctrl-C pressed again, a second SIGTERM) does not interrupt that
    clean-up; Ctrl-C still ends in KeyboardInterrupt once it is done."""
    try:
        factory = loop_factory(choice)
    except LoopUnavailable:
        main.close()
        raise
    # Ctrl-C is taken over where asyncio.Runner would take it: not where SIGINT is ignored
    # (a background job of a shell script inherits that, and must go on ignoring it).
    signals = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signals.append(signal.SIGINT)
    with asyncio.Runner(loop_factory=factory) as runner:
        if not sigterm_cancels:
            return runner.run(main)
        try:
            return runner.run(_cancelled_by_signals(main, signals))
        except _Interrupted:
            pass
    raise KeyboardInterrupt


class _Interrupted(Exception):
    """Ctrl-C cancelled the run; KeyboardInterrupt once the loop is closed."""


async def _cancelled_by_signals(main: Coroutine[Any, Any, T], signals: list[signal.Signals]) -> T:
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(main)
    first: list[signal.Signals] = []

    def on_signal(signum: signal.Signals) -> None:
        # Once only: asyncio's own Ctrl-C handler raises KeyboardInterrupt at the second,
        # wherever the clean-up the first one started stands (a scratch database left behind).
        if not first:
            first.append(signum)
            task.cancel()

    for signum in signals:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        return await task
    except asyncio.CancelledError:
        if first == [signal.SIGTERM]:
            raise Terminated from None
        if first == [signal.SIGINT]:
            raise _Interrupted from None
        raise
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


def name() -> str:
    """The running loop's kind, for the start-up log line."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"
