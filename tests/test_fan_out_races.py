"""Deliveries claimed by their fan-out, against what runs beside it: a retried fan-out of the
same events and the settling of a lost one, an application's replay left open, and a long wait
for the in-flight lock (found by the second review of the fan-out's claim)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import SimpleNamespace

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.dburl import to_asyncpg_dsn
from relay.db import queries
from relay.db.pool import create_pool
from relay.db.queries.render import render_ops
from relay.db.store import Store
from relay.model import Envelope
from relay.ops.replay_queries import REPLAY_EVENT, REPLAY_EVENT_INSERT
from relay.sinks.endpoints.state import EndpointState
from relay.sinks.endpoints.store import DeliveryStore
from relay.tools.bench.common import DESTINATION
from relay.tools.bench.fanout_setup import add_events, register
from relay.tools.bench.fanout_sql import PROBE_CLAIM_ALL
from tests.support.fan_outs import (  # noqa: F401  (fixtures)
    LEASE,
    conn_fixture,
    endpoints_fixture,
    store_fixture,
)
from tests.support.receiver import Receiver
from tests.test_delivery_lanes import _claim_all, _hold
from tests.test_endpoint_delivery import (
    DEST,
    add_endpoint,
    aengine,  # noqa: F401  (fixture)
    enqueue,
)
from tests.test_endpoint_source import served


async def test_a_late_settle_never_puts_back_what_a_retried_fan_out_sends(
    conn: asyncpg.Connection,
    store: DeliveryStore,
    endpoints: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fan-out fails before it commits and so does its settle; the retried fan-out of the
    same events commits, and the reaper's settle runs before it has noted what it claimed:
    the settle put those back, and the claim sent them a second time (found by review)."""
    await add_events(conn, 3)
    held = await _hold(conn, "lanes")
    room = dict.fromkeys(endpoints, 16)
    real_after = DeliveryStore._after
    real_call = store.store.call
    state = {"f1": True, "settle_fails": True}
    settling: list[asyncio.Task[None]] = []

    async def after(self: DeliveryStore, lock: str, *args: object) -> object:
        if lock == queries.FAN_OUT_LOCK and state["f1"]:
            state["f1"] = False
            raise OSError("connection refused")  # never reached the server
        answer = await real_after(self, lock, *args)
        if lock == queries.FAN_OUT_LOCK:
            settling.append(asyncio.create_task(self.settle()))  # the reaper's pass
            await asyncio.sleep(0.2)
        return answer

    async def call(method: str, sql: str, *args: object) -> object:
        if sql == queries.FAN_OUT_SETTLE and state["settle_fails"]:
            state["settle_fails"] = False
            raise OSError("connection refused")
        return await real_call(method, sql, *args)

    monkeypatch.setattr(DeliveryStore, "_after", after)
    monkeypatch.setattr(store.store, "call", call)
    with pytest.raises(OSError):
        await store.fan_out_claiming(held, "none", room)
    assert store._unsettled == [[i for i, _ in held]]
    _, sent, _, _ = await store.fan_out_claiming(held, "none", room)  # the sink's retry
    await asyncio.gather(*settling)
    assert len(sent) == 9 and store.holding() == 9
    assert await _claim_all(store) == []  # none put back, none claimed again
    statuses = await conn.fetch("SELECT status, locked_by, claims FROM outbox_deliveries")
    assert {tuple(r) for r in statuses} == {("running", "lanes", 1)}


async def test_a_replay_left_open_holds_up_no_claim_through_the_sweep(
    db_url: str, conn: asyncpg.Connection, store: DeliveryStore, endpoints: list[int]
) -> None:
    """An application's replay of an event, not yet committed, locks each of its deliveries;
    a claim's sweep waited for one of a moved endpoint while it held the in-flight lock, and
    every claim and fan-out waited behind it (found by review). The sweep skips it."""
    a, _, c = endpoints
    await add_events(conn, 1)
    [(event, _)] = held = await _hold(conn, "lanes")
    await store.fan_out(held, "none")
    await conn.execute("UPDATE outbox_endpoints SET destination = 'legacy' WHERE id = $1", c)
    app = await asyncpg.connect(to_asyncpg_dsn(db_url))
    pool2 = await create_pool(to_asyncpg_dsn(db_url), "r2", 2)
    try:
        other = DeliveryStore(Store(pool2, "public", "r2", LEASE))
        await other._read_floors()
        tx = app.transaction()
        await tx.start()
        await app.fetch(render_ops(REPLAY_EVENT, "public"), event, None)  # left open
        sweeping = asyncio.create_task(
            store.claim([DESTINATION], [4], [4], 100, [], 1000, None, {}, sweep=True)
        )
        await asyncio.sleep(0.5)
        await add_events(conn, 2)
        fan_out = asyncio.create_task(
            store.fan_out_claiming(await _hold(conn, "lanes"), "none", {a: 4})
        )
        await asyncio.sleep(0.5)
        claim = asyncio.create_task(
            other.claim([DESTINATION], [4], [4], 100, [], 1000, None, {}, sweep=False)
        )
        done, _ = await asyncio.wait({claim, sweeping, fan_out}, timeout=3)
        await tx.commit()
        await asyncio.gather(sweeping, fan_out, claim)
    finally:
        await app.close()
        await pool2.close()
    assert len(done) == 3, "a claim or a fan-out waited for an application's replay"


async def test_rows_claimed_after_a_long_wait_for_the_in_flight_lock_are_held_here_too(
    db_url: str, conn: asyncpg.Connection, endpoints: list[int]
) -> None:
    """The rows' lease starts once the lock is held, in the table (statement_timestamp) and
    here: measured from before the wait, they were handed over with their lease over here,
    and put back unsent (found by review)."""
    lease = 2.0
    pool = await create_pool(to_asyncpg_dsn(db_url), "r1", 3)
    other = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        store = DeliveryStore(Store(pool, "public", "r1", lease))
        await store._read_floors()
        await add_events(conn, 3)
        mine = await _hold(conn, "r1")
        tx = other.transaction()
        await tx.start()
        await other.execute(render_ops(queries.FAN_OUT_LOCK, "public"), store._serial)
        fan_out = asyncio.create_task(store.fan_out_claiming(mine, "none", {endpoints[1]: 4}))
        await asyncio.sleep(lease + 1)
        await tx.commit()
        _, sent, until, _ = await fan_out
        left = until - time.monotonic()
    finally:
        await other.close()
        await pool.close()
    assert sent and left > lease / 2, left


@pytest.mark.parametrize("unsettled", [False, True])
async def test_a_settle_behind_a_fan_out_waiting_for_a_replay_holds_up_no_claim(
    db_url: str, conn: asyncpg.Connection, unsettled: bool
) -> None:
    """An application's replay insert (REPLAY_EVENT_INSERT) left open holds the fan-outs' lock.
    A fan-out that claims waits for it holding DeliveryStore._at_once. A settle (the reaper's
    pass, or an earlier fan-out's except path) then takes _claiming and waits for _at_once:
    every delivery claim of this relay waited behind it, as long as the replay was open
    (found by the third review)."""
    a, b, _ = await register(conn, [f"http://127.0.0.1:{9000 + i}/" for i in range(3)])
    pool = await create_pool(to_asyncpg_dsn(db_url), "lanes", 3)
    app = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        store = DeliveryStore(Store(pool, "public", "lanes", LEASE))
        assert await _claim_all(store) == []  # floors read
        await add_events(conn, 3)
        held = await _hold(conn, "lanes")
        tx = app.transaction()
        await tx.start()
        await app.fetchval(
            render_ops(REPLAY_EVENT_INSERT, "public"), held[0][0], b, DESTINATION, store._serial
        )  # left open
        fan_out = asyncio.create_task(store.fan_out_claiming(held[1:], "none", {a: 4}))
        await asyncio.sleep(0.3)
        settling = None
        if unsettled:
            store._unsettled.append([10**9])  # an earlier fan-out's answer was lost
            settling = asyncio.create_task(store.settle())  # the reaper's pass
            await asyncio.sleep(0.3)
        claim = asyncio.create_task(
            store.claim([DESTINATION], [4], [4], 100, [], 1000, None, {}, sweep=False)
        )
        started = time.monotonic()
        done, _ = await asyncio.wait({claim}, timeout=3)
        took = time.monotonic() - started
        await tx.commit()
        await asyncio.gather(fan_out, claim, *([settling] if settling else []))
    finally:
        await app.close()
        await pool.close()
    assert claim in done, f"this relay's delivery claim waited {took:.1f} s for the replay"


async def test_two_fan_outs_at_once_claim_no_more_than_the_room(
    db_url: str,
    conn: asyncpg.Connection,
    aengine: AsyncEngine,  # noqa: F811
    make_receiver: Callable[..., Receiver],
) -> None:
    """The room of a fan-out is read before it waits for _at_once (a fan-out before it, of
    another batch of the same destination): both claimed the endpoint's whole queue (found by
    the third review)."""
    r = make_receiver()
    ep = await add_endpoint(aengine, r.url)
    ids = await enqueue(db_url, [{"payload": {"n": i}} for i in range(40)])
    async with served(db_url, max_concurrency=1, slow_concurrency=1) as sv:
        source = sv.source
        await source.store._read_floors()
        adopted: list[object] = []
        source.adopt = adopted.extend
        cfg = source.destinations[DEST]
        source.states[ep.id] = EndpointState(ep.id, DEST, cfg, latency=0.01)
        held = sorted((row[0], row[1]) for row in await conn.fetch(PROBE_CLAIM_ALL, "r1"))
        assert [i for i, _ in held] == ids
        lease = SimpleNamespace(held=lambda _id: True)
        envs = [
            Envelope(i, DEST, None, b"{}", "application/json", {}, 0, 0.0, t, lease)  # type: ignore[arg-type]
            for i, t in held
        ]
        depth = cfg.max_concurrency * 16
        await asyncio.gather(source.fan_out(envs[:12], "none"), source.fan_out(envs[12:24], "none"))
        in_hand = source.states[ep.id].in_hand
    assert len(adopted) <= depth, (len(adopted), depth, in_hand)
