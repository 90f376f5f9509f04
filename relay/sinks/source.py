"""A source of claimable rows beside the events: what a sink with a table of its own (endpoint
deliveries) offers the relay's pipeline, so that its rows are claimed, held, renewed, recorded,
reaped and released by the relay's own parts rather than by loops of its own.

The pipeline serves each source apart (relay/runtime/pipes.py): its own Leases and Completer,
since its ids are its own. The events are served through the Store, which has the statements
(relay/db/leasing.py) but claims per destination; a Source claims for itself.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Protocol, TypeVar

from relay.db.leasing import Held, LeaseStatements
from relay.db.store import Record

H = TypeVar("H", bound=Held)


class Source(LeaseStatements, Protocol[H]):
    """Rows of one table, claimed under leases with fencing tokens as the events are.

    ``claim(limit, held)`` claims at most ``limit`` rows; ``held`` are the rows of this
    source the relay holds now (a claim may share its room among them). ``due`` says a claim
    may find rows now (it was woken, or rows it knows of came due); the claimer claims it
    when due and at its poll interval otherwise. ``reap`` puts back the rows whose lease
    expired (a dead relay's) and returns how many; ``wake`` marks the source due.
    """

    @property
    def name(self) -> str: ...

    @property
    def due(self) -> bool: ...

    async def claim(self, limit: int, held: Iterable[H]) -> Sequence[H]: ...

    async def reap(
        self, max_attempts: int, limits: Mapping[str, int], within: float | None = None
    ) -> int: ...

    def wake(self) -> None: ...


class SendingSource(Source[H], Protocol[H]):
    """A source that also sends its rows (a sink's: Sink.sources), as the relay's pipeline
    hands them to it (relay/pipeline/source_sending.py).

    The claimed rows go out in groups (``group``: rows of one group are handed over
    together, an endpoint's deliveries); ``deliver(items, emit)`` sends one group and calls
    ``emit(record, item)`` for each row as soon as its outcome is known, never raising for a
    delivery's problem. What it leaves without an outcome the pipeline settles: a row whose
    handling raised gets ``crashed(item, exc)``, one a stop cut short ``cut_short(item)`` (its
    request may have gone out: an attempt) or, if that is None, is put back unattempted; so
    is a row it did not start once ``halt()`` was called.
    ``on_due`` is called when the source comes due (it is set to the claimer's wake-up).
    """

    on_due: Callable[[], None]
    # Set by the relay: rows the source claimed by itself (a fan-out's deliveries, claimed as
    # they were written), to be held and sent as the claimer's are.
    adopt: Callable[[Sequence[H]], None] | None

    def group(self, item: H) -> Hashable: ...

    async def deliver(self, items: Sequence[H], emit: Callable[[Record, H], None]) -> None: ...

    def crashed(self, item: H, exc: BaseException) -> Record: ...

    def cut_short(self, item: H) -> Record | None: ...

    def halt(self) -> None:
        """The relay is stopping: start no more requests. Rows left without an outcome
        are put back unattempted by the shutdown."""
        ...

    def retry_hint(self, record: Record) -> str:
        """The command that sends a row again whose outcome the database refused (the row
        is failed with the reason and this)."""
        ...
