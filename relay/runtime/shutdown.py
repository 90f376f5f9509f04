"""A graceful stop: the claim in progress completes, deliveries get ``shutdown_timeout`` to
finish, outcomes are written, rows still held are put back to pending, and the relay
unregisters; all after the drain within FINAL_BUDGET, so that a database that hangs cannot
keep the process from exiting (the reaper takes back whatever was not released). Outcomes are
written and rows released per pipe (relay/runtime/pipes.py), each through its own source."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import structlog

from outbox.errors import describe
from relay.config import Settings
from relay.db.leasing import LeaseStatements
from relay.db.store import DB_ERRORS, UNAVAILABLE, Store
from relay.obs.metrics import Metrics
from relay.pipeline.leases import LOST_IDS_LOGGED
from relay.runtime.pipes import Pipe
from relay.runtime.server import HttpServer
from relay.sinks import Sink

log = structlog.get_logger("relay")

# Bound on each statement of the shutdown after the drain.
LAST_WRITE_TIMEOUT = 5.0
# All of the shutdown after the drain (outcomes, release, unregister, closing) fits in this.
FINAL_BUDGET = 10.0


class Stopping(Protocol):
    """What a shutdown reads of a relay."""

    settings: Settings
    metrics: Metrics
    http: HttpServer | None

    @property
    def pipes(self) -> Sequence[Pipe[Any]]: ...

    @property
    def sinks(self) -> Mapping[str, Sink]: ...

    @property
    def store(self) -> Store: ...


async def shutdown(
    relay: Stopping, claimer: asyncio.Task[None], background: set[asyncio.Task[Any]]
) -> None:
    timeout = relay.settings.relay.shutdown_timeout
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    await _drain(relay, claimer, timeout, deadline)
    last = max(deadline, loop.time()) + FINAL_BUDGET

    def left(at_most: float = FINAL_BUDGET) -> float:
        return max(0.5, min(at_most, last - loop.time()))

    # The write in progress finishes (cut short, its rows would be released and sent again),
    # then whatever is left is written, within the remaining time: every pipe's at once.
    pipes = relay.pipes
    budget = max(deadline - loop.time(), left(FINAL_BUDGET / 2))
    # One pipe's bug must not keep the others' rows from being released below.
    closed = await asyncio.gather(
        *(p.completer.close(timeout=budget) for p in pipes), return_exceptions=True
    )
    for pipe, ok in zip(pipes, closed, strict=True):
        if isinstance(ok, BaseException):
            log.error("relay.shutdown.write_failed", error=describe(ok), **pipe.fields)
        if ok is not True:
            log.error(
                "relay.shutdown.unrecorded",
                outcomes=pipe.completer.pending,
                **pipe.fields,
                action="their rows are released below, or reaped after their lease, and "
                "delivered again",
            )
    # Stopped before anything is released: a write that ran out of time must not race the
    # release of its rows.
    completers = {p.job("completer") for p in pipes}
    for t in background:
        if t.get_name() in completers:
            t.cancel()
            await asyncio.wait({t}, timeout=left(1.0))
    for pipe in pipes:
        await release_leftover(
            pipe.source, pipe.leases.tokens(), left(LAST_WRITE_TIMEOUT), **pipe.fields
        )
    store = relay.store
    try:
        async with asyncio.timeout(left(LAST_WRITE_TIMEOUT)):
            await store.unregister()
    except DB_ERRORS as exc:
        log.warning("relay.unregister.failed", error=describe(exc))
    for t in background:
        t.cancel()
    # A task in a statement on a hung connection cannot finish cancelling (its rollback waits
    # too) until the pool is terminated below.
    _, stuck = await asyncio.wait(background, timeout=left(LAST_WRITE_TIMEOUT))
    await _close(relay, store, stuck, left)


async def _drain(
    relay: Stopping, claimer: asyncio.Task[None], timeout: float, deadline: float
) -> None:
    """Let the claim in progress end and deliveries finish, until the deadline."""
    loop = asyncio.get_running_loop()
    # Requests in flight finish; none starts from rows queued behind them (claimed ahead of
    # an endpoint's free slots), nor from a claim that ends from now on: they are released.
    for pipe in relay.pipes:
        if pipe.sending is not None:
            pipe.sending.halt()
    # The claim loop is never cancelled mid-claim: rows it claims must be held.
    try:
        await asyncio.wait_for(asyncio.shield(claimer), timeout=max(timeout, 1))
    except (TimeoutError, Exception):
        claimer.cancel()
    # No more claims: the ordered destinations it owned go to another relay now, not after the
    # rest of the shutdown (their rows still in flight here are waited for by that relay).
    await relay.store.disown()
    # Every pipe's sends, the events' and each source's (a source's rows released while their
    # requests are out would be sent twice).
    tasks = {t for p in relay.pipes if p.sending is not None for t in p.sending.tasks}
    if tasks:
        _, late = await asyncio.wait(set(tasks), timeout=max(0.0, deadline - loop.time()))
        for t in late:
            t.cancel()
        if late:
            await asyncio.gather(*late, return_exceptions=True)
            log.warning("relay.shutdown.timeout", unfinished_batches=len(late))
    for sink in {id(s): s for s in relay.sinks.values()}.values():
        # Sinks with deliveries of their own (endpoints): theirs finish, are recorded, and
        # what was not attempted is released, within what is left of the timeout.
        try:
            await sink.drain(max(0.0, deadline - loop.time()))
        except Exception:
            log.exception("relay.sink.drain_failed")


async def _close(
    relay: Stopping, store: Store, stuck: set[asyncio.Task[Any]], left: Callable[[float], float]
) -> None:
    for sink in {id(s): s for s in relay.sinks.values()}.values():
        try:
            await sink.close()
        except Exception:
            log.exception("relay.sink.close_failed")
    relay.metrics.up.set(0)
    if relay.http is not None:
        await relay.http.stop()
    console = getattr(relay, "console", None)
    if console is not None:
        try:
            async with asyncio.timeout(left(2.0)):
                await console.state.console.close()
        except Exception as exc:
            log.warning("relay.console.close_failed", error=describe(exc))
    portal = getattr(relay, "portal", None)
    if portal is not None:
        try:
            async with asyncio.timeout(left(2.0)):
                await portal.state.portal.close()
        except Exception as exc:
            log.warning("relay.portal.close_failed", error=describe(exc))
    # The ordered destinations it owns: another relay takes them over now (their rows in
    # flight are waited for), and the pool's close does not wait for that connection.
    await store.disown()
    try:
        await asyncio.wait_for(store.pool.close(), 0 if stuck else left(2.0))
    except TimeoutError:
        store.pool.terminate()  # a connection that hangs: do not wait for it
    if stuck:
        await asyncio.wait(stuck, timeout=left(2.0))


async def release_leftover(
    store: LeaseStatements, leftover: list[tuple[int, int]], timeout: float, /, **fields: str
) -> None:
    """Put the rows still held back to pending, unattempted: in one statement, or row by row
    if the database refuses the statement for one of them. ``fields``: what the log lines
    add (whose rows they are, when not the events')."""
    if not leftover:
        return
    try:
        async with asyncio.timeout(timeout):
            await store.release(leftover)
        log.info("relay.released", count=len(leftover), **fields)
        return
    except UNAVAILABLE as exc:
        failed: list[tuple[int, int]] = leftover
        error = describe(exc)
    except DB_ERRORS:
        failed, error = [], ""
        for one in leftover:
            try:
                async with asyncio.timeout(min(timeout, 1.0)):
                    await store.release([one])
            except DB_ERRORS as exc:
                failed.append(one)
                error = describe(exc)
        if len(failed) < len(leftover):
            log.info("relay.released", count=len(leftover) - len(failed), **fields)
    if failed:
        log.error(
            "relay.release.failed",
            count=len(failed),
            ids=[i for i, _ in failed[:LOST_IDS_LOGGED]],
            error=error,
            **fields,
            action="the reaper returns them to pending when their lease expires",
        )
