"""Sending another source's rows (relay/sinks/source.py: an endpoints sink's deliveries): the
claimed rows handed to the source in its groups, each outcome handed on to the source's
completer as soon as it is known, not when its group is done.

As for the events (sending.py), every row ends recorded, back in pending or with its lease
left to the reaper: a group whose handling raised has its rows recorded as crashed (retried,
an attempt counted), and a group a stop cut short has the rows whose request had gone out
recorded as attempts; those not started (at the stop, or since it: ``halt``) stay held, and
the shutdown puts them back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Generic, TypeVar

import structlog

from outbox.errors import describe
from relay.db.leasing import Held
from relay.db.store import Record
from relay.obs.metrics import Metrics
from relay.pipeline.completer import Completer
from relay.pipeline.leases import Leases, ids
from relay.sinks.source import SendingSource

log = structlog.get_logger("relay")

H = TypeVar("H", bound=Held)


class SourceSending(Generic[H]):
    """Hands ``source``'s claimed rows to it, a task per group; their outcomes go to
    ``completer``, and leave ``leases``' count of rows being sent as they come."""

    def __init__(
        self,
        source: SendingSource[H],
        leases: Leases[H],
        completer: Completer,
        metrics: Metrics,
    ) -> None:
        self.source = source
        self.leases = leases
        self.completer = completer
        self.metrics = metrics
        self.tasks: set[asyncio.Task[None]] = set()
        self.halted = False

    def halt(self) -> None:
        """The relay is stopping: no group starts, and no request starts in the groups
        sending now; their rows not started stay held, for the shutdown to put back."""
        self.halted = True
        self.source.halt()

    def dispatch(self, items: Sequence[H]) -> None:
        """Start sending claimed rows: one task per group (none once halted: they stay
        held, and the shutdown puts them back unattempted)."""
        if self.halted:
            return
        groups: dict[Hashable, list[H]] = {}
        for item in items:
            groups.setdefault(self.source.group(item), []).append(item)
        for group in groups.values():
            task = asyncio.create_task(self.deliver(group))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _cut_short(self, left: Iterable[H], emit: Callable[[Record, H], None]) -> None:
        """Rows a stop left without an outcome: one whose request had gone out may have
        reached its receiver, and counts as an attempt; the others stay held, for the
        shutdown to put back unattempted."""
        for item in list(left):
            try:
                cut = self.source.cut_short(item)
            except Exception as exc:  # a bug: counted as an attempt all the same
                cut = self.source.crashed(item, exc)
            if cut is not None:
                emit(cut, item)

    async def deliver(self, items: list[H]) -> None:
        """Send one group; every row leaves with an outcome, or stays held for the stop."""
        left = {(i.id, i.token): i for i in items}

        def emit(record: Record, item: H) -> None:
            if left.pop((item.id, item.token), None) is None:
                return  # a second outcome for one row: the first stands
            self.leases.handed([item])
            self.completer.add([record])

        source = self.source
        try:
            await source.deliver(items, emit)
        except asyncio.CancelledError:
            # A stop cut the group short: a request that had gone out may have reached its
            # receiver, and counts as an attempt; a row not started stays held, and is put
            # back unattempted by the shutdown.
            self._cut_short(left.values(), emit)
            raise
        except Exception as exc:
            log.error(
                "relay.delivery.crashed",
                source=source.name,
                count=len(left),
                ids=ids(list(left.values())),
                error=describe(exc),
                action="the rows are retried with this error as last_error; please report it",
                exc_info=exc,
            )
            self.metrics.delivery_errors.inc()
            for item in list(left.values()):
                emit(source.crashed(item, exc), item)
            return
        if left and self.halted:
            # Not started since the stop: held, put back by the shutdown; but a row whose
            # request had gone out (a source that left it without an outcome) counts as an
            # attempt, as when a stop cuts a group short.
            self._cut_short(left.values(), emit)
            return
        if left:
            # The source returned without an outcome for some rows (a bug): retried.
            missing = LookupError(f"{source.name}: no outcome for the row")
            log.error("relay.delivery.crashed", source=source.name, ids=ids(list(left.values())))
            for item in list(left.values()):
                emit(source.crashed(item, missing), item)
