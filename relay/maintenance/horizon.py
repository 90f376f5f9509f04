"""The oldest holder of the database's xmin horizon (relay/db/snapshots.py), watched: the
oldest_snapshot gauges, and ``relay.snapshot.held`` / ``relay.snapshot.released`` past
``relay.snapshot_warning``."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from relay.db.snapshots import SnapshotHolder
from relay.db.store import Store
from relay.obs.metrics import Metrics

log = structlog.get_logger("relay")

# relay.snapshot.held again while the same holder persists, at most this often.
REPEAT_EVERY = 60.0


class Horizon:
    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        warning: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.warning = warning  # seconds; 0: never warn
        self.clock = clock
        # The holder last read and when this relay first saw it: the age of one whose age
        # the database does not tell (a slot, a backend hidden from the relay's role) is at
        # least that long.
        self._seen: tuple[SnapshotHolder, float] | None = None
        # The holder last warned about, and when.
        self._warned: tuple[SnapshotHolder, float] | None = None

    async def __call__(self) -> None:
        holder = await self.store.snapshot_holder()
        now = self.clock()
        if holder is None:
            self._seen = None
            self.metrics.oldest_snapshot.set(0)
            self.metrics.oldest_snapshot_xids.set(0)
            self._released(None)
            return
        if self._seen is None or self._seen[0].identity != holder.identity:
            self._seen = (holder, now)
        observed = holder.age_s is None
        age = holder.age_s if holder.age_s is not None else now - self._seen[1]
        self.metrics.oldest_snapshot.set(max(0.0, age))
        self.metrics.oldest_snapshot_xids.set(holder.xid_age)
        if not holder.over(self.warning, age):
            self._released(holder)
            return
        warned = self._warned
        if warned is not None and warned[0].identity == holder.identity:
            if now - warned[1] < REPEAT_EVERY:
                return
        else:
            self._released(holder)
        self._warned = (holder, now)
        log.warning(
            "relay.snapshot.held",
            **_who(holder),
            database=holder.database,
            state=holder.state,
            command=holder.command,
            age_s=round(age, 1),
            # A lower bound: the database does not say when it began; this relay first saw it
            # age_s ago.
            age_observed=observed,
            xid_age=holder.xid_age,
            visible=holder.visible,
            action=holder.action(),
            **({} if holder.visible else {"hint": "grant pg_read_all_stats to the relay's role"}),
        )

    def _released(self, now_held: SnapshotHolder | None) -> None:
        """The holder warned about is gone (``now_held``: the oldest now, if any)."""
        warned = self._warned
        if warned is None or (now_held is not None and now_held.identity == warned[0].identity):
            return
        self._warned = None
        holder = warned[0]
        log.info(
            "relay.snapshot.released",
            **_who(holder),
            xid_age=holder.xid_age,
        )


def _who(holder: SnapshotHolder) -> dict[str, object]:
    """Who holds the horizon, as both log lines name it."""
    return {
        "kind": holder.kind,
        "pid": holder.pid,
        "name": holder.name,
        "application_name": holder.application_name,
        "user": holder.user,
    }
