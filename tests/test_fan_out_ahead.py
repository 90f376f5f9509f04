"""The look ahead (ENDPOINTS_AHEAD, FanOuts._look): which endpoints a destination's next
waiting events would reach. The events' claim is paced by the fast endpoints' room while
every other endpoint it reaches is down or sending; an endpoint it does not reach (10,000
registered, 10 matching, in the scale bench) must not stop the pace, and one it reaches must."""

from __future__ import annotations

import json
import random
from typing import Any

import asyncpg
import pytest

from outbox import endpoint_secrets
from outbox.dburl import to_asyncpg_dsn
from relay.db.queries import deliveries as dq
from relay.db.queries.render import render_ops
from tests.support.fan_outs import conn_fixture  # noqa: F401  (the conn fixture)
from tests.test_endpoint_delivery import aengine  # noqa: F401  (fixture)
from tests.test_held_snapshot_deliveries import _nodes

DEST = "d"
RELAY = "ahead-probe"

ENDPOINT = (
    "INSERT INTO outbox_endpoints (destination, url, tenant, event_types, enabled, secret)"
    " VALUES ($1, $2, $3, $4, $5, $6) RETURNING id"
)
EVENT = (
    "INSERT INTO outbox (destination, payload, content_type, tenant, event_type, run_after,"
    " claims) VALUES ($1, '{}', 'application/json', $2, $3, now() + $4 * interval '1 s', $5)"
    " RETURNING id"
)
# What FAN_OUT writes a delivery for, said once more, plainly (the spec the look must keep).
REACHED = (
    "SELECT DISTINCT e.id FROM outbox AS o JOIN outbox_endpoints AS e"
    " ON e.enabled AND e.destination = o.destination"
    " AND (e.tenant = o.tenant OR e.tenant IS NULL)"
    " AND (cardinality(e.event_types) = 0 OR o.event_type = ANY(e.event_types))"
    " WHERE o.id = ANY($1::bigint[])"
)


async def _ahead(conn: asyncpg.Connection, after: int, n: int = 5000) -> set[int] | None:
    """What DeliveryStore.ahead answers: the endpoints reached, or None if more wait."""
    row = await conn.fetchrow(render_ops(dq.ENDPOINTS_AHEAD, "public"), DEST, after, n)
    return None if row[0] >= n or row[1] >= n else set(row[2])


async def test_the_look_reaches_the_endpoints_a_fan_out_would(
    conn: asyncpg.Connection,
) -> None:
    """Random endpoints (of a tenant or every tenant, of some types or all, enabled or not, of
    this destination or another) and random waiting events (fresh, due again, not due yet,
    before the look's start): the look names exactly the endpoints that the events it should
    read reach."""
    rng = random.Random(29)
    secret = endpoint_secrets.generate()
    tenants = ["a", "b", None]
    types = ["x", "y", None]
    for i in range(60):
        await conn.execute(
            ENDPOINT,
            rng.choice([DEST, DEST, "other"]),
            f"http://127.0.0.1:9/{i}",
            rng.choice(tenants),
            rng.choice([[], ["x"], ["y"], ["x", "y"]]),
            rng.random() < 0.8,
            secret,
        )
    for _ in range(25):
        round_ = conn.transaction()  # each round on its own events
        await round_.start()
        try:
            before = await conn.fetchval(EVENT, DEST, "a", "x", 0, 0)
            read: list[int] = []
            for _ in range(rng.randint(1, 6)):
                kind = rng.choice(["fresh", "again", "later", "elsewhere"])
                tenant, etype = rng.choice(tenants), rng.choice(types)
                dest = "other" if kind == "elsewhere" else DEST
                delay, claims = {"fresh": (0, 0), "again": (-5, 1)}.get(kind, (60, 0))
                eid = await conn.fetchval(EVENT, dest, tenant, etype, delay, claims)
                if kind in ("fresh", "again"):
                    read.append(eid)
            want = {r[0] for r in await conn.fetch(REACHED, read)}
            got = await _ahead(conn, before)
            assert got == want, (read, got, want)
        finally:
            await round_.rollback()


async def test_the_look_reads_at_most_its_count_and_says_when_more_wait(
    conn: asyncpg.Connection,
) -> None:
    """The look reads at most ``n`` events of each lane; when as many wait, it did not see
    them all and says nothing (an event past them may be another tenant's: found by review,
    a new endpoint's event 6,000 events behind a burst waited 22 s)."""
    secret = endpoint_secrets.generate()
    first = await conn.fetchval(ENDPOINT, DEST, "http://127.0.0.1:9/a", "a", [], True, secret)
    last = await conn.fetchval(ENDPOINT, DEST, "http://127.0.0.1:9/b", "b", [], True, secret)
    for _ in range(3):
        await conn.fetchval(EVENT, DEST, "a", None, 0, 0)
    await conn.fetchval(EVENT, DEST, "b", None, 0, 0)
    assert await _ahead(conn, 0, 3) is None
    assert await _ahead(conn, 0, 4) is None
    assert await _ahead(conn, 0, 5) == {first, last}


async def test_the_look_starts_after_the_last_event_fanned_out_and_matches_by_index(
    db_url: str, conn: asyncpg.Connection
) -> None:
    """Statistics of empty tables (a new deployment's), 10,000 endpoints of other tenants and
    3,000 events fanned out while a snapshot was held (their entries stay in the fresh lane's
    index): the look reads that index from the last event fanned out on, and the endpoints of
    the events' tenant by the match index, not the table."""
    await conn.execute("ANALYZE")
    secret = endpoint_secrets.generate()
    await conn.execute(
        "INSERT INTO outbox_endpoints (destination, url, tenant, secret)"
        " SELECT $1, 'http://127.0.0.1:9/' || i, 'other-' || i, $2"
        " FROM generate_series(1, 10000) AS i",
        DEST,
        secret,
    )
    mine = [
        await conn.fetchval(ENDPOINT, DEST, f"http://127.0.0.1:9/m{i}", "m", [], True, secret)
        for i in range(10)
    ]
    holder = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        top = await conn.fetchval(
            "WITH e AS (INSERT INTO outbox (destination, payload, content_type, tenant)"
            " SELECT $1, '{}', 'application/json', 'm' FROM generate_series(1, 3000)"
            " RETURNING id) SELECT max(id) FROM e",
            DEST,
        )
        await conn.execute("UPDATE outbox SET status = 'delivered' WHERE id <= $1", top)
        for _ in range(5):
            await conn.fetchval(EVENT, DEST, "m", "x", 0, 0)
        sql = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + render_ops(dq.ENDPOINTS_AHEAD, "public")
        raw = await conn.fetchval(sql, DEST, top, 5000)
        plan: dict[str, Any] = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
        assert await _ahead(conn, top) == set(mine)
    finally:
        await holder.close()
    nodes = list(_nodes(plan))
    fresh = [n for n in nodes if n.get("Index Name") == "outbox_fresh_idx"]
    assert fresh and all("id >" in n.get("Index Cond", "") for n in fresh), json.dumps(plan)
    assert sum(n.get("Shared Hit Blocks", 0) for n in fresh) < 20, json.dumps(fresh)
    on_endpoints = [n for n in nodes if n.get("Relation Name") == "outbox_endpoints"]
    assert all(n["Node Type"] != "Seq Scan" for n in on_endpoints), json.dumps(plan)
    assert sum(n.get("Actual Rows", 0) * n.get("Actual Loops", 1) for n in on_endpoints) <= 10


async def test_a_failed_look_paces_nothing_until_it_may_look_again(db_url: str) -> None:
    """A look that fails (the database gone a moment) leaves no look: the pace then needs
    every other endpoint known, as without one, and no new look is started for AHEAD_FOR."""
    import time

    from tests.test_endpoint_source import served

    async with served(db_url) as s:
        source = s.source
        source._enabled = {DEST: {1: False, 2: False}}  # 2 not known here

        async def gone(destination: str, after: int, n: int) -> set[int]:
            raise asyncpg.exceptions.ConnectionDoesNotExistError("gone")

        source.store.ahead = gone  # type: ignore[method-assign]
        assert source._paceable(DEST, {1}, time.monotonic())  # a look under way
        await source._looking[DEST]
        assert DEST not in source._ahead and DEST not in source._looking
        assert not source._paceable(DEST, {1}, time.monotonic())
        assert DEST not in source._looking  # not again at once


# --- found by review (each failed before its fix) ----------------------------------------


BURST = (
    "INSERT INTO outbox (destination, payload, content_type, tenant) "
    "SELECT $1, '{}', 'application/json', $2 FROM generate_series(1, $3)"
)


async def test_another_tenants_event_behind_more_than_the_look_reads_is_not_held(
    db_url: str,
    aengine: Any,  # noqa: F811
    make_receiver: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new endpoint's event behind a burst longer than the look reads (AHEAD_EVENTS, 100
    here): the look saw only the burst, and the pace held the event until the backlog ahead of
    it was shorter than that (22 s behind 1,028 of the burst's events, found by review)."""
    import time

    from relay.sinks.endpoints import fan_outs
    from tests.support.relays import running, wait_until
    from tests.test_endpoint_delivery import (
        DEST as DELIVERY_DEST,
    )
    from tests.test_endpoint_delivery import (
        add_endpoint,
        delivered_to,
        endpoints_settings,
        enqueue,
        fetch,
    )

    monkeypatch.setattr(fan_outs, "AHEAD_EVENTS", 100)
    a, r = make_receiver(), make_receiver()
    a.respond(200, delay=0.02)
    await add_endpoint(aengine, a.url, tenant="a")
    async with running(endpoints_settings(db_url, max_concurrency=1)):
        [first] = await enqueue(db_url, [{"tenant": "a", "payload": {}}])
        await wait_until(lambda: delivered_to(a) == [first], what="a known fast")
        await add_endpoint(aengine, r.url, tenant="r")
        await fetch(db_url, BURST, DELIVERY_DEST, "a", 1100)
        [new] = await enqueue(db_url, [{"tenant": "r", "payload": {"new": True}}])
        started = time.monotonic()
        await wait_until(lambda: new in delivered_to(r), timeout=60, what="r's new event")
        took = time.monotonic() - started
        sent_a = len(delivered_to(a))
    assert took < 5.0, f"r's event took {took:.1f} s, behind {sent_a - 1} of a's events"


async def test_a_slow_look_that_finds_a_waiting_endpoint_stops_the_pace(db_url: str) -> None:
    """A look that takes longer than AHEAD_FOR was thrown away as stale, and the next one
    paced while it ran: paced in 40 of 48 checks though the looks found an endpoint that
    waits (found by review). What a look finds waiting stops the pace, whatever its age."""
    import asyncio
    import time

    from tests.test_endpoint_source import served

    async with served(db_url) as s:
        source = s.source
        source._enabled = {DEST: {1: False, 2: False}}

        async def slow(destination: str, after: int, n: int) -> set[int]:
            await asyncio.sleep(1.2)
            return {1, 2}

        source.store.ahead = slow  # type: ignore[method-assign]
        paced: list[bool] = []
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            paced.append(source._paceable(DEST, {1}, time.monotonic()))
            await asyncio.sleep(0.05)
        source.halt()
    later = paced[len(paced) * 2 // 5 :]
    assert not any(later), f"paced in {sum(later)} of {len(later)} checks after 2 was found"


async def test_a_look_that_raises_another_error_paces_nothing_on_a_guess(db_url: str) -> None:
    """Only the database's errors were caught: a bug's left no failure behind, so every check
    started a new look and paced meanwhile (20 looks for 20 checks, found by review)."""
    import asyncio
    import time

    from tests.test_endpoint_source import served

    async with served(db_url) as s:
        source = s.source
        source._enabled = {DEST: {1: False, 2: False}}
        calls = 0

        async def broken(destination: str, after: int, n: int) -> set[int]:
            nonlocal calls
            calls += 1
            raise RuntimeError("a bug")

        source.store.ahead = broken  # type: ignore[method-assign]
        paced = []
        for _ in range(20):
            paced.append(source._paceable(DEST, {1}, time.monotonic()))
            await asyncio.sleep(0.01)
    assert not any(paced[1:]) and calls == 1, (paced, calls)


async def test_the_look_starts_after_the_last_fan_out_not_the_highest_ever(db_url: str) -> None:
    """Ids handed out again (a restore, the sequence set back) are below the highest id ever
    fanned out: a look from there saw no waiting event until new ids passed it (found by
    review). It starts after the last fan-out's."""
    from tests.test_endpoint_source import served

    async with served(db_url) as s:
        source = s.source
        source._fanned_top[DEST] = 1000  # before the restore

        async def fanned(*_: Any) -> tuple[dict[int, int], list[Any], float, float]:
            return {3: 0, 5: 0}, [], 0.0, 0.0

        source.store.fan_out_claiming = fanned  # type: ignore[method-assign]

        class Event:
            def __init__(self, i: int) -> None:
                self.id, self.token, self.destination = i, 1, DEST

        await source.fan_out([Event(3), Event(5)], "none")  # type: ignore[list-item]
        assert source._fanned_top[DEST] == 5
