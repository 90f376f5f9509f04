"""A pipe: one source of claimable rows and what the relay keeps for that source alone.

The events are one source (their statements are the Store's); a sink with a table of its own
may bring another (relay/sinks/source.py). Each source's rows are known by ids of its own, which
may equal another source's, so each gets its own Leases (the rows held), Completer (outcomes
written with the source's statements), gauge of rows in flight and heartbeat job; the shutdown
writes and releases pipe by pipe (relay/runtime/shutdown.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from prometheus_client import Gauge

from relay.db.leasing import Held, LeaseStatements
from relay.db.store import Record
from relay.pipeline.completer import Completer, Key
from relay.pipeline.leases import Leases

# The events' pipe: its jobs and log lines keep the names they had before there were others.
EVENTS = "events"

H = TypeVar("H", bound=Held)

# A periodic job: name, what to run, interval and first delay (relay.maintenance.every).
Job = tuple[str, Callable[[], Awaitable[Any]], float, float]


class Sends(Protocol):
    """What sends a pipe's rows (relay/pipeline/sending.py, source_sending.py), as the
    shutdown sees it: the tasks sending now, waited for before anything is released."""

    tasks: set[asyncio.Task[None]]

    def halt(self) -> None:
        """The relay is stopping: start nothing more that the shutdown would wait for."""
        ...


def adopter(
    leases: Leases[H], dispatch: Callable[[Sequence[H]], None]
) -> Callable[[Sequence[H]], None]:
    """What a source hands rows it claimed by itself to (a fan-out's deliveries, claimed as
    they were written): held in ``leases`` and dispatched, as the claimer's own are."""

    def adopt(items: Sequence[H]) -> None:
        leases.claimed(items)
        dispatch(items)

    return adopt


class Pipe(Generic[H]):
    """``source``'s rows held in ``leases``, their outcomes written by a completer of their
    own; ``heads`` is called when an outcome let the next row of an ordered key go (the
    claimer claims it at once); ``gauge`` reads how many rows are held."""

    __slots__ = ("_heads", "completer", "leases", "name", "sending", "source")

    def __init__(
        self,
        name: str,
        source: LeaseStatements,
        leases: Leases[H],
        *,
        heads: Callable[[], None] | None = None,
        gauge: Gauge | None = None,
        linger: float = 0.0,
    ) -> None:
        self.name = name
        self.source = source
        self.leases = leases
        self._heads = heads
        leases.fields = self.fields
        # A source's own command for a row whose outcome was refused, if it has one.
        hint = getattr(source, "retry_hint", None)
        self.completer = Completer(
            source, self._recorded, fields=self.fields, hint=hint, linger=linger
        )
        self.sending: Sends | None = None  # set once built (it needs the completer)
        if gauge is not None:
            gauge.set_function(lambda: len(leases))

    def _recorded(self, records: Sequence[Record], written: set[Key], abandoned: set[Key]) -> None:
        if self.leases.recorded(records, written, abandoned) and self._heads is not None:
            self._heads()

    def job(self, name: str) -> str:
        """The name of one of its tasks: another source's say whose they are."""
        return name if self.name == EVENTS else f"{name}:{self.name}"

    @property
    def fields(self) -> dict[str, str]:
        """What its log lines add to say whose rows they are about."""
        return {} if self.name == EVENTS else {"source": self.name}

    def jobs(self, lease: float) -> list[Job]:
        """Its periodic jobs: the heartbeat, every third of a lease."""
        leases, source = self.leases, self.source
        return [(self.job("heartbeat"), lambda: leases.heartbeat(source, lease), lease / 3, 0.0)]

    def tasks(self) -> set[asyncio.Task[None]]:
        """Its supervised loops: the completer."""
        return {asyncio.create_task(self.completer.run(), name=self.job("completer"))}
