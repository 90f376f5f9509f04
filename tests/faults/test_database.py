"""Database restarts, as the relays see them: their connections die mid-statement, again and
again (``pg_terminate_backend``; the shared server itself is never restarted). For a Kafka
destination, and for an endpoints destination fanned out to real receivers."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from tests.support.faults import (
    DELIVERIES,
    ENDPOINTS,
    EXPIRED_PAIRS,
    UNLOGGED,
    Fleet,
    Sampler,
    Writer,
    all_delivered,
    deliveries_done,
    end_of_run,
    endpoints_config,
    events,
    fetch,
    fetchval,
    fleet,
    install_audit,
    max_lag,
    read_copies,
    read_pairs,
    register_endpoints,
    relay_config,
)
from tests.support.receiver import Receiver
from tests.support.relays import wait_until

pytestmark = pytest.mark.slow

# Only this test's database: other suites run relays with the same ids on the same server.
TERMINATE = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = ANY($1::text[])
"""
LISTENING = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = ANY($1::text[])
"""


RELAY_IDS = ["db-a", "db-b", "db-c"]


def names(relay_ids: list[str]) -> list[str]:
    return [f"outbox-relay:{r}" for r in relay_ids] + [
        f"outbox-relay-listen:{r}" for r in relay_ids
    ]


@pytest.mark.timeout(300)
async def test_connections_killed_repeatedly_lose_nothing(
    db_url: str,
    kafka_bootstrap: str,
    tmp_path: Path,
    long_run: bool,
    fault_report: dict[str, object],
) -> None:
    total, span = (40_000, 40.0) if long_run else (10_000, 12.0)
    topic = f"db-{uuid.uuid4().hex[:8]}"
    writer = Writer(db_url, total, keys=200, chunk=500, rate=total / span)
    await install_audit(db_url)
    admin = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        with fleet(tmp_path) as relays, Sampler(db_url) as sampler:
            for rid in RELAY_IDS:
                relays.start(relay_config(db_url, kafka_bootstrap, topic, relay_id=rid), rid)
            await wait_until(
                lambda: _count(admin, LISTENING, [f"outbox-relay-listen:{r}" for r in RELAY_IDS]),
                timeout=30,
                what="relays connected",
            )
            writing = asyncio.create_task(writer.run())
            killed, rounds, outage_done = await kill_connections(admin, relays, writing)
            ids = await writing

            async def delivered() -> bool:
                assert len(relays.alive()) == 3, relays.logs()[-3000:]
                return await all_delivered(db_url, total)

            await wait_until(delivered, timeout=120, interval=0.2, what="all delivered")
            clean = await end_of_run(db_url)
            # Each relay's listener came back on its own.
            await wait_until(
                lambda: _count(
                    admin, LISTENING, [f"outbox-relay-listen:{r}" for r in RELAY_IDS], 3
                ),
                timeout=30,
                what="every listener reconnected",
            )
            logs = relays.logs()
    finally:
        await admin.close()

    assert outage_done and killed > rounds
    check_logs(logs)

    copies = await read_copies(kafka_bootstrap, topic, ids, timeout=120)
    rows = {
        r["id"]: r
        for r in await fetch(db_url, "SELECT id, status, attempts, last_error FROM outbox")
    }
    assert {r["status"] for r in rows.values()} == {"delivered"}
    # Every copy in Kafka came from a claim that counted an attempt: no row was claimed by
    # two relays at once, and a second copy only follows a lease that expired (its relay
    # could not renew or record while its connections were being killed).
    for i, n in copies.per_id.items():
        assert n <= rows[i]["attempts"], (i, n, rows[i]["attempts"])
    for i in copies.duplicated_ids:
        assert rows[i]["last_error"].startswith("lease expired"), rows[i]["last_error"]
    fault_report.update(
        events=total,
        relays=3,
        kill_rounds=rounds,
        backends_killed=killed,
        duplicates=copies.duplicates,
        rows_reaped=sum(1 for r in rows.values() if (r["last_error"] or "").startswith("lease")),
        max_lease_overrun_s=round(sampler.max_overrun, 2),
        max_lag_s=await max_lag(db_url),
        **clean,
    )


@pytest.mark.timeout(300)
async def test_connections_killed_repeatedly_lose_no_pair(
    db_url: str,
    make_receiver: Callable[..., Receiver],
    tmp_path: Path,
    long_run: bool,
    fault_report: dict[str, object],
) -> None:
    """The same connection kills, for an endpoints destination fanned out to 3 receivers:
    every (event, endpoint) pair arrives, signed, under its event's webhook-id; every copy came
    from a counted attempt and a second copy only follows an expired lease."""
    span = 40.0 if long_run else 12.0
    total = int(150 * span)
    receivers = [make_receiver() for _ in range(3)]
    for r in receivers:
        r.respond(delay=0.01)
    endpoints = await register_endpoints(db_url, [r.url for r in receivers])
    pairs_total = total * len(endpoints)
    writer = Writer(db_url, total, chunk=50, rate=total / span, destination=ENDPOINTS)
    await install_audit(db_url)
    admin = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        with fleet(tmp_path) as relays, Sampler(db_url, table="outbox_deliveries") as sampler:
            for rid in RELAY_IDS:
                relays.start(endpoints_config(db_url, relay_id=rid), rid)
            await wait_until(
                lambda: _count(admin, LISTENING, [f"outbox-relay-listen:{r}" for r in RELAY_IDS]),
                timeout=30,
                what="relays connected",
            )
            writing = asyncio.create_task(writer.run())
            killed, rounds, outage_done = await kill_connections(admin, relays, writing)
            ids = await writing

            async def delivered() -> bool:
                assert len(relays.alive()) == 3, relays.logs()[-3000:]
                return await all_delivered(db_url, total) and await deliveries_done(
                    db_url, pairs_total
                )

            await wait_until(delivered, timeout=120, interval=0.2, what="all delivered")
            clean = await end_of_run(db_url)
            await wait_until(
                lambda: _count(
                    admin, LISTENING, [f"outbox-relay-listen:{r}" for r in RELAY_IDS], 3
                ),
                timeout=30,
                what="every listener reconnected",
            )
            logs = relays.logs()
    finally:
        await admin.close()

    assert outage_done and killed > rounds
    check_logs(logs)

    pairs = read_pairs(receivers, endpoints, ids)
    rows = {(r["event_id"], r["endpoint_id"]): r for r in await fetch(db_url, DELIVERIES)}
    assert len(rows) == pairs_total
    assert {r["status"] for r in rows.values()} == {"delivered"}
    # No delivery was claimed by two relays at once: every copy came from a counted attempt,
    # and a second copy only follows a lease that expired (its relay could not renew or
    # record while its connections were being killed) and was taken back.
    for pair, copies in pairs.per_pair.items():
        assert len(copies) <= rows[pair]["attempts"], (pair, len(copies), rows[pair]["attempts"])
    expired = {(r["event_id"], r["endpoint_id"]) for r in await fetch(db_url, EXPIRED_PAIRS)}
    assert pairs.duplicated <= expired, sorted(pairs.duplicated - expired)[:5]
    assert await fetchval(db_url, UNLOGGED) == 0
    fault_report.update(
        events=total,
        endpoints=len(endpoints),
        relays=3,
        kill_rounds=rounds,
        backends_killed=killed,
        duplicates=pairs.duplicates,
        requests_cut=pairs.cut,
        deliveries_expired=len(expired),
        max_lease_overrun_s=round(sampler.max_overrun, 2),
        **clean,
    )


async def kill_connections(
    admin: asyncpg.Connection, relays: Fleet, writing: asyncio.Task[list[int]]
) -> tuple[int, int, bool]:
    """Kill RELAY_IDS' connections until ``writing`` is done, every 0.1 to 0.8 s: one relay's or
    all of them, at random; once, after 5 rounds, a database that stays away for a while
    (every connection any relay opens is killed at once, for 3 s). Returns the backends
    killed, the rounds, and whether the outage happened."""
    killed = rounds = 0
    outage_done = False
    while not writing.done():
        assert len(relays.alive()) == 3, relays.logs()[-3000:]
        if not outage_done and rounds >= 5:
            loop = asyncio.get_running_loop()
            until = loop.time() + 3.0
            while loop.time() < until:
                killed += await admin.fetchval(TERMINATE, names(RELAY_IDS))
                await asyncio.sleep(0.02)
            outage_done = True
        else:
            victims = random.choice([[r] for r in RELAY_IDS] + [RELAY_IDS])
            killed += await admin.fetchval(TERMINATE, names(victims))
        rounds += 1
        await asyncio.sleep(random.uniform(0.1, 0.8))
    return killed, rounds, outage_done


def check_logs(logs: str) -> None:
    """The relays saw the database go and come back, and no task of theirs crashed."""
    assert events(logs, "relay.database.unavailable") and events(logs, "relay.database.recovered")
    assert events(logs, "relay.listener.lost") and events(logs, "relay.listener.recovered")
    assert not events(logs, "relay.task.crashed")


async def _count(conn: asyncpg.Connection, sql: str, apps: list[str], want: int = 1) -> bool:
    return bool(await conn.fetchval(sql, apps) >= want)


async def test_relay_survives_its_connections_killed_mid_statement(
    db_url: str, kafka_bootstrap: str
) -> None:
    """A connection killed mid-statement can leave asyncpg mid-protocol: its next use raised
    InternalClientError, which the relay did not expect (the claim loop or the reaper died,
    and the relay exited 1). Now such a connection is discarded and the statement retried."""
    from tests.support.relays import running, settings

    s = settings(
        db_url,
        kafka_bootstrap,
        topic=f"db-{uuid.uuid4().hex[:8]}",
        relay={"relay_id": "storm", "poll_interval": 0.05, "lease": 5, "batch_size": 50},
    )
    writer = Writer(db_url, 3000, chunk=100, rate=1000)
    admin = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with running(s) as relay:
            writing = asyncio.create_task(writer.run())
            run = next(t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Relay.run")
            while not writing.done():
                await admin.fetchval(TERMINATE, names(["storm"]))
                await asyncio.sleep(random.uniform(0.0, 0.05))
                assert not run.done(), "the relay stopped"

            async def delivered() -> bool:
                assert not run.done(), "the relay stopped"
                return await all_delivered(db_url, 3000)

            await wait_until(delivered, timeout=60, what="delivered")
            assert relay.stats["delivered"] >= 3000
    finally:
        await admin.close()
