"""The statements that write the deliveries a relay holds (records, heartbeats, releases)
lock them in id order, whatever order they were handed: a record and a heartbeat over the
same rows, each in the order its rows came, deadlocked (`bench fanout --scenario steady`
with the relay behind: rows held past a third of their lease are renewed while they are
recorded; one of the two failed, and its outcomes waited for a retry)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from relay.sinks.endpoints.rows import Claimed
from relay.sinks.endpoints.store import DeliveryStore
from relay.tools.bench.common import DESTINATION
from relay.tools.bench.fanout import _delivered
from relay.tools.bench.fanout_setup import add_events
from tests.test_delivery_lanes import (  # noqa: F401  (fixtures)
    ROOM,
    _claim_all,
    _hold,
    conn,
    store,
)

Write = Callable[[DeliveryStore, list[Claimed]], Awaitable[object]]
T = TypeVar("T")


async def _heartbeat(s: DeliveryStore, rows: list[Claimed]) -> object:
    return await s.heartbeat([(c.id, c.token) for c in rows])


async def _record(s: DeliveryStore, rows: list[Claimed]) -> object:
    return await s.record([_delivered(c) for c in rows])


async def _release(s: DeliveryStore, rows: list[Claimed]) -> object:
    return await s.release([(c.id, c.token) for c in rows])


async def _locks_the_lower_first(
    db_url: str, table: str, low: int, high: int, write: Awaitable[T]
) -> T:
    """Run ``write`` (of rows ``low`` and ``high`` of ``table``, the higher handed first)
    while another transaction holds ``high``: it must have taken ``low`` before it waits
    for ``high``. Its answer, once ``high`` is let go."""
    other = await asyncpg.connect(to_asyncpg_dsn(db_url))
    probe = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        tx = other.transaction()
        await tx.start()
        await other.execute(f"SELECT 1 FROM {table} WHERE id = $1 FOR UPDATE", high)
        task = asyncio.ensure_future(write)
        for _ in range(100):
            waiting = await probe.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND datname = current_database()"
            )
            if waiting:
                break
            await asyncio.sleep(0.02)
        assert waiting, "the write never waited for the row held"
        with pytest.raises(asyncpg.LockNotAvailableError):
            await probe.execute(f"SELECT 1 FROM {table} WHERE id = $1 FOR UPDATE NOWAIT", low)
        await tx.rollback()
        return await asyncio.wait_for(task, 10)
    finally:
        await other.close()
        await probe.close()


@pytest.mark.parametrize("write", [_heartbeat, _record, _release])
async def test_a_write_of_held_deliveries_locks_them_in_id_order(
    db_url: str,
    conn: asyncpg.Connection,  # noqa: F811
    store: DeliveryStore,  # noqa: F811
    write: Write,
) -> None:
    await _claim_all(store)
    # A table the planner reads by its primary key for a few ids (as a relay's, not a
    # handful of rows read whole, in the order they lie in: then any order of the ids passed
    # locks them alike).
    await add_events(conn, 700)
    await store.fan_out(await _hold(conn, "lanes"), "none")
    await conn.execute("ANALYZE outbox_deliveries")
    got, _, _ = await store.claim([DESTINATION], [ROOM], [ROOM], 2, [], 1000, None, {})
    low, high = sorted(got, key=lambda c: c.id)
    # Handed the higher id first: it takes the lower one's lock first all the same, then
    # waits for the higher one's.
    await _locks_the_lower_first(
        db_url, "outbox_deliveries", low.id, high.id, write(store, [high, low])
    )


async def test_a_fan_out_locks_the_events_it_records_in_id_order(
    db_url: str,
    conn: asyncpg.Connection,  # noqa: F811
    store: DeliveryStore,  # noqa: F811
) -> None:
    """FAN_OUT is the events' record of an endpoints destination: it runs beside the events'
    heartbeat (in id order), and must take their rows in the same order, whatever order the
    batch came in (the events' claim returns them by run_after, the time their producer's
    transaction began, not by id)."""
    await add_events(conn, 700)
    await conn.execute("ANALYZE outbox")
    held = await _hold(conn, "lanes")
    low, high = held[10], held[500]
    fanned = await _locks_the_lower_first(
        db_url, "outbox", low[0], high[0], store.fan_out([high, low], "none")
    )
    assert set(fanned) == {low[0], high[0]}
