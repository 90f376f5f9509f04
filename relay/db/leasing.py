"""What the pipeline asks of a source of claimable rows about the rows it leased.

The relay's pipeline (relay/pipeline: Leases, Completer) serves the events through
:class:`relay.db.store.Store`, and can serve another table of leased rows the same way: each
source gets a Leases and a Completer of its own, and they reach its rows only through these
statements. A source's ids are its own: the same id in two sources is two different rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from relay.db.store import Record
from relay.model import Lease


class Held(Protocol):
    """A row a relay claimed, as its Leases keeps it: an :class:`relay.model.Envelope` is
    one. ``lease`` is the hold of the claim the row came in (``lease.lost`` takes the row's
    ``id`` when the relay finds it no longer holds it); ``destination`` and ``key`` matter
    to ordered destinations only (a source without keys says None)."""

    @property
    def id(self) -> int: ...

    @property
    def token(self) -> int: ...

    @property
    def lease(self) -> Lease: ...

    @property
    def destination(self) -> str: ...

    @property
    def key(self) -> str | None: ...


class LeaseStatements(Protocol):
    """The statements about leased rows, each for many (id, token) pairs at once (Store's
    own, with their meanings): a write applies only while the row still carries the token
    of the claim it belongs to."""

    async def record(self, records: Sequence[Record]) -> set[tuple[int, int]]:
        """Write outcomes; the (id, token) pairs written."""
        ...

    async def heartbeat(self, leases: Sequence[tuple[int, int]]) -> set[int]:
        """Extend the leases; the ids still held."""
        ...

    async def settled(self, leases: Sequence[tuple[int, int]]) -> set[int]:
        """The ids already recorded under that claim (by the source itself)."""
        ...

    async def release(self, leases: Sequence[tuple[int, int]]) -> None:
        """Put the rows back, unattempted."""
        ...
