"""The retries this relay writes, and when each comes due (DeliverySource wakes its claim
then: finished deliveries look only for fresh deliveries, DELIVERY_LOOK, and nothing else
claims a retry before the poll).

A retry that came due and that this relay has not claimed since is *waiting*: the claim
woken when it came due may have left it (its endpoint's request slots were taken, or its
circuit open), and the records of the endpoint's deliveries claim again (ten times a second
at most: DeliveriesBase._retry_has_room), as they do while a fresh delivery of it waits.
That lasts a poll interval at most (another relay may have claimed it: the poll has run
since, and this relay cannot tell)."""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

WAKE_ONLY = -1  # an entry of the wake-ups' heap that is no retry (a circuit's probe)
# Retries followed one by one, at most: past that (a failing endpoint's backlog of a million
# deliveries, retried), a retry only wakes the claim, at the next tenth of a second after it
# is due, one wake-up for all those due then; none waits (_retry_has_room) unclaimed.
TRACKED = 100_000
BUCKET = 0.1


class DueRetries:
    """When this relay's retries come due (monotonic), and which came due unclaimed."""

    def __init__(self, grace: float) -> None:
        self.grace = grace  # seconds a retry that came due stays waiting, unclaimed
        self._seq = itertools.count()
        # Retries written and not claimed since: delivery id -> [due, seq, endpoint, came
        # due].
        self._ids: dict[int, list[Any]] = {}
        self._heap: list[tuple[float, int, int]] = []  # (due, seq, id), not yet due
        self._came: deque[tuple[float, int, int]] = deque()  # came due, in due order
        self._waiting: Counter[int] = Counter()  # endpoint -> retries that came due unclaimed
        self._buckets: set[float] = set()  # wake-ups of retries not followed (TRACKED)

    def wrote(self, retries: Iterable[tuple[int, int, float]]) -> None:
        """Retries written: (delivery id, endpoint id, when due)."""
        for delivery, endpoint, due in retries:
            self.claimed(delivery)  # an earlier retry of it not seen claimed: this one now
            if len(self._ids) >= TRACKED:
                at = math.ceil(due / BUCKET) * BUCKET
                if at not in self._buckets:
                    self._buckets.add(at)
                    self.wake_at(at)
                continue
            seq = next(self._seq)
            self._ids[delivery] = [due, seq, endpoint, False]
            heapq.heappush(self._heap, (due, seq, delivery))

    def wake_at(self, at: float) -> None:
        """A wake-up at ``at`` that is no retry of this relay's (a circuit's probe)."""
        heapq.heappush(self._heap, (at, next(self._seq), WAKE_ONLY))

    def next_due(self) -> float | None:
        """When the next retry comes due (or a wake-up is asked for); None: none waits."""
        heap = self._heap
        while heap and heap[0][2] != WAKE_ONLY:
            entry = self._ids.get(heap[0][2])
            if entry is not None and entry[1] == heap[0][1]:
                break
            heapq.heappop(heap)  # claimed, or written again, since
        return heap[0][0] if heap else None

    def claimed(self, delivery: int) -> None:
        """Claimed by this relay (or written again): no longer waiting. Its entries in the
        heap and among those that came due are skipped when they leave."""
        entry = self._ids.pop(delivery, None)
        if entry is not None and entry[3]:
            self._left(entry[2])

    def _left(self, endpoint: int) -> None:
        self._waiting[endpoint] -= 1
        if self._waiting[endpoint] <= 0:
            del self._waiting[endpoint]

    def came_due(self, now: float) -> None:
        """The retries due by ``now`` came due; those that came due more than ``grace`` ago
        are forgotten."""
        while self._heap and self._heap[0][0] <= now:
            due, seq, delivery = heapq.heappop(self._heap)
            self._buckets.discard(due)
            entry = self._ids.get(delivery)
            if entry is None or entry[1] != seq:
                continue  # a wake-up only, or claimed (or written again) since
            entry[3] = True
            self._waiting[entry[2]] += 1
            self._came.append((due, seq, delivery))
        while self._came and self._came[0][0] + self.grace < now:
            _, seq, delivery = self._came.popleft()
            entry = self._ids.get(delivery)
            if entry is not None and entry[1] == seq:
                del self._ids[delivery]
                self._left(entry[2])

    def waiting(self, endpoint: int, now: float) -> bool:
        """Whether a retry of ``endpoint`` this relay wrote came due (less than ``grace``
        ago) and was not claimed by it since."""
        self.came_due(now)
        return endpoint in self._waiting
