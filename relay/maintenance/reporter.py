"""What the relay reports about rows it is not delivering: rows of destinations no relay
serves (waiting, or failed after ``unknown_grace`` with ``unknown_destinations = "fail"``),
keys blocked by a failed row, and the pending gauges."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping

import structlog

from relay.config import RelaySettings
from relay.db.store import Store
from relay.obs.metrics import Metrics
from relay.pipeline.routes import Route

log = structlog.get_logger("relay")

# A destination counts as served by another relay if one that serves it was seen this
# recently (rolling restarts included): unknown_destinations = "fail" spares its rows.
SERVED_WITHIN = 600.0
BLOCKED_KEYS_LOGGED = 20


class Reporter:
    def __init__(
        self,
        settings: RelaySettings,
        known: list[str],
        routes: Mapping[str, Route],
        store: Store,
        metrics: Metrics,
    ) -> None:
        self.settings = settings
        self.known = known  # every configured destination
        self.routes = routes
        self.store = store
        self.metrics = metrics
        self._started_at = time.monotonic()

    async def __call__(self) -> None:
        await self._blocked_keys()
        await self._unknown_destinations()

    async def pending(self) -> None:
        """The pending gauges (rows and the oldest's age, per destination)."""
        rows = await self.store.pending_stats()
        if rows is not None:
            self.metrics.set_pending(self.routes, rows)

    async def _unknown_destinations(self) -> None:
        # Destinations no relay serves: not this one's, and not one that any relay seen in
        # the last SERVED_WITHIN seconds serves (relays may split destinations between them).
        rs = self.settings
        # Not before this relay has watched the registry for unknown_grace itself: relays
        # that started with it (a new deployment) have registered by then.
        watched = time.monotonic() - self._started_at >= rs.unknown_grace
        if rs.unknown_destinations == "fail" and watched:
            failed = await self.store.fail_unknown_destinations(
                self.known, SERVED_WITHIN, rs.unknown_grace
            )
            for dest, n in Counter(r["destination"] for r in failed).items():
                log.error(
                    "relay.destination.unknown",
                    destination=dest,
                    rows=n,
                    action="marked failed (no running relay serves it); add it to a relay "
                    "config, then outbox-relay retry",
                )
            return
        for r in await self.store.unknown_destinations(self.known, SERVED_WITHIN):
            log.warning(
                "relay.destination.unknown",
                destination=r["destination"],
                rows=r["rows"],
                oldest=r["oldest"].isoformat(),
                action=f"rows wait as pending; add [destinations.{r['destination']}] to the "
                "relay config of some relay",
            )

    async def _blocked_keys(self) -> None:
        blocking = [name for name, route in self.routes.items() if route.blocks_keys]
        if not blocking:
            return
        rows = await self.store.blocked_keys(blocking)
        per: Counter[str] = Counter(r["destination"] for r in rows)
        for d in blocking:
            self.metrics.blocked_keys.labels(d).set(per.get(d, 0))
        for r in rows[:BLOCKED_KEYS_LOGGED]:
            log.warning(
                "relay.key.blocked",
                destination=r["destination"],
                key=r["key"],
                failed_id=r["failed_id"],
                waiting=r["waiting"],
                error=r["last_error"],
                action=f"outbox-relay retry --id {r['failed_id']} to deliver it again, or "
                f"outbox-relay skip {r['failed_id']} to let the key move on",
            )
        if len(rows) > BLOCKED_KEYS_LOGGED:
            log.warning("relay.key.blocked.more", keys=len(rows) - BLOCKED_KEYS_LOGGED)
