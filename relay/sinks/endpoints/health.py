"""Endpoint health: what the attempts said of their endpoints, written to the table when it
changes (and now and then while all is well), their circuits for `status`, and the endpoints
that failed for too long or answered 410 Gone disabled.
"""

from __future__ import annotations

import time

import structlog

from outbox.errors import describe
from relay.db.store import DB_ERRORS
from relay.sinks.endpoints.base import DeliveriesBase

log = structlog.get_logger("relay.sink.endpoints")


class Health(DeliveriesBase):
    """The source's writing of its endpoints' health."""

    async def _write_health(self) -> None:
        """Write what the attempts said about their endpoints, when it changed (or now and
        then while all is well), and disable those failing too long or gone."""
        assert self.store is not None
        now = time.monotonic()
        changes = {}
        for eid, ok in self._health.items():
            state = self.states.get(eid)
            if state is None:
                continue
            # Written when it changes (state.failing == ok: it was failing and succeeded, or
            # the reverse), and now and then while it stays as it is: a success refreshes
            # last_success_at, a failure re-reads how long it has been failing (disable_after).
            if (
                state.failing is None
                or state.failing == ok
                or now - state.health_written > self.health_refresh
            ):
                changes[eid] = ok
        health, self._health = self._health, {}
        if changes:
            try:
                failing_for = await self.store.health(changes)
            except DB_ERRORS as exc:
                log.warning("relay.endpoints.health_failed", error=describe(exc))
                for eid, ok in health.items():  # kept for the next write
                    self._health[eid] = self._health.get(eid, False) or ok
                return
            for eid, ok in changes.items():
                state = self.states[eid]
                state.failing, state.health_written = not ok, now
                seconds = failing_for.get(eid)
                if seconds is not None and seconds >= state.config.disable_after:
                    await self._disable(
                        eid,
                        f"failing without a success for {seconds / 86400:.1f} days "
                        f"(disable_after {state.config.disable_after:g} s)",
                        state.config.disable_after,
                    )
        circuits, self._circuits = self._circuits, {}
        if circuits:
            try:
                await self.store.circuits(circuits)
            except DB_ERRORS as exc:
                log.warning("relay.endpoints.circuit_write_failed", error=describe(exc))
        gone, self._gone = self._gone, set()
        for eid in gone:
            await self._disable(eid, "the endpoint answered 410 Gone", None)

    async def _disable(self, endpoint_id: int, reason: str, failing_for: float | None) -> None:
        assert self.store is not None
        try:
            done = await self.store.disable(endpoint_id, reason, failing_for)
        except DB_ERRORS as exc:
            log.warning("relay.endpoints.disable_failed", endpoint=endpoint_id, error=describe(exc))
            if failing_for is None:
                self._gone.add(endpoint_id)  # tried again after the next outcomes
            return
        state = self.states.get(endpoint_id)
        if state is not None and failing_for is None:
            state.gone = False  # disabled in the table now: its claims stop there
        if done:
            self.stats["disabled"] += 1
            if state is not None:
                state.disabled_at = time.monotonic()
            if self.metrics is not None:
                dest = state.destination if state is not None else "unknown"
                self.metrics.endpoints_disabled.labels(dest).inc()
            log.warning(
                "relay.endpoints.disabled",
                endpoint=endpoint_id,
                reason=reason,
                hint=f"outbox-relay endpoints enable {endpoint_id} once it is fixed",
            )
