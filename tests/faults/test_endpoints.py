"""Endpoints destinations under faults: an endpoint disabled with a short retention keeps its
queue, a relay killed in the middle of a fan-out sends no (event, endpoint) pair twice, and an
endpoint whose server goes away and comes back gets every event while the others are not held
back. Real relay processes, real receivers on loopback, signatures checked with
standardwebhooks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import outbox
from outbox.dburl import to_asyncpg_dsn, to_sqlalchemy_async_url
from relay.ops import admin
from tests.support.faults import (
    ENDPOINTS,
    UNLOGGED,
    Fleet,
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
    kill,
    read_pairs,
    register_endpoints,
)
from tests.support.faults import relay_config as base_config
from tests.support.receiver import Receiver
from tests.support.relays import wait_until
from tests.webhook_helpers import verify

pytestmark = pytest.mark.slow

DEST = "customer-events"


@pytest.fixture
async def aengine(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    yield engine
    await engine.dispose()


def relay_config(db_url: str, name: str, **relay: Any) -> dict[str, Any]:
    cfg = base_config(db_url, "127.0.0.1:9", "unused", relay_id=name, **relay)
    cfg["destinations"] = {
        DEST: {
            "kind": "endpoints",
            "allow_private_networks": True,  # the receivers are on loopback
            "max_concurrency": 1,
            "backoff": {"schedule": [0.2], "jitter": 0},
        }
    }
    return cfg


async def register(engine: AsyncEngine, url: str) -> outbox.endpoints.Endpoint:
    async with engine.begin() as conn:
        return await outbox.endpoints.create(
            conn, destination=DEST, url=url, allow_private_networks=True
        )


async def enqueue(db_url: str, n: int) -> list[int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            return await outbox.enqueue_many(
                conn, [{"destination": DEST, "payload": {"n": i}} for i in range(n)]
            )
    finally:
        await conn.close()


def received(receiver: Receiver) -> Counter[int]:
    """The events an endpoint answered 2xx to, with how many times each."""
    return Counter(
        int(r.headers["webhook-id"])
        for r in receiver.requests
        if r.status is not None and 200 <= r.status < 300
    )


@pytest.mark.timeout(120)
async def test_an_endpoint_disabled_by_a_410_keeps_its_queue_through_retention(
    db_url: str,
    aengine: AsyncEngine,
    make_receiver: Callable[..., Receiver],
    tmp_path: Path,
    fault_report: dict[str, object],
) -> None:
    """A receiver answers 410 once (a bad deploy) after 4 of 10 queued events: its endpoint
    is disabled at once. With a retention of one second, run every 0.2 s, the relay must keep
    the events of its 6 queued deliveries; enabling the endpoint sends all of them."""
    receiver = make_receiver()
    receiver.respond(200, times=4)
    receiver.respond(410, body=b"deploy in progress", times=1)
    ep = await register(aengine, receiver.url)
    with fleet(tmp_path) as relays:
        relays.start(relay_config(db_url, "r1", retention=1, retention_interval=0.2), "r1")
        ids = await enqueue(db_url, 10)
        await wait_until(
            lambda: fetch(db_url, "SELECT 1 FROM outbox_endpoints WHERE NOT enabled"),
            what="disabled by its 410",
        )
        got = len(received(receiver))
        # Retention runs over and over past the events' retention while the endpoint is off.
        await asyncio.sleep(2.5)
        kept = await fetchval(db_url, "SELECT count(*) FROM outbox WHERE id = ANY($1)", ids)
        assert kept >= 10 - got, "events of queued deliveries were deleted"
        async with aengine.begin() as conn:
            await outbox.endpoints.enable(conn, ep.id)
        await wait_until(lambda: set(received(receiver)) == set(ids), what="all delivered")
        await wait_until(
            lambda: fetchval(db_url, "SELECT count(*) = 0 FROM outbox"), what="retention after"
        )
    counts = received(receiver)
    assert set(counts) == set(ids) and max(counts.values()) == 1
    for r in receiver.requests:
        verify(ep.secret, r.body, r.headers)
    statuses = await fetch(db_url, "SELECT status, count(*) AS n FROM outbox_deliveries GROUP BY 1")
    assert {r["status"]: r["n"] for r in statuses} == {"delivered": 10}
    fault_report.update(events=10, received_before_disable=got, lost=0, duplicates=0)


# A statement that records a fanned-out event waits here (a BEFORE trigger on the update that
# marks it delivered) until the test has killed its relay.
STALL = """
CREATE FUNCTION stall_fan_out_record() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_sleep(60);
    RETURN NEW;
END $$;
CREATE TRIGGER stall_fan_out_record BEFORE UPDATE ON outbox
    FOR EACH ROW WHEN (OLD.status = 'running' AND NEW.status = 'delivered')
    EXECUTE FUNCTION stall_fan_out_record();
"""

# Every connection of the killed relay, as a server that noticed its death would end them: the
# stalled fan-out, and any statement queued behind it (a second fan-out waiting for the
# fan-outs' lock would stall in turn once the first is gone).
TERMINATE_STALLED = """
SELECT pg_terminate_backend(pid) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'outbox-relay:victim'
  AND pid <> pg_backend_pid()
"""

STALLED = """
SELECT count(*) > 0 FROM pg_stat_activity
WHERE datname = current_database() AND wait_event = 'PgSleep' AND pid <> pg_backend_pid()
"""


@pytest.mark.timeout(120)
async def test_a_relay_killed_between_fan_out_and_record_sends_no_pair_twice(
    db_url: str,
    aengine: AsyncEngine,
    make_receiver: Callable[..., Receiver],
    tmp_path: Path,
    fault_report: dict[str, object],
) -> None:
    """With retention = 0, a relay dies after fanning a batch out and before its events are
    recorded (held there by a trigger); its deliveries may meanwhile be sent and deleted. The
    next relay must not fan the batch out again: each (event, endpoint) pair is sent once."""
    receivers = [make_receiver(), make_receiver()]
    endpoints = [await register(aengine, r.url) for r in receivers]
    await install_audit(db_url)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(STALL)
    finally:
        await conn.close()
    settings = {"retention": 0, "retention_interval": 0.2, "lease": 3}
    with fleet(tmp_path) as relays:
        victim = relays.start(relay_config(db_url, "victim", **settings), "victim")
        ids = await enqueue(db_url, 20)
        await wait_until(lambda: fetchval(db_url, STALLED), what="the record stalled")
        # A relay that had committed its fan-out sends the deliveries within milliseconds and
        # retention 0 deletes them as they end: give it that time, so that the test can tell.
        await asyncio.sleep(1.5)
        sent_before_kill = sum(sum(received(r).values()) for r in receivers)
        kill(victim)
        conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
        try:
            # PostgreSQL notices a dead client only when it next talks to it: end the stalled
            # statement as a server that noticed would (it rolls back).
            await conn.execute(TERMINATE_STALLED)
            await conn.execute("DROP TRIGGER stall_fan_out_record ON outbox")
        finally:
            await conn.close()
        started = time.monotonic()
        relays.start(relay_config(db_url, "heir", **settings), "heir")
        for r in receivers:
            await wait_until(lambda r=r: set(received(r)) == set(ids), what="all delivered")
        await wait_until(
            lambda: fetchval(db_url, "SELECT count(*) = 0 FROM outbox"), what="events deleted"
        )
        recovered_s = time.monotonic() - started
    for r, ep in zip(receivers, endpoints, strict=True):
        counts = received(r)
        assert set(counts) == set(ids)
        assert max(counts.values()) == 1, f"pairs sent twice: {counts.most_common(3)}"
        for req in r.requests:
            verify(ep.secret, req.body, req.headers)
    figures = await end_of_run(db_url)
    fault_report.update(
        events=20,
        endpoints=2,
        sent_before_kill=sent_before_kill,
        duplicates=0,
        recovered_s=round(recovered_s, 2),
        **figures,
    )


# --- an endpoint's server that goes away and comes back ----------------------------------------

OUTAGE_RATE = 50.0  # events/s, 3 deliveries each
# Opened by 3 failures in a row, probed 0.5 s later, then at most every second while it fails:
# the outage sees it open, probed and reopened, and it recovers within a second of the return.
CIRCUIT = {"threshold": 3, "cooldown": 0.5, "max_cooldown": 1.0}
OPENED, PROBE_FAILED, CLOSED = (
    "relay.webhook.circuit_opened",
    "relay.webhook.probe_failed",
    "relay.webhook.circuit_closed",
)
# Events committed after the circuit opened that the other endpoints receive while it is down.
WHILE_DOWN = 25
# Per delivery: its attempts, the rows of the message log, and those refused a connection.
LOGGED = """
SELECT d.event_id, d.endpoint_id, d.status, d.attempts,
       (SELECT count(*) FROM outbox_attempts AS a WHERE a.delivery_id = d.id) AS logged,
       (SELECT count(*) FROM outbox_attempts AS a
        WHERE a.delivery_id = d.id AND a.http_status IS NULL AND a.error ILIKE '%refused%'
       ) AS refused
FROM outbox_deliveries AS d
"""
# The other endpoints' worst commit-to-answer time for events committed from $1 on.
LAG_FROM = """
SELECT extract(epoch FROM max(d.finished_at - o.created_at))::float8
FROM outbox_deliveries AS d JOIN outbox AS o ON o.id = d.event_id
WHERE d.event_id = ANY($1) AND d.endpoint_id <> $2
"""
ENDPOINT = """
SELECT enabled, disabled_at, failing_since, circuit_open_until FROM outbox_endpoints WHERE id = $1
"""


def circuit_log(output: str, breaker: str) -> list[str]:
    """What one relay's log says of ``breaker`` (an endpoint's, "destination#id"), in order:
    opened, a probe that failed, closed."""
    said = []
    for line in output.splitlines():
        if f'"{breaker}"' not in line:
            continue
        with contextlib.suppress(ValueError):
            ev = json.loads(line)
            if ev.get("destination") == breaker and ev.get("event") in (
                OPENED,
                PROBE_FAILED,
                CLOSED,
            ):
                said.append(ev["event"])
    return said


def answered(receiver: Receiver) -> set[int]:
    """The events a receiver answered 200 to."""
    return {int(r.headers["webhook-id"]) for r in list(receiver.requests) if r.status == 200}


@pytest.mark.timeout(180)
async def test_an_endpoint_that_goes_away_and_comes_back_gets_every_event(
    db_url: str,
    make_receiver: Callable[..., Receiver],
    tmp_path: Path,
    long_run: bool,
    fault_report: dict[str, object],
) -> None:
    """One of three endpoints goes away mid-run, its server stopped with requests waiting in
    it (then connections refused), and comes back on the same port, while two relays run and
    the application keeps committing. Its circuit opens (`status` shows it), a probe fails and
    reopens it; the other endpoints keep receiving meanwhile, each event once; once it is back
    its circuit closes in every relay that opened it, and every (event, endpoint) pair arrives,
    signed, a request cut by the outage sent again under the same webhook-id. Every attempt is
    in the message log, nothing is left running, and the endpoint is not disabled."""
    probes = 3 if long_run else 1  # failed probes the outage lasts for
    receivers = [make_receiver() for _ in range(3)]
    *others, away = receivers
    endpoints = await register_endpoints(db_url, [r.url for r in receivers])
    away_ep = endpoints[-1]
    breaker = f"{ENDPOINTS}#{away_ep.id}"  # its breaker, as the relays log it

    def cfg(relay_id: str) -> dict[str, Any]:
        c = endpoints_config(db_url, relay_id=relay_id, batch_size=50, max_in_flight=64)
        # disable_after's least: the outage, a few seconds, must not disable it.
        c["destinations"][ENDPOINTS].update(circuit=CIRCUIT, disable_after=60)
        return c

    recovered = asyncio.Event()
    # Paced for as long as the test may take; it stops once the endpoint has recovered.
    writer = Writer(
        db_url,
        int(OUTAGE_RATE * 150),
        chunk=5,
        rate=OUTAGE_RATE,
        destination=ENDPOINTS,
        stop=recovered,
    )
    await install_audit(db_url)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))

    async def shown() -> dict[int, dict[str, Any]]:
        """The endpoints as `outbox-relay status --json` shows them."""
        return {e["id"]: e for e in (await admin.status(conn, "public"))["endpoints"]}

    def said(relays: Fleet) -> list[list[str]]:
        return [circuit_log(p.output(), breaker) for p in relays.procs]

    try:
        with fleet(tmp_path) as relays:
            for rid in ("endpoints-a", "endpoints-b"):
                relays.start(cfg(rid), rid)
            writing = asyncio.create_task(writer.run())
            try:
                await wait_until(
                    lambda: all(len(answered(r)) >= 20 for r in receivers),
                    timeout=30,
                    what="every endpoint receiving",
                )
                # Its server stops answering, then goes away with those requests in it.
                hang_from = len(away.requests)
                away.respond(delay=120)  # never answered: the server goes away first

                def waiting() -> bool:
                    now = time.monotonic()
                    reqs = away.requests[hang_from:]
                    return sum(r.status is None and now - r.at > 0.05 for r in reqs) >= 2

                await wait_until(waiting, timeout=20, interval=0.01, what="requests waiting")
                await asyncio.to_thread(away.go_away)
                down_at = time.monotonic()

                async def open_in_status() -> dict[int, dict[str, Any]] | None:
                    seen = await shown()
                    return seen if seen[away_ep.id]["circuit"] == "open" else None

                seen = await wait_until(open_in_status, timeout=20, what="its circuit open")
                opened_s = time.monotonic() - down_at
                assert seen[away_ep.id]["failing_since"] is not None
                assert seen[away_ep.id]["enabled"]
                for ep in endpoints[:-1]:
                    assert seen[ep.id]["circuit"] == "closed", seen[ep.id]
                    assert seen[ep.id]["failing_since"] is None, seen[ep.id]
                # A probe finds it still down: its circuit opens again rather than closing.
                await wait_until(
                    lambda: sum(s.count(PROBE_FAILED) for s in said(relays)) >= probes,
                    timeout=30,
                    interval=0.1,
                    what="a probe that failed",
                )
                # The others are not held back: they receive what is committed while it is
                # down, its circuit open.
                mark = len(writer.ids)

                def others_received() -> bool:
                    want = set(writer.ids[: mark + WHILE_DOWN])
                    return len(want) >= mark + WHILE_DOWN and all(
                        want <= answered(r) for r in others
                    )

                await wait_until(others_received, timeout=30, what="the others receiving")
                while_down = writer.ids[mark : mark + WHILE_DOWN]
                assert not set(while_down) & answered(away)
                away.respond()  # answers at once again
                await asyncio.to_thread(away.come_back)
                down_s = time.monotonic() - down_at

                # Every relay whose breaker opened closes it, and status shows it healthy.
                async def closed_everywhere() -> bool:
                    e = (await shown())[away_ep.id]
                    if e["circuit"] != "closed" or e["failing_since"] is not None:
                        return False
                    return all(not s or s[-1] == CLOSED for s in said(relays))

                await wait_until(closed_everywhere, timeout=30, interval=0.1, what="recovered")
                recovered_s = time.monotonic() - down_at - down_s
            finally:
                recovered.set()
                ids = await writing
            n = len(ids)
            await wait_until(
                lambda: all_delivered(db_url, n), timeout=60, interval=0.2, what="fanned out"
            )
            await wait_until(
                lambda: deliveries_done(db_url, n * len(endpoints)),
                timeout=60,
                interval=0.2,
                what="every delivery delivered",
            )
            assert len(relays.alive()) == 2, relays.logs()[-3000:]
            # The last circuit written for it is a close (each relay's last word: see above).
            state = await wait_until(
                lambda: _closed_row(db_url, away_ep.id), timeout=10, what="its circuit cleared"
            )
            logs = relays.logs()
            breakers = said(relays)
    finally:
        await conn.close()

    assert state["enabled"] and state["disabled_at"] is None and state["failing_since"] is None
    assert not events(logs, "relay.endpoints.disabled")
    assert any(OPENED in s for s in breakers), breakers
    pairs = read_pairs(receivers, endpoints, ids)
    # The others received each event once.
    assert all(len(c) == 1 for (_, e), c in pairs.per_pair.items() if e != away_ep.id)
    # A request the outage cut (never answered) was sent again, the same message under the
    # same webhook-id (read_pairs checks every copy), and answered once it was back.
    cut = {(int(r.headers["webhook-id"]), away_ep.id) for r in away.requests if r.status is None}
    assert cut, "no request was waiting in the endpoint when it went away"
    for pair in cut:
        copies = pairs.per_pair[pair]
        assert len(copies) >= 2 and any(c.status == 200 for c in copies), (pair, copies)
    rows = {(r["event_id"], r["endpoint_id"]): r for r in await fetch(db_url, LOGGED)}
    assert len(rows) == n * len(endpoints)
    assert {r["status"] for r in rows.values()} == {"delivered"}
    # Every attempt is in the message log (and no row of it without an attempt counted).
    assert await fetchval(db_url, UNLOGGED) == 0
    unlogged = [
        (p, r["attempts"], r["logged"]) for p, r in rows.items() if r["attempts"] != r["logged"]
    ]
    assert not unlogged, unlogged[:5]
    for pair, copies in pairs.per_pair.items():
        assert len(copies) <= rows[pair]["attempts"], (pair, len(copies), rows[pair]["attempts"])
    # The others' deliveries were never retried; the dead endpoint's were refused a connection.
    assert all(r["attempts"] == 1 for (_, e), r in rows.items() if e != away_ep.id)
    refused = sum(r["refused"] for (_, e), r in rows.items() if e == away_ep.id)
    assert refused >= probes, refused  # each failed probe was refused a connection
    assert all(rows[p]["attempts"] >= 2 for p in cut)
    clean = await end_of_run(db_url)
    fault_report.update(
        events=n,
        endpoints=len(endpoints),
        relays=2,
        down_s=round(down_s, 2),
        circuit_open_after_s=round(opened_s, 2),
        probes_failed=sum(s.count(PROBE_FAILED) for s in breakers),
        recovered_after_s=round(recovered_s, 2),
        requests_cut=len(cut),
        attempts_refused=refused,
        duplicates=pairs.duplicates,
        others_max_lag_while_down_s=round(
            float(await fetchval(db_url, LAG_FROM, while_down, away_ep.id) or 0.0), 2
        ),
        **clean,
    )


async def _closed_row(db_url: str, endpoint: int) -> asyncpg.Record | None:
    [row] = await fetch(db_url, ENDPOINT, endpoint)
    return row if row["circuit_open_until"] is None else None
