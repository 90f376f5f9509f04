"""Relay kills: SIGKILL one of three relay processes at random moments, mid-batch, while the
application keeps committing; nothing is lost and duplicates come only from rows the killed
relay held."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from tests.support.faults import (
    Sampler,
    Writer,
    all_delivered,
    end_of_run,
    fetch,
    fetchval,
    fleet,
    install_audit,
    kill,
    max_lag,
    read_copies,
    relay_config,
)
from tests.support.relays import wait_until

pytestmark = pytest.mark.slow

HOLDS = "SELECT EXISTS (SELECT FROM outbox WHERE status = 'running' AND locked_by = $1)"
SESSIONS = "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE application_name = $1)"
LEASE = 4.0
POLL = 0.25


@pytest.mark.timeout(600)
async def test_sigkill_a_relay_repeatedly_loses_nothing(
    db_url: str,
    kafka_bootstrap: str,
    tmp_path: Path,
    long_run: bool,
    fault_report: dict[str, object],
) -> None:
    total, kills = (50_000, 5) if long_run else (15_000, 3)
    topic = f"kills-{uuid.uuid4().hex[:8]}"

    def cfg(relay_id: str) -> dict[str, object]:
        return relay_config(
            db_url, kafka_bootstrap, topic, relay_id=relay_id, lease=LEASE, poll_interval=POLL
        )

    # The application commits throughout the kills (about 4 s per kill and restart), in
    # large transactions: each one is a backlog that keeps the relays holding rows for a while
    # (three relays drain a trickle in milliseconds per batch, too fast to kill mid-batch).
    chunk = max(1000, total // (kills * 3))
    writer = Writer(db_url, total, keys=200, chunk=chunk, rate=total / (4.0 * kills))
    held_at_kills: set[int] = set()
    sigkills = 0
    await install_audit(db_url)
    with fleet(tmp_path) as relays, Sampler(db_url) as sampler:
        relays.start(cfg("steady-a"), "steady-a")
        relays.start(cfg("steady-b"), "steady-b")
        victim_id = "victim-0"
        victim = relays.start(cfg(victim_id), victim_id)
        writing = asyncio.create_task(writer.run())

        watch = await asyncpg.connect(to_asyncpg_dsn(db_url))
        watchers: list[asyncio.Task[float]] = []

        async def recovery(returned: Callable[[], Awaitable[bool]], killed_at: float) -> float:
            await wait_until(returned, timeout=LEASE * 4, interval=0.05, what="rows reaped")
            return time.monotonic() - killed_at

        while len(watchers) < kills:
            assert sigkills < 3 * kills, "kills keep missing the relay's batches"

            async def victim_busy(rid: str = victim_id) -> bool:
                return bool(await watch.fetchval(HOLDS, rid))

            # A random moment, then the first instant the victim holds rows: mid-batch. (A
            # batch is held for milliseconds, so poll on one open connection, tightly.)
            await asyncio.sleep(random.uniform(0.2, 1.5))
            await wait_until(victim_busy, timeout=60, interval=0.0, what=f"{victim_id} busy")
            kill(victim)
            sigkills += 1
            killed_at = time.monotonic()

            # Its sessions outlive it by a statement: one it had sent still commits (an
            # outcome recorded after all). What it holds is known once they have ended.
            async def ended(rid: str = victim_id) -> bool:
                return not await watch.fetchval(SESSIONS, f"outbox-relay:{rid}")

            await wait_until(ended, timeout=10, interval=0.01, what=f"{victim_id}'s sessions end")
            held = [
                r["id"]
                for r in await fetch(
                    db_url,
                    "SELECT id FROM outbox WHERE status = 'running' AND locked_by = $1",
                    victim_id,
                )
            ]
            held_at_kills.update(held)

            # Claimable again once the dead relay no longer holds them. (Whether they are
            # running again, under another relay, is not its business: the next victim may
            # claim some of them and be killed in turn.)
            async def returned(ids: list[int] = held, dead: str = victim_id) -> bool:
                n = await fetchval(
                    db_url,
                    "SELECT count(*) FROM outbox WHERE status = 'running' AND id = ANY($1) "
                    "AND locked_by = $2",
                    ids,
                    dead,
                )
                return n == 0

            victim_id = f"victim-{sigkills}"
            victim = relays.start(cfg(victim_id), victim_id)
            if held:  # else the batch was recorded just before the kill: it proved nothing
                watchers.append(asyncio.create_task(recovery(returned, killed_at)))

        await watch.close()
        recoveries = list(await asyncio.gather(*watchers))
        assert not writing.done(), "the writer finished before the last kill: raise its span"
        ids = await writing
        await wait_until(
            lambda: all_delivered(db_url, total), timeout=180, interval=0.2, what="all delivered"
        )
        assert len(relays.alive()) == 3, "a relay that was not killed exited"
    copies = await read_copies(kafka_bootstrap, topic, ids, timeout=120)

    # Only rows a killed relay held when it died can be delivered twice.
    assert copies.duplicated_ids <= held_at_kills, copies.duplicated_ids - held_at_kills
    states = await fetch(db_url, "SELECT status, count(*) AS n FROM outbox GROUP BY status")
    assert {r["status"]: r["n"] for r in states} == {"delivered": total}
    clean = await end_of_run(db_url)
    reaped = await fetchval(
        db_url, "SELECT count(*) FROM outbox WHERE last_error LIKE 'lease expired: relay victim-%'"
    )
    assert reaped == len(held_at_kills)  # every row a dead relay held was taken back, no other
    # A dead relay's row becomes claimable within one lease (and a poll interval) of the kill.
    assert max(recoveries) <= LEASE + POLL + 1.0, recoveries
    assert sampler.max_overrun <= POLL + 1.0, sampler.max_overrun
    fault_report.update(
        events=total,
        keys=200,
        relays=3,
        kills=sigkills,
        kills_mid_batch=len(watchers),
        rows_held_at_kills=len(held_at_kills),
        duplicates=copies.duplicates,
        max_recovery_s=round(max(recoveries), 2),
        max_lease_overrun_s=round(sampler.max_overrun, 2),
        max_lag_s=await max_lag(db_url),
        **clean,
    )
