"""Endpoints destinations end to end: events fan out to the endpoints registered at runtime
and each delivery is sent, signed with its endpoint's secret, retried and logged on its own.
Real database, the relay in-process, several real receivers on loopback; signatures checked
with the standardwebhooks package."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import outbox
from outbox.dburl import to_asyncpg_dsn, to_sqlalchemy_async_url
from tests.support.receiver import Receiver
from tests.support.relays import running, settings, wait_until
from tests.webhook_helpers import SECRET as SECRET_W
from tests.webhook_helpers import closed_port, verify

DEST = "customer-events"


@pytest.fixture
async def aengine(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    yield engine
    await engine.dispose()


# The relay's settings where only the poll could end a wait: a test that a wait ends sooner.
SLOW_POLL = {"poll_interval": 10, "lease": 5}


def endpoints_settings(db_url: str, relay: dict[str, Any] | None = None, **dest: Any) -> Any:
    d: dict[str, Any] = {
        "kind": "endpoints",
        "allow_private_networks": True,
        "backoff": {"schedule": [0.3], "jitter": 0},
        "max_attempts": 4,
        "circuit": {"threshold": 50},
    }
    d.update(dest)
    return settings(
        db_url,
        "127.0.0.1:9",
        destinations={DEST: d},
        relay=relay or {"poll_interval": 0.2, "lease": 5},
    )


async def add_endpoint(
    engine: AsyncEngine, url: str, key: str | None = None, **kw: Any
) -> outbox.endpoints.Endpoint:
    """Register an endpoint (``key``: stored encrypted with this Fernet key)."""
    api = outbox.endpoints.Endpoints(secret_key=key) if key else outbox.endpoints
    async with engine.begin() as conn:
        return await api.create(conn, destination=DEST, url=url, allow_private_networks=True, **kw)


async def enqueue(db_url: str, events: list[dict[str, Any]]) -> list[int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            return await outbox.enqueue_many(conn, [{"destination": DEST, **e} for e in events])
    finally:
        await conn.close()


async def fetch(db_url: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


def delivered_to(receiver: Receiver) -> list[int]:
    return sorted(int(r.headers["webhook-id"]) for r in receiver.requests if r.status == 200)


async def deliveries_done(db_url: str, count: int) -> bool:
    rows = await fetch(db_url, "SELECT status FROM outbox_deliveries")
    return len(rows) == count and all(
        r["status"] in ("delivered", "failed", "cancelled") for r in rows
    )


async def test_deliveries_run_on_the_relays_own_claimer_leases_and_completer(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    """One pipeline (#29): no loop of the sink's own; the deliveries have a pipe of their own
    (leases, completer, heartbeat) beside the events', claimed by the one claimer."""
    await add_endpoint(aengine, receiver.url)
    async with running(endpoints_settings(db_url)) as relay:
        names = sorted(t.get_name() for t in relay.tasks)
        assert names.count("claimer") == 1
        assert {"heartbeat", "completer", "heartbeat:deliveries", "completer:deliveries"} <= set(
            names
        )
        assert "endpoint-deliveries" not in names
        [pipe] = [p for p in relay.pipes if p.name == "deliveries"]
        ids = await enqueue(db_url, [{"payload": {"n": i}} for i in range(3)])
        await wait_until(lambda: sorted(delivered_to(receiver)) == ids, what="delivered")
        await wait_until(lambda: pipe.leases.stats["delivered"] == 3, what="recorded")
        assert relay.stats["delivered"] == 3  # the events, fanned out: counted apart
        assert len(pipe.leases) == 0


async def test_events_fan_out_to_matching_endpoints_signed_with_each_secret(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    everyone, acme, acme_paid, other = (make_receiver() for _ in range(4))
    ep_all = await add_endpoint(aengine, everyone.url)
    ep_acme = await add_endpoint(aengine, acme.url, tenant="acme")
    ep_paid = await add_endpoint(
        aengine, acme_paid.url, tenant="acme", event_types=["invoice.paid"]
    )
    await add_endpoint(aengine, other.url, tenant="globex")
    ids = await enqueue(
        db_url,
        [
            {"tenant": "acme", "event_type": "invoice.paid", "payload": {"n": 1}},
            {"tenant": "acme", "event_type": "invoice.voided", "payload": {"n": 2}},
            {"tenant": "initech", "event_type": "invoice.paid", "payload": {"n": 3}},
            {"payload": {"n": 4}},  # no tenant, no type: only endpoints taking everything
        ],
    )
    async with running(endpoints_settings(db_url)):
        await wait_until(lambda: deliveries_done(db_url, 4 + 2 + 1), what="deliveries ended")
    assert delivered_to(everyone) == ids
    assert delivered_to(acme) == ids[:2]
    assert delivered_to(acme_paid) == ids[:1]
    assert other.requests == []
    for receiver, ep in ((everyone, ep_all), (acme, ep_acme), (acme_paid, ep_paid)):
        for r in receiver.requests:
            verify(ep.secret, r.body, r.headers)  # each endpoint's own secret
    events = {r["id"]: r for r in await fetch(db_url, "SELECT * FROM outbox")}
    assert {events[i]["status"] for i in ids} == {"delivered"}
    log = await fetch(db_url, "SELECT * FROM outbox_attempts ORDER BY id")
    assert len(log) == 7 and {a["http_status"] for a in log} == {200}
    assert all(a["duration_ms"] is not None and a["duration_ms"] >= 0 for a in log)


async def test_an_event_no_endpoint_takes_is_recorded_as_such(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    await add_endpoint(aengine, receiver.url, tenant="acme")
    [lonely] = await enqueue(db_url, [{"tenant": "globex", "payload": {}}])
    async with running(endpoints_settings(db_url)):
        await wait_until(
            lambda: fetch(db_url, "SELECT 1 FROM outbox WHERE status = 'delivered'"),
            what="event recorded",
        )
    [row] = await fetch(db_url, "SELECT * FROM outbox WHERE id = $1", lonely)
    assert row["status"] == "delivered" and "no endpoint matched" in row["last_error"]
    assert await fetch(db_url, "SELECT * FROM outbox_deliveries") == []
    assert receiver.requests == []


async def test_a_dead_and_a_slow_endpoint_hold_only_their_own_deliveries(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    fast, slow = make_receiver(), make_receiver()
    slow.respond(200, delay=2.0)
    await add_endpoint(aengine, fast.url)
    await add_endpoint(aengine, slow.url)
    await add_endpoint(aengine, f"http://127.0.0.1:{closed_port()}/dead")
    async with running(endpoints_settings(db_url, max_concurrency=2)):
        started = time.monotonic()
        ids = await enqueue(db_url, [{"payload": {"n": i}} for i in range(20)])
        await wait_until(lambda: len(delivered_to(fast)) == 20, timeout=10, what="fast done")
        fast_took = time.monotonic() - started
    # 20 events at 2 s a request, 2 at a time, would take the slow endpoint 20 s.
    assert fast_took < 8, fast_took
    assert delivered_to(fast) == ids
    dead = await fetch(
        db_url,
        "SELECT d.* FROM outbox_deliveries d JOIN outbox_endpoints e ON e.id = d.endpoint_id "
        "WHERE e.url LIKE '%/dead'",
    )
    assert dead and all(d["last_error"] and "cannot connect" in d["last_error"] for d in dead)
    assert all(d["status"] in ("pending", "running", "failed") for d in dead)


async def test_failures_retry_per_endpoint_and_are_logged(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    ok, flaky = make_receiver(), make_receiver()
    flaky.respond(500, body=b"boom" * 400, times=2)
    await add_endpoint(aengine, ok.url)
    ep = await add_endpoint(aengine, flaky.url)
    [event] = await enqueue(db_url, [{"payload": {"x": 1}}])
    async with running(endpoints_settings(db_url)):
        await wait_until(lambda: deliveries_done(db_url, 2), what="both delivered")
    assert len(ok.requests) == 1 and len(flaky.requests) == 3
    assert {r.headers["webhook-id"] for r in flaky.requests} == {str(event)}
    [d] = await fetch(db_url, "SELECT * FROM outbox_deliveries WHERE endpoint_id = $1", ep.id)
    assert d["status"] == "delivered" and d["attempts"] == 3 and d["last_status"] == 200
    log = await fetch(
        db_url, "SELECT * FROM outbox_attempts WHERE endpoint_id = $1 ORDER BY id", ep.id
    )
    assert [a["http_status"] for a in log] == [500, 500, 200]
    assert log[0]["response"] == ("boom" * 400)[:1024]  # the first KiB of the answer
    assert "HTTP 500" in log[0]["error"]
    [endpoint] = await fetch(db_url, "SELECT * FROM outbox_endpoints WHERE id = $1", ep.id)
    assert endpoint["last_success_at"] is not None and endpoint["failing_since"] is None


async def test_changes_at_runtime_apply_within_a_second(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    first, second = make_receiver(), make_receiver()
    ep = await add_endpoint(aengine, first.url)
    async with running(endpoints_settings(db_url)):
        [a] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: delivered_to(first) == [a], what="first")
        async with aengine.begin() as conn:
            await outbox.endpoints.update(conn, ep.id, url=second.url, allow_private_networks=True)
        new = await add_endpoint(aengine, first.url)
        t0 = time.monotonic()
        [b] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: delivered_to(second) == [b], timeout=5, what="moved")
        await wait_until(lambda: delivered_to(first) == [a, b], timeout=5, what="added")
        assert time.monotonic() - t0 < 2
        async with aengine.begin() as conn:
            await outbox.endpoints.disable(conn, new.id, reason="paused by test")
        [c] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: delivered_to(second) == [b, c], timeout=5, what="third")
        await asyncio.sleep(0.5)
        assert delivered_to(first) == [a, b]  # disabled: not sent to


async def test_410_gone_disables_the_endpoint_at_once_and_keeps_its_delivery(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    gone, fine = make_receiver(), make_receiver()
    gone.respond(410, body=b"unsubscribed", times=1)  # a bad deploy: 410 once, then fine
    ep = await add_endpoint(aengine, gone.url)
    await add_endpoint(aengine, fine.url)
    async with running(endpoints_settings(db_url)) as relay:
        [a] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: delivered_to(fine) == [a], what="first event")
        await wait_until(
            lambda: fetch(db_url, "SELECT 1 FROM outbox_endpoints WHERE NOT enabled"),
            what="disabled",
        )
        [b] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: delivered_to(fine) == [a, b], what="second event")
        await asyncio.sleep(0.5)
        sample = relay.metrics.registry.get_sample_value(
            "outbox_endpoints_disabled_total", {"destination": DEST}
        )
        assert len(gone.requests) == 1  # disabled after its 410: nothing more was sent
        [endpoint] = await fetch(db_url, "SELECT * FROM outbox_endpoints WHERE id = $1", ep.id)
        assert not endpoint["enabled"] and "410" in endpoint["disabled_reason"]
        q = "SELECT * FROM outbox_deliveries WHERE endpoint_id = $1 AND event_id = $2"
        [d] = await fetch(db_url, q, ep.id, a)
        # The endpoint is disabled, the message not refused: it waits with the queue.
        assert d["status"] == "pending" and d["last_status"] == 410 and d["attempts"] == 1
        assert "sent again once it is enabled" in d["last_error"]
        # A disabled endpoint takes no new events.
        assert not await fetch(db_url, q, ep.id, b)
        async with aengine.begin() as conn:
            await outbox.endpoints.enable(conn, ep.id)
        await wait_until(lambda: delivered_to(gone) == [a], what="sent once enabled")
    assert sample == 1


async def test_an_endpoint_failing_longer_than_disable_after_is_disabled(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    receiver.respond(503)
    ep = await add_endpoint(aengine, receiver.url)
    await fetch(
        db_url,
        "UPDATE outbox_endpoints SET failing_since = now() - interval '2 hours' WHERE id = $1",
        ep.id,
    )
    async with running(endpoints_settings(db_url, disable_after="1h")):
        await enqueue(db_url, [{"payload": {}}])
        await wait_until(
            lambda: fetch(db_url, "SELECT 1 FROM outbox_endpoints WHERE NOT enabled"),
            what="disabled",
        )
    [endpoint] = await fetch(db_url, "SELECT * FROM outbox_endpoints WHERE id = $1", ep.id)
    assert "failing without a success" in endpoint["disabled_reason"]
    assert len(receiver.requests) == 1


async def test_a_recent_failure_does_not_disable(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    receiver.respond(503, times=2)
    ep = await add_endpoint(aengine, receiver.url)
    async with running(endpoints_settings(db_url, disable_after="1h")):
        await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: deliveries_done(db_url, 1), what="delivered at last")
    [endpoint] = await fetch(db_url, "SELECT * FROM outbox_endpoints WHERE id = $1", ep.id)
    assert endpoint["enabled"] and endpoint["failing_since"] is None


async def test_a_rotated_secret_signs_with_both_until_the_previous_expires(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    ep = await add_endpoint(aengine, receiver.url)
    async with aengine.begin() as conn:
        rotated = await outbox.endpoints.rotate_secret(conn, ep.id)
    assert rotated.secret != ep.secret
    async with running(endpoints_settings(db_url)):
        [a] = await enqueue(db_url, [{"payload": {"n": 1}}])
        await wait_until(lambda: delivered_to(receiver) == [a], what="first")
        await fetch(
            db_url,
            "UPDATE outbox_endpoints SET previous_secret_until = now() - interval '1 s' "
            "WHERE id = $1",
            ep.id,
        )
        [b] = await enqueue(db_url, [{"payload": {"n": 2}}])
        await wait_until(lambda: delivered_to(receiver) == [a, b], what="second")
    first, second = receiver.requests
    assert len(first.headers["webhook-signature"].split()) == 2
    verify(ep.secret, first.body, first.headers)  # receivers not yet updated
    verify(rotated.secret, first.body, first.headers)
    assert len(second.headers["webhook-signature"].split()) == 1
    verify(rotated.secret, second.body, second.headers)
    with pytest.raises(Exception, match="signature"):
        verify(ep.secret, second.body, second.headers)


async def test_secrets_encrypted_at_rest_are_opened_with_the_key(
    db_url: str, aengine: AsyncEngine, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cryptography.fernet import Fernet

    key = Fernet.generate_key().decode()
    monkeypatch.setenv("OUTBOX_ENDPOINT_SECRET_KEY", key)  # the relay's
    ep = await add_endpoint(aengine, receiver.url, key=key)
    [stored] = await fetch(db_url, "SELECT secret FROM outbox_endpoints WHERE id = $1", ep.id)
    assert stored["secret"].startswith("enc:")
    async with running(endpoints_settings(db_url)):
        [a] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: delivered_to(receiver) == [a], what="delivered")
    verify(ep.secret, receiver.requests[0].body, receiver.requests[0].headers)


async def test_an_unreadable_secret_logs_its_tries_fails_the_endpoint_and_loses_nothing(
    db_url: str, aengine: AsyncEngine, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cryptography.fernet import Fernet

    monkeypatch.delenv("OUTBOX_ENDPOINT_SECRET_KEY", raising=False)  # the relay has none
    # Plaintext first: none may be written once a secret of the table is encrypted.
    healthy = await add_endpoint(aengine, receiver.url + "?healthy")
    ep = await add_endpoint(aengine, receiver.url, key=Fernet.generate_key().decode())
    # Failing for two hours already: one more failure past disable_after disables it.
    await fetch(
        db_url,
        "UPDATE outbox_endpoints SET failing_since = now() - interval '2 hours' WHERE id = $1",
        ep.id,
    )
    # One attempt allowed: this relay's missing key must not fail the delivery (it would let
    # its event go), nor use up its attempts; it logs the try and fails the endpoint's health.
    async with running(endpoints_settings(db_url, disable_after="1h", max_attempts=1)):
        [a] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(
            lambda: fetch(db_url, "SELECT 1 FROM outbox_endpoints WHERE NOT enabled"),
            what="disabled",
        )
    q = "SELECT * FROM outbox_deliveries WHERE endpoint_id = $1"
    [d] = await fetch(db_url, q, ep.id)
    # Kept, with every attempt still its own: nothing was sent.
    assert d["status"] == "pending" and d["attempts"] == 0
    assert "OUTBOX_ENDPOINT_SECRET_KEY" in d["last_error"]
    [attempt] = await fetch(db_url, "SELECT * FROM outbox_attempts WHERE endpoint_id = $1", ep.id)
    assert attempt["http_status"] is None and "OUTBOX_ENDPOINT_SECRET_KEY" in attempt["error"]
    [endpoint] = await fetch(db_url, "SELECT * FROM outbox_endpoints WHERE id = $1", ep.id)
    assert not endpoint["enabled"] and "failing without a success" in endpoint["disabled_reason"]
    assert [r.path.endswith("?healthy") for r in receiver.requests] == [True]
    assert (await fetch(db_url, q, healthy.id))[0]["status"] == "delivered"
    assert not await _gone(db_url, a)  # its payload waits for the endpoint


async def test_private_addresses_are_refused_unless_the_destination_allows_them(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    await add_endpoint(aengine, receiver.url)  # registered with the check off
    async with running(endpoints_settings(db_url, allow_private_networks=False)):
        await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: deliveries_done(db_url, 1), what="refused")
    [d] = await fetch(db_url, "SELECT * FROM outbox_deliveries")
    assert d["status"] == "failed" and "SSRF guard" in d["last_error"]
    assert receiver.requests == []


async def test_retry_after_holds_only_its_endpoint(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    busy, other = make_receiver(), make_receiver()
    busy.respond(429, headers={"Retry-After": "2"}, times=1)
    await add_endpoint(aengine, busy.url)
    await add_endpoint(aengine, other.url)
    async with running(endpoints_settings(db_url)):
        [a] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: delivered_to(other) == [a], timeout=3, what="other at once")
        await wait_until(lambda: delivered_to(busy) == [a], timeout=10, what="busy later")
    first, second = busy.requests
    assert 1.9 <= second.at - first.at < 4


async def test_deleting_an_endpoint_cancels_its_open_deliveries(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    receiver.respond(500)
    ep = await add_endpoint(aengine, receiver.url)
    async with running(endpoints_settings(db_url, backoff={"schedule": [30]})):
        await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: len(receiver.requests) == 1, what="first attempt")
        await wait_until(
            lambda: fetch(db_url, "SELECT 1 FROM outbox_deliveries WHERE status = 'pending'"),
            what="backing off",
        )
        async with aengine.begin() as conn:
            assert await outbox.endpoints.delete(conn, ep.id) == 1
        await asyncio.sleep(0.5)
    [d] = await fetch(db_url, "SELECT * FROM outbox_deliveries")
    assert d["status"] == "cancelled" and f"endpoint {ep.id} was deleted" in d["last_error"]
    assert len(receiver.requests) == 1


async def test_a_dead_relays_deliveries_are_reaped_and_sent(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    await add_endpoint(aengine, receiver.url)
    [a] = await enqueue(db_url, [{"payload": {}}])
    # As a relay that fanned the event out, claimed the delivery and died would leave it.
    await fetch(db_url, "UPDATE outbox SET status = 'delivered', delivered_at = now()")
    await fetch(
        db_url,
        "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, status, locked_by, "
        "locked_until, claims) SELECT $1, id, destination, 'running', 'dead-relay', "
        "now() - interval '1 s', 1 FROM outbox_endpoints",
        a,
    )
    async with running(endpoints_settings(db_url)):
        await wait_until(lambda: deliveries_done(db_url, 1), what="reaped and delivered")
    [d] = await fetch(db_url, "SELECT * FROM outbox_deliveries")
    assert d["status"] == "delivered" and d["attempts"] == 2  # the lost attempt counts
    assert delivered_to(receiver) == [a]


async def test_an_event_stays_until_its_deliveries_end_even_with_retention_zero(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    receiver.respond(500, times=3)
    await add_endpoint(aengine, receiver.url)
    s = endpoints_settings(db_url)
    s = s.model_copy(
        update={"relay": s.relay.model_copy(update={"retention": 0, "retention_interval": 0.2})}
    )
    async with running(s):
        [a] = await enqueue(db_url, [{"payload": {"keep": "me"}}])
        await wait_until(lambda: len(receiver.requests) >= 2, what="retrying")
        [event] = await fetch(db_url, "SELECT * FROM outbox WHERE id = $1", a)
        assert event["status"] == "delivered"  # fanned out, and kept for its delivery
        await wait_until(lambda: delivered_to(receiver) == [a], what="delivered at last")
        assert receiver.requests[-1].body == receiver.requests[0].body
        await wait_until(lambda: _gone(db_url, a), timeout=10, what="event deleted once delivered")


def load_destination(d: dict[str, Any]) -> Any:
    from relay.sinks.webhook.config import WebhookDestination

    return WebhookDestination.model_validate(d)


async def _gone(db_url: str, event: int) -> bool:
    return not await fetch(db_url, "SELECT 1 FROM outbox WHERE id = $1", event)


async def test_stopping_releases_deliveries_not_yet_attempted(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    receiver.respond(200, delay=1.0)
    await add_endpoint(aengine, receiver.url)
    s = endpoints_settings(db_url, max_concurrency=1)
    s = s.model_copy(update={"relay": s.relay.model_copy(update={"shutdown_timeout": 0.5})})
    async with running(s):
        await enqueue(db_url, [{"payload": {"n": i}} for i in range(5)])
        await wait_until(lambda: len(receiver.requests) >= 1, what="sending")
        # All fanned out (the first event alone, until its endpoint is known: PROBE_HOLD).
        await wait_until(
            lambda: fetch(db_url, "SELECT 1 FROM outbox_deliveries HAVING count(*) = 5"),
            what="fanned out",
        )
    rows = await fetch(db_url, "SELECT * FROM outbox_deliveries ORDER BY id")
    assert len(rows) == 5 and not [r for r in rows if r["status"] == "running"]
    untouched = [r for r in rows if r["status"] == "pending" and r["attempts"] == 0]
    assert len(untouched) >= 3  # released, not counted as attempts


async def test_fan_out_records_only_events_it_holds_and_never_twice(
    db_url: str, aengine: AsyncEngine
) -> None:
    from relay.db.queries import FAN_OUT, render_ops

    await add_endpoint(aengine, "http://127.0.0.1:9/a", tenant="acme")
    await add_endpoint(aengine, "http://127.0.0.1:9/b", tenant="acme", event_types=["x"])
    ids = await enqueue(
        db_url,
        [
            {"payload": {}, "tenant": "acme", "event_type": "x"},
            {"payload": {}, "tenant": "acme"},
            {"payload": {}, "tenant": "globex"},  # no endpoint takes it
            {"payload": {}, "tenant": "acme"},  # claimed by another relay
            {"payload": {}, "tenant": "acme"},  # claimed again by r1 since: a newer token
        ],
    )
    claim = (
        "UPDATE outbox SET status = 'running', locked_by = $1, claims = claims + 1, "
        "locked_until = now() + interval '1 minute' WHERE id = ANY($2) RETURNING id, claims"
    )
    mine = sorted((r["id"], r["claims"]) for r in await fetch(db_url, claim, "r1", ids[:3]))
    [(theirs, token)] = [(r["id"], r["claims"]) for r in await fetch(db_url, claim, "r2", ids[3:4])]
    [(stale, old_token)] = [
        (r["id"], r["claims"]) for r in await fetch(db_url, claim, "r1", ids[4:])
    ]
    await fetch(db_url, claim, "r1", ids[4:])  # reaped and claimed again: token + 1
    sql = render_ops(FAN_OUT, "public")
    pairs = [*mine, (theirs, token), (stale, old_token)]
    args = ([i for i, _ in pairs], [t for _, t in pairs], "r1", "none matched", 1, [], [], [], 30)
    first = {r["id"]: r["endpoints"] for r in await fetch(db_url, sql, *args)}
    assert first == {ids[0]: 2, ids[1]: 1, ids[2]: 0}  # not the row r2 holds
    events = {r["id"]: r for r in await fetch(db_url, "SELECT * FROM outbox")}
    for i in ids[:3]:
        assert events[i]["status"] == "delivered" and events[i]["locked_by"] is None
        assert events[i]["attempts"] == 1 and events[i]["delivered_at"] is not None
    assert events[ids[2]]["last_error"] == "none matched" and events[ids[0]]["last_error"] is None
    assert events[theirs]["status"] == "running" and events[theirs]["locked_by"] == "r2"
    assert events[stale]["status"] == "running" and events[stale]["claims"] == old_token + 1
    # Run again (a relay whose answer was lost): its events are recorded, nothing is added.
    assert await fetch(db_url, sql, *args) == []
    deliveries = await fetch(db_url, "SELECT event_id FROM outbox_deliveries ORDER BY event_id")
    assert [d["event_id"] for d in deliveries] == [ids[0], ids[0], ids[1]]


async def test_an_answer_with_nul_bytes_is_logged_without_them(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    receiver.respond(500, body=b"bad\x00answer", times=1)
    await add_endpoint(aengine, receiver.url)
    async with running(endpoints_settings(db_url)):
        await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: deliveries_done(db_url, 1), what="delivered")
    log = await fetch(db_url, "SELECT * FROM outbox_attempts ORDER BY id")
    assert [a["http_status"] for a in log] == [500, 200]
    assert log[0]["response"] == "badanswer"


async def test_the_rate_limit_holds_across_relays(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    limited, free = make_receiver(), make_receiver()
    await add_endpoint(aengine, limited.url, rate_limit=4)
    await add_endpoint(aengine, free.url)
    s = endpoints_settings(db_url)
    async with running(s, relay_id="one"), running(s, relay_id="two"):
        ids = await enqueue(db_url, [{"payload": {"n": i}} for i in range(16)])
        await wait_until(lambda: len(delivered_to(free)) == 16, timeout=5, what="unlimited")
        await wait_until(lambda: len(delivered_to(limited)) == 16, timeout=20, what="limited")
    assert delivered_to(limited) == ids
    times = sorted(r.at for r in limited.requests)
    # 16 requests at 4 a second, shared by two relays: about 4 s, never 8 a second.
    assert times[-1] - times[0] >= 2.9
    busiest = max(sum(1 for t in times if start <= t < start + 1.0) for start in times)
    assert busiest <= 6, busiest


async def test_an_endpoint_that_keeps_failing_is_disabled_once_past_disable_after(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    """Its health is re-read while it keeps failing, not only when it changes."""
    receiver.respond(503)
    ep = await add_endpoint(aengine, receiver.url)
    async with running(endpoints_settings(db_url, disable_after="1h")) as relay:
        relay.sinks[DEST].source.health_refresh = 0.0  # type: ignore[attr-defined]
        await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: len(receiver.requests) >= 1, what="first failure")
        await wait_until(
            lambda: fetch(db_url, "SELECT 1 FROM outbox_endpoints WHERE failing_since IS NOT NULL"),
            what="failing",
        )
        # As if it had been failing for two hours by now.
        await fetch(
            db_url,
            "UPDATE outbox_endpoints SET failing_since = now() - interval '2 hours' WHERE id = $1",
            ep.id,
        )
        await wait_until(
            lambda: fetch(db_url, "SELECT 1 FROM outbox_endpoints WHERE NOT enabled"),
            what="disabled",
        )


async def test_pausing_the_destination_holds_its_deliveries(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    await add_endpoint(aengine, receiver.url)
    async with running(endpoints_settings(db_url)) as relay:
        await fetch(db_url, "INSERT INTO outbox_paused (destination) VALUES ($1)", DEST)
        await wait_until(lambda: DEST in relay.paused, what="paused seen")
        # Fanned out before the pause (as a relay not yet aware of it would have).
        [a] = await enqueue(db_url, [{"payload": {}}])
        await fetch(db_url, "UPDATE outbox SET status = 'delivered' WHERE id = $1", a)
        await fetch(
            db_url,
            "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination) "
            "SELECT $1, id, destination FROM outbox_endpoints",
            a,
        )
        relay.wake()
        await asyncio.sleep(1.0)
        assert receiver.requests == []
        await fetch(db_url, "DELETE FROM outbox_paused")
        await wait_until(lambda: delivered_to(receiver) == [a], what="resumed")


# --- from the hostile review: each of these failed before its fix ------------------------


async def test_deliveries_of_an_endpoint_deleted_during_fan_out_are_cancelled(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    """The delete cancelled nothing (no delivery yet); the fan-out, before the delete's
    commit, added one: it must not wait for ever, nor keep its event."""
    await add_endpoint(aengine, receiver.url)
    [a] = await enqueue(db_url, [{"payload": {}}])
    await fetch(db_url, "UPDATE outbox SET status = 'delivered', delivered_at = now()")
    await fetch(
        db_url,
        "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination) VALUES ($1, 999, $2)",
        a,
        DEST,
    )
    async with running(endpoints_settings(db_url)):
        await wait_until(lambda: deliveries_done(db_url, 1), what="orphan ended")
    [d] = await fetch(db_url, "SELECT * FROM outbox_deliveries")
    assert d["status"] == "cancelled" and d["last_error"] == "endpoint 999 was deleted"


async def test_an_endpoint_moved_to_another_destination_does_not_stop_the_relay(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    receiver.respond(500)
    ep = await add_endpoint(aengine, receiver.url)
    s = endpoints_settings(db_url, backoff={"schedule": [0.2]})
    async with running(s) as relay:
        await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: len(receiver.requests) >= 1, what="first attempt")
        await fetch(
            db_url, "UPDATE outbox_endpoints SET destination = 'legacy' WHERE id = $1", ep.id
        )
        await wait_until(lambda: deliveries_done(db_url, 1), what="cancelled")
        assert not relay.stopping.is_set()
    [d] = await fetch(db_url, "SELECT * FROM outbox_deliveries")
    assert d["status"] == "cancelled" and "moved to destination 'legacy'" in d["last_error"]


async def test_slow_endpoints_do_not_starve_others_of_connections(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    slow1, slow2, fast = make_receiver(), make_receiver(), make_receiver()
    slow1.respond(200, delay=3.0)
    slow2.respond(200, delay=3.0)
    for r in (slow1, slow2, fast):
        await add_endpoint(aengine, r.url)
    s = endpoints_settings(db_url, timeout=2, max_concurrency=2)
    s = s.model_copy(update={"webhooks": s.webhooks.model_copy(update={"max_connections": 4})})
    async with running(s):
        await enqueue(db_url, [{"payload": {"n": i}} for i in range(4)])
        await wait_until(lambda: len(delivered_to(fast)) == 4, timeout=8, what="fast ones")
    fast_errors = await fetch(
        db_url,
        "SELECT a.* FROM outbox_attempts a JOIN outbox_endpoints e ON e.id = a.endpoint_id "
        "WHERE e.url = $1 AND a.error IS NOT NULL",
        fast.url,
    )
    assert fast_errors == []


async def test_a_disabled_endpoints_backlog_keeps_its_events_and_is_sent_once_enabled(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    receiver.respond(500, times=1)
    ep = await add_endpoint(aengine, receiver.url)
    s = endpoints_settings(db_url, backoff={"schedule": [3600]})
    s = s.model_copy(
        update={"relay": s.relay.model_copy(update={"retention": 0.5, "retention_interval": 0.1})}
    )
    async with running(s):
        [a] = await enqueue(db_url, [{"payload": {"n": 1}}])
        await wait_until(lambda: len(receiver.requests) == 1, what="attempted")
        async with aengine.begin() as conn:
            await outbox.endpoints.disable(conn, ep.id, reason="customer's server is down")
        await asyncio.sleep(2.0)  # many retention runs past the event's retention
        assert not await _gone(db_url, a)  # kept: its delivery is queued, endpoint disabled
        async with aengine.begin() as conn:
            await outbox.endpoints.enable(conn, ep.id)  # the hour of backoff is over
        await wait_until(lambda: delivered_to(receiver) == [a], timeout=5, what="sent")
        assert receiver.requests[-1].body == receiver.requests[0].body
        await wait_until(lambda: _gone(db_url, a), timeout=5, what="event deleted once sent")


async def test_queued_deliveries_are_not_sent_after_a_410_and_each_destination_keeps_its_limit(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    receiver.respond(410, delay=0.3)
    await add_endpoint(aengine, receiver.url)
    s = endpoints_settings(db_url, max_concurrency=1)
    wide = s.destinations[DEST].model_copy(update={"max_concurrency": 8})
    s = s.model_copy(update={"destinations": {**s.destinations, "other": wide}})
    async with running(s):
        await enqueue(db_url, [{"payload": {"n": i}} for i in range(8)])
        await wait_until(
            lambda: fetch(db_url, "SELECT 1 FROM outbox_endpoints WHERE NOT enabled"),
            what="disabled",
        )
        await asyncio.sleep(1.0)
    assert len(receiver.requests) == 1
    assert receiver.max_in_flight == 1


async def test_a_disabled_endpoints_pending_deliveries_are_not_claimed(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    ep = await add_endpoint(aengine, receiver.url)
    [a] = await enqueue(db_url, [{"payload": {}}])
    await fetch(db_url, "UPDATE outbox SET status = 'delivered', delivered_at = now()")
    await fetch(
        db_url,
        "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination) VALUES ($1, $2, $3)",
        a,
        ep.id,
        DEST,
    )
    async with aengine.begin() as conn:
        await outbox.endpoints.disable(conn, ep.id)
    async with running(endpoints_settings(db_url)):
        await asyncio.sleep(1.0)
        assert receiver.requests == []
        async with aengine.begin() as conn:
            await outbox.endpoints.enable(conn, ep.id)
        await wait_until(lambda: delivered_to(receiver) == [a], what="sent once enabled")


async def test_a_request_longer_than_the_lease_is_kept_alive_and_sent_once(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    receiver.respond(200, delay=3.5)
    await add_endpoint(aengine, receiver.url)
    s = endpoints_settings(db_url, timeout=10)
    s = s.model_copy(update={"relay": s.relay.model_copy(update={"lease": 1.5})})
    async with running(s):
        [a] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: deliveries_done(db_url, 1), timeout=15, what="delivered")
    assert len(receiver.requests) == 1
    [d] = await fetch(db_url, "SELECT * FROM outbox_deliveries")
    assert d["status"] == "delivered" and d["attempts"] == 1 and d["event_id"] == a


async def test_a_stop_waits_for_requests_in_flight_and_counts_those_cut_short(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    quick, stuck = make_receiver(), make_receiver()
    quick.respond(200, delay=0.8)
    stuck.respond(200, delay=10)
    await add_endpoint(aengine, quick.url)
    await add_endpoint(aengine, stuck.url)
    s = endpoints_settings(db_url, timeout=30)
    s = s.model_copy(update={"relay": s.relay.model_copy(update={"shutdown_timeout": 2})})
    async with running(s):
        await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: len(quick.requests) == 1 and len(stuck.requests) == 1)
    rows = {
        r["url"]: r
        for r in await fetch(
            db_url,
            "SELECT d.*, e.url FROM outbox_deliveries d JOIN outbox_endpoints e "
            "ON e.id = d.endpoint_id",
        )
    }
    assert rows[quick.url]["status"] == "delivered"  # waited for, not released
    cut = rows[stuck.url]
    assert cut["status"] == "pending" and cut["attempts"] == 1
    assert "stopped during the request" in cut["last_error"]


async def test_a_fast_endpoints_backlog_is_claimed_ahead_of_its_free_slots(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    """Claim ahead (#29, off by default: tests/test_endpoint_claim_ahead.py): once an
    endpoint is known to be fast, a claim takes four times its room, its requests waiting in
    the relay's request slots, instead of one claim per few freed slots; it never has more
    than max_concurrency requests in flight."""
    await add_endpoint(aengine, receiver.url)
    s = endpoints_settings(db_url, max_concurrency=2, slow_concurrency=2)
    async with running(s) as relay:
        relay.sinks[DEST].source.ahead = 4  # type: ignore[attr-defined]  # off by default
        [first] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: delivered_to(receiver) == [first], what="known fast")
        before = relay.store.statements["delivery_claim"]
        ids = await enqueue(db_url, [{"payload": {"n": i}} for i in range(96)])
        await wait_until(lambda: len(delivered_to(receiver)) == 97, timeout=30, what="sent")
        claims = relay.store.statements["delivery_claim"] - before
    assert sorted(delivered_to(receiver)) == sorted([first, *ids])
    assert receiver.max_in_flight <= 2
    # In bites of 2 (its room), 48 claims at least; ahead, bites of up to 8.
    assert claims < 30, claims


async def test_the_claim_walks_past_its_scan_limit_to_every_endpoint(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    receivers = [make_receiver() for _ in range(5)]
    for r in receivers:
        await add_endpoint(aengine, r.url)
    async with running(endpoints_settings(db_url)) as relay:
        relay.sinks[DEST].source.scan = 2  # type: ignore[attr-defined]
        [a] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: all(delivered_to(r) == [a] for r in receivers), what="all")


async def test_an_open_circuit_keeps_its_endpoint_out_of_the_claim(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    dead = f"http://127.0.0.1:{closed_port()}/dead"
    await add_endpoint(aengine, dead)
    s = endpoints_settings(
        db_url, circuit={"threshold": 2, "cooldown": 30}, backoff={"schedule": [0.05]}
    )
    async with running(s) as relay:
        await enqueue(db_url, [{"payload": {"n": i}} for i in range(20)])
        await asyncio.sleep(2.0)
        claims = relay.store.statements["delivery_claim"]
    log = await fetch(db_url, "SELECT * FROM outbox_attempts")
    # Two failures open it; the rest wait (unattempted), rather than being claimed and
    # deferred over and over.
    assert len(log) <= 2 + 4, len(log)  # the requests of the claim that opened it, at most
    assert claims > 0


async def test_an_event_with_an_unrepresentable_time_is_still_delivered(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    await add_endpoint(aengine, receiver.url)
    [a] = await enqueue(db_url, [{"payload": {}}])
    await fetch(db_url, "UPDATE outbox SET created_at = 'infinity' WHERE id = $1", a)
    async with running(endpoints_settings(db_url)):
        await wait_until(lambda: delivered_to(receiver) == [a], what="delivered")


async def test_enqueue_notifications_do_not_each_cost_a_delivery_claim(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    await add_endpoint(aengine, receiver.url)
    hook = {
        "kind": "webhook",
        "url": receiver.url,
        "secrets": [SECRET_W],
        "allow_private_networks": True,
    }
    s = endpoints_settings(db_url)
    s = s.model_copy(
        update={
            "relay": s.relay.model_copy(update={"poll_interval": 5}),
            "destinations": {**s.destinations, "hooks": load_destination(hook)},
        }
    )
    async with running(s) as relay:
        await asyncio.sleep(0.5)
        before = relay.store.statements["delivery_claim"]
        conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
        try:
            for i in range(20):
                async with conn.transaction():
                    await outbox.enqueue(conn, destination="hooks", payload={"n": i})
        finally:
            await conn.close()
        await wait_until(lambda: len(receiver.requests) == 20, what="webhooks sent")
        assert relay.store.statements["delivery_claim"] - before <= 2


async def test_a_circuit_that_opens_and_closes_is_shown_to_status(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    from relay.ops import admin

    receiver.respond(503, times=2)
    ep = await add_endpoint(aengine, receiver.url)
    s = endpoints_settings(
        db_url, circuit={"threshold": 2, "cooldown": 3.0}, backoff={"schedule": [0.1]}
    )

    async def circuit() -> dict[str, Any]:
        conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
        try:
            seen = (await admin.status(conn, "public"))["endpoints"]
        finally:
            await conn.close()
        [e] = [x for x in seen if x["id"] == ep.id]
        return e

    async with running(s):
        await enqueue(db_url, [{"payload": {}}])
        # Open for the 3 s cool-down: status says so, and until when.
        e = await wait_until(lambda: _open(circuit()), timeout=10, what="circuit open in status")
        assert e["circuit_open_until"] is not None and len(receiver.requests) == 2
        # The probe after the cool-down succeeds: closed again, and said so.
        await wait_until(lambda: deliveries_done(db_url, 1), what="delivered by the probe")
        await wait_until(lambda: _closed(circuit()), timeout=5, what="circuit closed in status")


async def _open(e: Any) -> Any:
    got = await e
    return got if got["circuit"] == "open" else None


async def _closed(e: Any) -> bool:
    got = await e
    return bool(got["circuit"] == "closed" and got["circuit_open_until"] is None)


async def test_the_message_log_has_a_retention_of_its_own(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    """Receivers ask what they were sent last week: deliveries and attempts outlive the
    events (relay.retention) for relay.message_log_retention, then go too."""
    await add_endpoint(aengine, receiver.url)
    s = endpoints_settings(db_url)
    s = s.model_copy(
        update={
            "relay": s.relay.model_copy(
                update={"retention": 0, "retention_interval": 0.1, "message_log_retention": 3}
            )
        }
    )
    async with running(s):
        [a] = await enqueue(db_url, [{"payload": {}}])
        await wait_until(lambda: _gone(db_url, a), timeout=5, what="event deleted once sent")
        [d] = await fetch(db_url, "SELECT * FROM outbox_deliveries WHERE event_id = $1", a)
        assert d["status"] == "delivered"
        assert len(await fetch(db_url, "SELECT * FROM outbox_attempts WHERE event_id = $1", a))
        await wait_until(
            lambda: fetch(db_url, "SELECT 1 FROM outbox_deliveries WHERE event_id = $1", a),
            timeout=1.5,
            what="kept",
        )
        await wait_until(
            lambda: _log_gone(db_url, a), timeout=10, what="log deleted past its retention"
        )


async def _log_gone(db_url: str, event: int) -> bool:
    rows = await fetch(
        db_url,
        "SELECT 1 FROM outbox_deliveries WHERE event_id = $1 "
        "UNION ALL SELECT 1 FROM outbox_attempts WHERE event_id = $1",
        event,
    )
    return not rows


def fair_settings(db_url: str, **dest: Any) -> Any:
    """The issue's case: room for 40 deliveries in flight, slow endpoints at 4 each."""
    d: dict[str, Any] = {
        "kind": "endpoints",
        "allow_private_networks": True,
        "timeout": 5,
        "max_concurrency": 4,
        "circuit": {"threshold": 50},
        **dest,
    }
    return settings(
        db_url,
        "127.0.0.1:9",
        destinations={DEST: d},
        relay={
            "poll_interval": 0.2,
            "batch_size": 40,
            "max_in_flight": 40,
            "shutdown_timeout": 0.5,
        },
    )


@pytest.mark.parametrize("tenants", [False, True], ids=["ten-slow-endpoints", "one-slow-tenant"])
async def test_slow_endpoints_and_tenants_leave_healthy_ones_their_share(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver], tenants: bool
) -> None:
    """Endpoints that answer 200 just under their timeout never open a circuit. Ten of them
    at max_concurrency 4 (or twelve of one tenant) could hold all 40 deliveries in flight;
    the healthy endpoint, registered last, must be served within its fair share meanwhile,
    in the first seconds as later on."""
    slow = [make_receiver() for _ in range(12 if tenants else 10)]
    for r in slow:
        r.respond(200, delay=4.0)
        await add_endpoint(aengine, r.url, tenant="big" if tenants else None)
    healthy = make_receiver()
    await add_endpoint(aengine, healthy.url, tenant="small" if tenants else None)
    small = {"tenant": "small"} if tenants else {}
    async with running(fair_settings(db_url)):
        if tenants:
            await enqueue(db_url, [{"payload": {"n": i}, "tenant": "big"} for i in range(20)])
        started = time.monotonic()
        first = await enqueue(db_url, [{"payload": {"n": i}, **small} for i in range(20)])
        await wait_until(lambda: delivered_to(healthy) == first, timeout=10, what="first wave")
        first_wave = time.monotonic() - started
        await asyncio.sleep(1.0)  # the slow ones are past their latency budget, still sending
        started = time.monotonic()
        second = await enqueue(db_url, [{"payload": {"n": i}, **small} for i in range(20)])
        await wait_until(
            lambda: delivered_to(healthy) == first + second, timeout=10, what="second wave"
        )
        second_wave = time.monotonic() - started
        assert max(r.max_in_flight for r in slow) <= 4
    # Without a share, the healthy endpoint waited for the slow ones' 4 s requests.
    assert first_wave < 2.0, first_wave
    assert second_wave < 2.0, second_wave


async def test_max_concurrency_holds_across_relays(
    db_url: str, aengine: AsyncEngine, receiver: Receiver
) -> None:
    receiver.respond(200, delay=0.5)
    await add_endpoint(aengine, receiver.url)
    s = fair_settings(db_url, max_concurrency=2, latency_budget=4)
    ids = await enqueue(db_url, [{"payload": {"n": i}} for i in range(12)])
    other = s.model_copy(update={"relay": s.relay.model_copy(update={"relay_id": "second"})})
    async with running(s), running(other):
        await wait_until(lambda: delivered_to(receiver) == ids, timeout=20, what="delivered")
    assert receiver.max_in_flight == 2  # not 2 per relay


async def test_an_endpoint_handed_to_another_tenant_is_not_sent_the_old_tenants_queue(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    """Disable, point at another customer's URL and tenant, enable: the queue kept while it
    was disabled belongs to the old tenant, and is cancelled, never sent to the new one. So
    is the queue of an endpoint narrowed to event types its queued events are not of."""
    acme, globex, narrowed = make_receiver(), make_receiver(), make_receiver()
    acme.respond(503)
    narrowed.respond(503, times=3)
    ep = await add_endpoint(aengine, acme.url, tenant="acme")
    narrow = await add_endpoint(aengine, narrowed.url, tenant="acme")
    s = endpoints_settings(db_url, backoff={"schedule": [3600]})
    async with running(s) as relay:
        ids = await enqueue(
            db_url,
            [{"payload": {"secret": i}, "tenant": "acme", "event_type": "x"} for i in range(3)],
        )
        await wait_until(
            lambda: len(acme.requests) == 3 and len(narrowed.requests) == 3, what="tried once"
        )

        async def recorded() -> bool:
            # A request answered is not yet an outcome recorded: enabling makes only the
            # pending queue due, and a delivery still running then waits out its backoff.
            rows = await fetch(db_url, "SELECT status, attempts FROM outbox_deliveries")
            return len(rows) == 6 and all(
                r["status"] == "pending" and r["attempts"] == 1 for r in rows
            )

        await wait_until(recorded, what="first tries recorded")
        async with aengine.begin() as conn:
            for e in (ep, narrow):
                await outbox.endpoints.disable(conn, e.id)
            await outbox.endpoints.update(
                conn, ep.id, url=globex.url, tenant="globex", allow_private_networks=True
            )
            await outbox.endpoints.update(conn, narrow.id, event_types=["y"])
            for e in (ep, narrow):
                await outbox.endpoints.enable(conn, e.id)

        async def settled() -> bool:
            return bool(globex.requests) or await deliveries_done(db_url, 6)

        await wait_until(settled, what="settled")
        [later] = await enqueue(db_url, [{"payload": {"n": 1}, "tenant": "globex"}])
        await wait_until(lambda: later in delivered_to(globex), what="its own tenant's")
        sample = relay.metrics.registry.get_sample_value(
            "outbox_endpoint_delivery_attempts_total",
            {"destination": DEST, "outcome": "not_taken", "status_class": "none"},
        )
    assert [int(r.headers["webhook-id"]) for r in globex.requests] == [later]
    assert len(narrowed.requests) == 3  # its first tries only
    rows = await fetch(db_url, "SELECT * FROM outbox_deliveries WHERE event_id = ANY($1)", ids)
    assert len(rows) == 6 and {r["status"] for r in rows} == {"cancelled"}
    assert all("no longer takes event" in r["last_error"] for r in rows)
    assert sample == 6


async def test_an_endpoint_starts_slow_and_a_slow_one_stays_at_slow_concurrency(
    db_url: str, aengine: AsyncEngine, make_receiver: Callable[..., Receiver]
) -> None:
    """A new endpoint gets one request at a time until one ends; past its latency budget it
    keeps to slow_concurrency, under it to max_concurrency."""
    slow, quick = make_receiver(), make_receiver()
    slow.respond(200, delay=0.8)
    quick.respond(200, delay=0.15)
    await add_endpoint(aengine, slow.url, tenant="s")
    await add_endpoint(aengine, quick.url, tenant="q")
    s = fair_settings(db_url, latency_budget=0.4, max_concurrency=4, slow_concurrency=1)
    async with running(s):
        ids = await enqueue(
            db_url,
            [{"payload": {}, "tenant": "s"} for _ in range(5)]
            + [{"payload": {}, "tenant": "q"} for _ in range(16)],
        )
        await wait_until(
            lambda: len(delivered_to(slow) + delivered_to(quick)) == len(ids), timeout=15
        )
    assert slow.max_in_flight == 1
    assert quick.max_in_flight == 4
    first, second = sorted(quick.requests, key=lambda r: r.at)[:2]
    assert first.done is not None and second.at >= first.done - 0.05  # it started alone
