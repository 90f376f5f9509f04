"""What the owner of an ordered destination knows of its fresh rows (relay/pipeline/ordered.py): the
lane :meth:`relay.db.store.Store.claim_owned` reads into and the claimer takes rows from."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class OwnedLane:
    """What an owner knows of its destination's fresh rows: every one up to ``hw`` has been
    read, and those not claimed yet wait in ``queues`` (per key, in id order; rows without a
    key in ``keyless``)."""

    hw: int = 0
    top: int = 0  # the highest id FENCE has seen (its walk back from the end stops there)
    epoch: tuple[object, ...] = ()
    queues: dict[str, deque[int]] = field(default_factory=dict)
    keyless: deque[int] = field(default_factory=deque)
    count: int = 0
    full: bool = False  # the last claim filled its batch

    def reset(self, epoch: tuple[object, ...] = ()) -> None:
        """Forget every row read: the next claim reads from the start of the destination."""
        self.hw = self.top = 0
        self.epoch = epoch
        self.queues.clear()
        self.keyless.clear()
        self.count = 0
        self.full = False

    def candidates(
        self, busy: Collection[str], keyless_limit: int
    ) -> tuple[list[int], list[str], list[int]]:
        """Each key's lowest row in memory, for the keys with no row in flight, and the
        lowest rows without a key."""
        ids: list[int] = []
        keys: list[str] = []
        for key, queue in self.queues.items():
            if key not in busy:
                ids.append(queue[0])
                keys.append(key)
        loose = [self.keyless[i] for i in range(min(keyless_limit, len(self.keyless)))]
        return ids, keys, loose

    def absorb(
        self,
        taken: Iterable[tuple[int, str | None]],
        read: Iterable[tuple[int, str | None]],
        hw: int,
    ) -> None:
        """``taken``: rows (id, key) claimed, or found no longer pending, of those in memory
        (others are ignored); ``read``: rows read and not claimed, in id order, all above the
        previous ``hw``; ``hw``: up to where every fresh row has now been read."""
        gone_keyless: set[int] = set()
        for i, key in taken:
            if i > self.hw:
                continue
            if key is None:
                gone_keyless.add(i)
                continue
            queue = self.queues.get(key)
            if queue is None:
                continue
            if queue[0] == i:
                queue.popleft()
            else:
                try:
                    queue.remove(i)
                except ValueError:
                    continue
            self.count -= 1
            if not queue:
                del self.queues[key]
        if gone_keyless:
            before = len(self.keyless)
            self.keyless = deque(i for i in self.keyless if i not in gone_keyless)
            self.count -= before - len(self.keyless)
        for i, key in read:
            if key is None:
                self.keyless.append(i)
            else:
                queue = self.queues.get(key)
                if queue is None:
                    self.queues[key] = deque((i,))
                else:
                    queue.append(i)
            self.count += 1
        self.hw = max(self.hw, hw)
