"""An ordered destination's owner: one relay at a time claims it, reading each row once.

The walk over every key (queries.CLAIM_ORDERED) lets several relays claim one ordered
destination together, each seeing the others' rows in flight in the table. Its cost grows with
the rows already delivered while a snapshot is held (a pg_dump, a report, an idle transaction):
each key's walk passes every dead entry of the key, and every claim reads the keys in flight
from an index that keeps one dead entry per row ever claimed. docs/performance.md measured
the median latency going from 50 ms to 900 ms in 150 s at 3,000 events/s over 1,000 keys.

The owner of a destination (the relay holding its session lock, see queries.OWN_ORDERED) knows
the rows in flight itself: its own, and those of the owner before it that were still running
when it took over. It reads fresh rows once, in id order from where its last reading stopped
(queries.CLAIM_OWNED), and keeps in memory those whose key is busy; the rows a key's order
depends on besides (retried, reaped, replayed, failed) are read at each claim from indexes that
hold only them. Other relays serving the destination stand by, and one of them takes over
within a poll interval once the owner's connection ends.

The owner claims as the walk does (and the walk's own rules hold) while a relay of an earlier
release serves the destination, since only then does each see the other's rows in flight, and
for a while after more rows waited in memory than MEMORY_CAP (a long outage of the sink, a key
held by a poison row with a backlog behind it): the walk never keeps a row, so no key starves
for lack of room.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

import structlog

from relay.db.owned import OwnedLane

log = structlog.get_logger("relay")

# Rows an owner keeps in memory per destination (about 40 bytes each) before it claims by
# walking the keys instead, until its backlog is short again.
MEMORY_CAP = 200_000

# How long an owner whose memory went past MEMORY_CAP walks the keys before it reads fresh rows
# again (from the start of the destination): doubled each time the cap is hit again, up to
# WALK_AT_MOST, and back to WALK_FIRST once fewer than a tenth of the cap are kept.
WALK_FIRST = 60.0
WALK_AT_MOST = 600.0

# How often an owner looks for relays of an earlier release serving its destination, and how
# recently such a relay must have said it is alive (relays register every 10 s at most).
PEERS_EVERY = 5.0
PEERS_SEEN_WITHIN = 30.0


class Mode(Enum):
    STANDBY = "standby"  # another relay owns the destination
    OWNED = "owned"  # claimed with CLAIM_OWNED
    WALK = "walk"  # claimed with CLAIM_ORDERED


@dataclass(slots=True)
class Ownership:
    """One owned destination: its lane, its mode, and the rows in flight when it was taken."""

    lane: OwnedLane = field(default_factory=OwnedLane)
    mode: Mode = Mode.OWNED
    # Keyed rows running when this relay became the owner (id -> (token, key)): their keys
    # wait until they are not running.
    foreign: dict[int, tuple[int, str]] = field(default_factory=dict)
    foreign_read: bool = False
    peers: bool = False  # a relay of an earlier release serves the destination
    peers_checked: float = float("-inf")
    capped: bool = False  # walking because memory held more than MEMORY_CAP rows
    walk_until: float = 0.0  # when capped: monotonic time to read fresh rows again
    walk_for: float = WALK_FIRST

    def busy(self, mine: Iterable[str]) -> set[str]:
        keys = set(mine)
        keys.update(key for _, key in self.foreign.values())
        return keys

    def due_for_peers(self, now: float) -> bool:
        return now - self.peers_checked >= PEERS_EVERY

    def walk(self, why: str, destination: str) -> None:
        if self.mode is not Mode.WALK:
            log.info("relay.ordered.walking", destination=destination, reason=why)
        self.mode = Mode.WALK
        self.lane.reset()

    def owned_again(self, destination: str) -> None:
        """Back from the walk: read the rows again from the start, and the keys in flight
        (a relay of an earlier release may have claimed some)."""
        log.info("relay.ordered.owned", destination=destination)
        self.mode = Mode.OWNED
        self.capped = False
        self.lane.reset()
        self.foreign.clear()
        self.foreign_read = False
