"""Where an endpoint call's statements run: :class:`AsyncRunner` on an AsyncSession or
AsyncConnection, :class:`SyncRunner` on a Session or Connection. Each call is written once, as
a coroutine over a runner; the ``_sync`` twins run it with :func:`finish`, without an event
loop, since a SyncRunner's coroutines never suspend."""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from sqlalchemy import TextClause
from sqlalchemy.engine import Connection
from sqlalchemy.exc import StatementError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from outbox.endpoints.reachable import check_reachable

AsyncTarget = AsyncSession | AsyncConnection
SyncTarget = Session | Connection
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Call:
    """A statement and its binds."""

    sql: TextClause
    binds: dict[str, Any]


class Runner(Protocol):
    async def run(self, call: Call) -> builtins.list[Any]:
        """The rows of ``call``, run in the caller's connection (and transaction)."""

    async def reach(self, url: str, allow_private_networks: bool, resolve: bool) -> None:
        """check_reachable(url, ...)."""


class AsyncRunner:
    def __init__(self, conn: object) -> None:
        self.conn = conn

    async def run(self, call: Call) -> builtins.list[Any]:
        # The connection is checked at each statement, after the call's arguments: a wrong
        # argument is reported first, whatever the connection.
        conn = self.conn
        if not isinstance(conn, AsyncSession | AsyncConnection):
            raise TypeError(
                "outbox.endpoints takes a SQLAlchemy AsyncSession or AsyncConnection; got "
                f"{type(conn).__name__} (use the _sync functions for a Session or Connection)"
            )
        try:
            result = await conn.execute(call.sql, call.binds)
        except StatementError as exc:
            _hide_parameters(exc)
            raise
        return builtins.list(result.fetchall())

    async def reach(self, url: str, allow_private_networks: bool, resolve: bool) -> None:
        # In a thread: a DNS lookup must not stop the caller's event loop.
        await asyncio.to_thread(check_reachable, url, allow_private_networks, resolve=resolve)


class SyncRunner:
    """Runs each statement at once, in the caller's thread: nothing here awaits."""

    def __init__(self, conn: object) -> None:
        self.conn = conn

    async def run(self, call: Call) -> builtins.list[Any]:
        conn = self.conn
        if not isinstance(conn, Session | Connection):
            raise TypeError(
                "the _sync endpoint functions take a SQLAlchemy Session or Connection; got "
                f"{type(conn).__name__} (await the async ones for async connections)"
            )
        try:
            return builtins.list(conn.execute(call.sql, call.binds).fetchall())
        except StatementError as exc:
            _hide_parameters(exc)
            raise

    async def reach(self, url: str, allow_private_networks: bool, resolve: bool) -> None:
        check_reachable(url, allow_private_networks, resolve=resolve)


def finish(work: Coroutine[Any, Any, T]) -> T:
    """The result of ``work``, a call over a SyncRunner, run to its end here: it never
    suspends (its only awaits are the SyncRunner's), so one step finishes it."""
    try:
        work.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    work.close()
    raise RuntimeError("an endpoint call over a SyncRunner suspended")


def _hide_parameters(exc: StatementError) -> None:
    """SQLAlchemy prints a failed statement's parameters in its message, and ours carry the
    endpoint's secret (in clear when no key is set): a lock timeout must not log it."""
    exc.hide_parameters = True
    exc.params = None
