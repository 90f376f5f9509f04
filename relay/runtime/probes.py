"""The answers of /healthz and /readyz.

Live: the process answers and none of its supervised loops has ended (a restart helps).
Ready: started, not stopping, the database answers, claims and outcome writes succeed, and
at least one sink can deliver (sending traffic its way helps).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any, Protocol

from outbox.errors import describe
from relay.db.store import DB_ERRORS, Store
from relay.pipeline.claimer import Claimer
from relay.pipeline.completer import Completer
from relay.sinks import Sink

Answer = tuple[bool, dict[str, Any]]


class Observed(Protocol):
    """What the probes read of a relay."""

    started: asyncio.Event
    stopping: asyncio.Event
    tasks: set[asyncio.Task[Any]]
    claimer: Claimer | None
    completer: Completer | None

    @property
    def sinks(self) -> Mapping[str, Sink]: ...

    @property
    def store(self) -> Store: ...

    @property
    def paused(self) -> frozenset[str]: ...


async def health(relay: Observed) -> Answer:
    if not relay.started.is_set():
        return True, {"starting": True}
    dead = sorted(t.get_name() for t in relay.tasks if t.done())
    return not dead, {"dead_tasks": dead} if dead else {}


async def readiness(relay: Observed) -> Answer:
    if relay.claimer is None:
        return False, {"starting": True}
    checks: dict[str, Any] = {}
    ok = relay.started.is_set() and not relay.stopping.is_set()
    if relay.stopping.is_set():
        checks["shutting_down"] = True
    try:
        await asyncio.wait_for(relay.store.ping(), 2.0)
        checks["database"] = "ok"
    except DB_ERRORS as exc:
        ok = False
        checks["database"] = describe(exc)
    # Claims that fail (a read-only database answers SELECT 1 all the same): not ready.
    if relay.claimer.error is not None:
        ok = False
        checks["claiming"] = relay.claimer.error
    # Outcomes that cannot be written leave delivered rows to be sent again: not ready.
    completer = relay.completer
    if completer is not None and completer.failing_since is not None:
        ok = False
        failing = time.monotonic() - completer.failing_since
        checks["recording"] = (
            f"failing for {failing:.0f} s ({completer.pending} outcomes kept): "
            f"{completer.last_error}"
        )
    else:
        checks["recording"] = "ok"
    sinks = {name: sink.ready(name) for name, sink in relay.sinks.items()}
    checks["sinks"] = sinks
    if sinks and not any(sinks.values()):
        ok = False
    checks["paused"] = sorted(relay.paused)
    return ok, checks
