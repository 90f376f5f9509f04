"""What the demo reads back from the outbox: whether the relay has delivered everything, and
the attempts it counted for an event."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import asyncpg

from outbox.sql import load

_q = load("relay.tools.demo", "progress.sql", binds="numbered")

PROGRESS = _q["progress"]
ATTEMPTS = _q["attempts"]


@dataclass(frozen=True)
class Progress:
    events: int
    events_delivered: int
    deliveries: int  # of the endpoints destination's events, one per matching endpoint
    deliveries_delivered: int


async def progress(conn: asyncpg.Connection) -> Progress:
    row = await conn.fetchrow(PROGRESS)
    assert row is not None  # aggregates: always a row
    return Progress(**dict(row))


async def wait_delivered(
    conn: asyncpg.Connection, events: int, deliveries: int, timeout: float
) -> Progress:
    """Once ``events`` events and ``deliveries`` deliveries are delivered, or at ``timeout``:
    where things stand."""
    deadline = time.monotonic() + timeout
    while True:
        now = await progress(conn)
        done = now.events_delivered >= events and now.deliveries_delivered >= deliveries
        if done or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.05)


async def attempts(conn: asyncpg.Connection, event_id: int) -> int | None:
    n: int | None = await conn.fetchval(ATTEMPTS, event_id)
    return n
