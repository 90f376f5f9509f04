"""What a relay keeps of the delivery claim's fresh lane (migration 0018; DELIVERY_CLAIM says
how the claim reads it): each endpoint's floor, below which the endpoint has no fresh delivery
pending, and ``seen``, below which every endpoint without a floor has none.

Under a held snapshot (a pg_dump, a report, an idle transaction) every delivery claimed since
leaves a dead entry in the fresh lane's index; read from a floor, a claim passes only those
claimed since its relay last looked, not all of them. Pure: the store runs the statements."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

# How many ids past ``seen`` one claim reads: a fan-out of a large backlog is found over
# several claims (the relay claims again at once while ``seen`` is below the highest id),
# each reading at most this many of its rows.
FOUND_CHUNK = 2000

# How often the floors are checked whole (DELIVERY_FLOORS), in seconds, by the reaper's pass:
# what a floor cannot see (a delivery written by hand in a transaction that committed late, or
# by a relay of an earlier release, which fans out without the lock) waits at most this long.
# Under a held snapshot the check passes every dead entry of the lane: off the claim's path.
CHECK_EVERY = 300.0


@dataclass(slots=True)
class Floors:
    """Each endpoint's floor and ``seen``; ``None`` floors until they have been read whole."""

    floors: dict[int, int] | None = None
    seen: int = 0
    epoch: str | None = None  # the ids' (DELIVERY_CLAIM): another means ids handed out again
    checked_at: float = field(default=float("-inf"))  # monotonic time of the last whole read

    def due(self, now: float) -> bool:
        """Whether the next claim reads the floors whole first: never read, or not for
        CHECK_EVERY."""
        return self.floors is None or now - self.checked_at >= CHECK_EVERY

    def as_json(self) -> str:
        """The floors as DELIVERY_CLAIM takes them (:floors)."""
        floors = {str(k): v for k, v in (self.floors or {}).items()}
        return json.dumps(floors, separators=(",", ":"))

    def read(
        self,
        firsts: Iterable[tuple[int, int]],
        top: int,
        epoch: str,
        before: tuple[dict[int, int], int] | None = None,
    ) -> list[int]:
        """After DELIVERY_FLOORS: each endpoint's first fresh delivery pending (``firsts``),
        the highest id (``top``) and the ids' epoch. The first read (or one in another epoch)
        takes them. A later one (a check, ``before`` the floors and seen as they were just
        before it) lowers a floor where a delivery was below what they said then, and gives
        one to an endpoint that had none: a delivery above them was pending in the check's
        snapshot but may have been claimed since (claims run beside the check), and is the
        claims' to find. Returns the endpoints where a delivery was below (written late, or
        ids handed out again)."""
        if self.floors is None or epoch != self.epoch or before is None:
            self.floors = {endpoint: first - 1 for endpoint, first in firsts}
            self.seen = top
            self.epoch = epoch
            return []
        floors, seen = before
        missed = []
        for endpoint, first in firsts:
            if first <= floors.get(endpoint, seen):
                missed.append(endpoint)
                floor = self.floors.get(endpoint)
                self.floors[endpoint] = first - 1 if floor is None else min(floor, first - 1)
        return missed

    def claimed(
        self,
        floors: Iterable[tuple[int, int | None]],
        seen: int,
        epoch: str,
        given: tuple[dict[int, int], str | None],
    ) -> bool:
        """After DELIVERY_CLAIM, ``given`` the floors and epoch it started from: the next
        floors it gave (``None``: the endpoint has no fresh delivery pending), the next
        ``seen`` and the ids' epoch. A floor a check moved while the claim ran (it found a
        delivery below) keeps the lower of the two; a check that read everything afresh in
        another epoch meanwhile keeps what it read. False when the epoch changed or ``seen``
        went back (ids handed out again, or the newest deliveries deleted): the floors are
        then read whole at the next claim."""
        started, started_in = given
        if self.floors is None or self.epoch != started_in:
            return True  # not read yet, or read afresh meanwhile: nothing to move
        if epoch != self.epoch or seen < self.seen:
            self.floors = None
            return False
        for endpoint, floor in floors:
            now = self.floors.get(endpoint)
            if now != started.get(endpoint) and now is not None:
                floor = now if floor is None else min(now, floor)
            if floor is None:
                self.floors.pop(endpoint, None)
            else:
                self.floors[endpoint] = floor
        self.seen = seen
        return True


__all__ = ["CHECK_EVERY", "FOUND_CHUNK", "Floors"]
