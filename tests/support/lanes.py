"""The delivery claim's last arguments for tests that run DELIVERY_CLAIM themselves: the floors
and ``seen`` a relay starts from (DELIVERY_FLOORS), as DeliveryStore passes them, and what it
holds (nothing)."""

from __future__ import annotations

import asyncpg

from relay.db.queries import DELIVERY_FLOORS
from relay.db.queries.render import render_ops
from relay.sinks.endpoints.lanes import FOUND_CHUNK, Floors


async def lane_args(conn: asyncpg.Connection, schema: str = "public") -> list[object]:
    """:floors, :seen, :chunk and :held of a relay that has just read its floors and holds no
    delivery."""
    rows = await conn.fetch(render_ops(DELIVERY_FLOORS, schema))
    lanes = Floors()
    [(_, top, epoch)] = [r for r in rows if r[0] == -1]
    lanes.read([(r[0], r[1]) for r in rows if r[0] != -1], top, epoch)
    return [lanes.as_json(), lanes.seen, FOUND_CHUNK, "{}"]
