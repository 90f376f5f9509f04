"""The relay's side jobs, each run every so often by :func:`every`: the reaper (expired
leases), pauses (what operators paused), the registry (which relays run, what they serve),
the reporter (unknown destinations, blocked keys, pending counts), retention (deleting
finished rows) and the horizon (the oldest snapshot holding back VACUUM). A job that fails
for a database reason is logged and run again next time."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from outbox.errors import describe
from relay.db.store import DB_ERRORS

log = structlog.get_logger("relay")


async def every(
    interval: float, job: Callable[[], Awaitable[Any]], name: str, first: float = 0.0
) -> None:
    """Run ``job`` after ``first`` seconds, then every ``interval`` (±10%, so that relays
    started together spread out), for ever."""
    await asyncio.sleep(first)
    while True:
        try:
            await job()
        except DB_ERRORS as exc:
            log.warning("relay.maintenance.failed", job=name, error=describe(exc))
        await asyncio.sleep(interval * random.uniform(0.9, 1.1))
