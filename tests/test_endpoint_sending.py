"""Sending one claimed delivery (Attempts._attempt) against the real request path and a
loopback receiver: what is checked after every wait, just before the request. Deliveries
are built as the claim returns them; the database is not needed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from outbox.endpoint_secrets import SecretBox
from relay.breaker import State
from relay.model import Lease
from relay.sinks.endpoints.attempts import Attempts
from relay.sinks.endpoints.config import EndpointsDestination
from relay.sinks.endpoints.store import Claimed
from relay.sinks.webhook.config import WebhookClientSettings
from relay.sinks.webhook.requests import RequestPath

SECRET = "whsec_c2VjcmV0TWFya2VyOTk5OTk5OTk5OTk5OTk5OTk5OTk="
DEST = "d"


def make(**kw: Any) -> tuple[Attempts, EndpointsDestination]:
    cfg = EndpointsDestination.model_validate(
        {
            "kind": "endpoints",
            "allow_private_networks": True,
            "max_concurrency": kw.pop("max_concurrency", 8),
            "circuit": {"threshold": 1, "cooldown": 0.2},
            **kw,
        }
    )
    d = Attempts(RequestPath(WebhookClientSettings()), {DEST: cfg}, secret_box=SecretBox(None))
    return d, cfg


_n = iter(range(1, 10**6))


def claimed(
    url: str,
    tenant: str | None,
    event_tenant: str | None,
    rate: int | None = None,
    secret: str = SECRET,
) -> Claimed:
    i = next(_n)
    return Claimed(
        id=i,
        event_id=i,
        endpoint_id=7,
        destination=DEST,
        attempts=0,
        token=1,
        replay=False,
        found=True,
        payload=b"{}",
        content_type="application/json",
        headers={},
        created_at=time.time(),
        url=url,
        secret=secret,
        previous_secret=None,
        rate_limit=rate,
        lease=Lease(time.monotonic() + 60),
        lease_started=time.monotonic(),
        event_type=None,
        tenant=tenant,
        event_types=(),
        event_tenant=event_tenant,
    )


async def test_a_delivery_waiting_for_a_probe_is_checked_again_before_it_is_sent(
    make_receiver: Any,
) -> None:
    """Endpoint 7's circuit is half open; A is the probe (a slow answer), B (tenant acme's
    event) waits for A's verdict inside the request path. Meanwhile a claim reads endpoint 7
    handed to tenant globex, at the same URL: B is not sent."""
    r = make_receiver()
    d, _ = make()
    a = claimed(r.url, "acme", "acme")
    state = d._state(a)
    assert state.endpoint is not None
    state.endpoint.breaker.failure()
    await asyncio.sleep(0.25)
    assert state.endpoint.breaker.state is State.HALF_OPEN
    r.respond(200, delay=1.0, times=1)
    b = claimed(r.url, "acme", "acme")
    d._state(b)
    ta = asyncio.create_task(d._attempt(a, state))
    await asyncio.sleep(0.05)
    tb = asyncio.create_task(d._attempt(b, state))
    await asyncio.sleep(0.2)  # B waits for the probe
    d._state(claimed(r.url, "globex", "globex"))
    ra, rb = await asyncio.gather(ta, tb)
    await d.requests.close()
    assert ra.status == "delivered"
    assert rb.status == "cancelled" and "no longer takes" in (rb.error or "")
    assert [int(x.headers["webhook-id"]) for x in r.requests] == [a.event_id]


async def test_a_410_stops_the_deliveries_waiting_for_their_pace(make_receiver: Any) -> None:
    """rate_limit 2: three deliveries of one endpoint wait for their turn (0, 0.5, 1.0 s);
    the first is answered 410 Gone: the other two are not sent, and wait, pending."""
    r = make_receiver()
    d, _ = make(circuit={"threshold": 50})
    r.respond(410)
    cs = [claimed(r.url, None, None, rate=2) for _ in range(3)]
    state = d._state(cs[0])
    for c in cs[1:]:
        d._state(c)
    recs = await asyncio.gather(*(d._attempt(c, state) for c in cs))
    await d.requests.close()
    assert len(r.requests) == 1
    assert [(x.status, x.counted) for x in recs[1:]] == [("pending", 0), ("pending", 0)]


async def test_an_endpoint_unusable_while_a_delivery_waits_is_not_sent_to(
    make_receiver: Any,
) -> None:
    r = make_receiver()
    d, _ = make()
    a = claimed(r.url, None, None, rate=2)
    b = claimed(r.url, None, None, rate=2)
    state = d._state(a)
    d._state(b)
    ta = asyncio.create_task(d._attempt(a, state))
    tb = asyncio.create_task(d._attempt(b, state))
    await asyncio.sleep(0.1)  # b waits for its turn
    d._state(claimed(r.url, None, None, rate=2, secret="enc:garbage"))
    assert state.endpoint is None
    ra, rb = await asyncio.gather(ta, tb)
    await d.requests.close()
    assert ra.status == "delivered"
    assert (rb.status, rb.counted) == ("pending", 2) and len(r.requests) == 1


async def test_deliveries_that_will_not_be_sent_take_no_turn_of_a_rate_limit(
    make_receiver: Any,
) -> None:
    """rate_limit 2: four deliveries of tenant acme's events, the endpoint now globex's, then
    one of globex: the four are cancelled at once, and the fifth is not paced behind them."""
    r = make_receiver()
    d, _ = make()
    stale = [claimed(r.url, "globex", "acme", rate=2) for _ in range(4)]
    ok = claimed(r.url, "globex", "globex", rate=2)
    state = d._state(stale[0])
    started = time.monotonic()
    recs = await asyncio.gather(*(d._attempt(c, state) for c in [*stale, ok]))
    took = time.monotonic() - started
    await d.requests.close()
    assert [x.status for x in recs] == ["cancelled"] * 4 + ["delivered"]
    assert took < 1.0, took  # paced behind them: 2 s
