"""The webhook sink against a real HTTP receiver on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
import structlog
from standardwebhooks import WebhookVerificationError

from relay.model import Envelope, Outcome, Result
from relay.sinks import Sink
from relay.sinks.webhook.config import WebhookClientSettings, WebhookDestination
from relay.sinks.webhook.sink import WebhookSink, parse_retry_after
from tests.support.receiver import Receiver
from tests.webhook_helpers import (
    SECRET,
    closed_port,
    dest,
    envelope,
    new_secret,
    verify,
    verify_bytes,
)

SinkFactory = Callable[..., WebhookSink]


@pytest.fixture
async def make_sink() -> AsyncIterator[SinkFactory]:
    sinks: list[WebhookSink] = []

    def make(
        http: WebhookClientSettings | None = None,
        slot_wait: float = 5.0,
        **destinations: WebhookDestination,
    ) -> WebhookSink:
        sink = WebhookSink(http or WebhookClientSettings(), destinations, slot_wait=slot_wait)
        sinks.append(sink)
        return sink

    yield make
    for s in sinks:
        await s.close()


async def deliver_all(sink: WebhookSink, batch: list[Envelope]) -> list[Outcome]:
    """Deliver rows of several destinations as the relay does: one call per destination, the
    calls running at once."""
    groups: dict[str, list[Envelope]] = {}
    for env in batch:
        groups.setdefault(env.destination, []).append(env)
    results = await asyncio.gather(*(sink.deliver(envs) for envs in groups.values()))
    return [o for outcomes in results for o in outcomes]


async def one(sink: WebhookSink, env: Envelope) -> Outcome:
    [outcome] = await sink.deliver([env])
    assert outcome.id == env.id
    return outcome


# --- signing and headers -----------------------------------------------------------------


async def test_signed_delivery_verifies_with_reference_library(
    receiver: Receiver, make_sink: SinkFactory
) -> None:
    sink = make_sink(hook=dest(receiver.url + "/hooks/orders", headers={"X-Team": "orders"}))
    await sink.start()
    assert isinstance(sink, Sink)
    env = envelope(
        headers={
            "event-type": "order.created",
            # These would clash with what the relay sets, so they are not sent from the row.
            "webhook-id": "forged",
            "Webhook-Signature": "v1,forged",
            "Content-Type": "text/forged",
            "X-Team": "row-loses",
        }
    )
    assert await one(sink, env) == Outcome.delivered(env.id, status_class="2xx")

    [req] = receiver.wait_for(1)
    assert (req.method, req.path, req.body) == ("POST", "/hooks/orders", env.payload)
    h = req.headers
    assert h["webhook-id"] == str(env.id)
    assert h["content-type"] == "application/json"
    assert h["event-type"] == "order.created"
    assert h["x-team"] == "orders"
    assert h["user-agent"].startswith("outbox-relay/")
    assert abs(int(h["webhook-timestamp"]) - time.time()) < 60
    assert h["webhook-signature"].startswith("v1,") and " " not in h["webhook-signature"]
    verify(SECRET, req.body, h)
    with pytest.raises(WebhookVerificationError):
        verify(new_secret(), req.body, h)  # the check can fail


async def test_rotation_sends_one_valid_signature_per_secret(
    receiver: Receiver, make_sink: SinkFactory
) -> None:
    old, new = new_secret(), new_secret()
    sink = make_sink(hook=dest(receiver.url, secrets=[old, new]))
    await one(sink, envelope())
    [req] = receiver.wait_for(1)
    sigs = req.headers["webhook-signature"].split(" ")
    assert len(sigs) == 2 and all(s.startswith("v1,") for s in sigs)
    for secret, sig in ((old, sigs[0]), (new, sigs[1])):
        # Each secret on its own verifies its own signature.
        verify(secret, req.body, {**req.headers, "webhook-signature": sig})


async def test_binary_payload_signed_over_bytes(receiver: Receiver, make_sink: SinkFactory) -> None:
    import base64
    import hashlib
    import hmac

    sink = make_sink(hook=dest(receiver.url))
    env = envelope(payload=bytes(range(256)), content_type="application/x-protobuf")
    assert (await one(sink, env)).result is Result.DELIVERED
    [req] = receiver.wait_for(1)
    assert req.body == env.payload and req.headers["content-type"] == "application/x-protobuf"
    # The reference library only takes text bodies, so check this one by hand.
    key = base64.b64decode(SECRET.removeprefix("whsec_"))
    signed = f"{env.id}.{req.headers['webhook-timestamp']}.".encode() + env.payload
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    assert req.headers["webhook-signature"] == f"v1,{expected}"
    verify_bytes(SECRET, req.body, req.headers)  # the tests' spec verifier agrees
    with pytest.raises(AssertionError, match="bad signature"):
        verify_bytes(SECRET, req.body + b"\x00", req.headers)
    with pytest.raises(AssertionError, match="bad signature"):
        verify_bytes(new_secret(), req.body, req.headers)


async def test_row_header_that_cannot_be_sent_fails_that_row_only(
    receiver: Receiver, make_sink: SinkFactory
) -> None:
    sink = make_sink(hook=dest(receiver.url))
    bad = envelope(headers={"x-evil": "a\r\nInjected: 1"})
    good = envelope()
    outcomes = {o.id: o for o in await sink.deliver([bad, good])}
    assert outcomes[bad.id].result is Result.FAILED
    assert "line break" in (outcomes[bad.id].error or "")
    assert outcomes[good.id].result is Result.DELIVERED
    assert [r.headers["webhook-id"] for r in receiver.wait_for(1)] == [str(good.id)]


# --- outcomes ----------------------------------------------------------------------------


async def test_retries_keep_webhook_id_and_record_status_latency_body(
    receiver: Receiver, make_sink: SinkFactory
) -> None:
    receiver.respond(500, body=b"database on fire\n" + b"x" * 5000, times=2)
    sink = make_sink(hook=dest(receiver.url))
    env = envelope(id=42)
    first = await one(sink, env)
    second = await one(sink, envelope(id=42, attempts=1))
    third = await one(sink, envelope(id=42, attempts=2))
    assert [first.result, second.result, third.result] == [
        Result.RETRY,
        Result.RETRY,
        Result.DELIVERED,
    ]
    assert first.retry_in is None  # the destination's backoff decides
    error = first.error or ""
    assert error.startswith("HTTP 500 in ") and " ms from http://127.0.0.1:" in error
    assert "database on fire" in error and len(error) < 700  # only the first bytes kept
    reqs = receiver.wait_for(3)
    assert {r.headers["webhook-id"] for r in reqs} == {"42"}
    for r in reqs:
        verify(SECRET, r.body, r.headers)


@pytest.mark.parametrize("status", [408, 425, 429, 500, 502, 503, 504])
async def test_transient_statuses_retry(
    status: int, receiver: Receiver, make_sink: SinkFactory
) -> None:
    receiver.respond(status)
    sink = make_sink(hook=dest(receiver.url))
    outcome = await one(sink, envelope())
    assert outcome.result is Result.RETRY and f"HTTP {status}" in (outcome.error or "")


@pytest.mark.parametrize(
    ("status", "header", "expected"),
    [
        (429, "7", 7.0),
        (503, "120", 120.0),
        (429, "0", 1.0),  # floored: no hot loop
        (429, "999999", 3600.0),  # capped by retry_after_max
        (503, "soon", None),  # unparseable: the backoff schedule decides
        (500, "7", None),  # only 429/503 carry a meaningful Retry-After
    ],
)
async def test_retry_after_sets_retry_in(
    status: int,
    header: str,
    expected: float | None,
    receiver: Receiver,
    make_sink: SinkFactory,
) -> None:
    receiver.respond(status, headers={"Retry-After": header})
    sink = make_sink(hook=dest(receiver.url))
    outcome = await one(sink, envelope())
    assert outcome.result is Result.RETRY
    assert outcome.retry_in == expected


async def test_retry_after_http_date(receiver: Receiver, make_sink: SinkFactory) -> None:
    when = datetime.now(UTC) + timedelta(seconds=90)
    receiver.respond(429, headers={"Retry-After": format_datetime(when, usegmt=True)})
    sink = make_sink(hook=dest(receiver.url, retry_after_max=60))
    outcome = await one(sink, envelope())
    assert outcome.retry_in == 60.0  # 90 s asked, capped at this destination's 60


def test_parse_retry_after() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert parse_retry_after("30", now) == 30.0
    assert parse_retry_after("Thu, 01 Jan 2026 00:01:00 GMT", now) == 60.0
    assert parse_retry_after("Wed, 31 Dec 2025 00:00:00 GMT", now) == 0.0  # in the past
    assert parse_retry_after("-5", now) is None
    assert parse_retry_after("", now) is None
    assert parse_retry_after(None, now) is None


async def test_410_fails_and_reports_gone(receiver: Receiver, make_sink: SinkFactory) -> None:
    receiver.respond(410, body=b"endpoint deleted")
    sink = make_sink(hook=dest(receiver.url))
    with structlog.testing.capture_logs() as logs:
        outcomes = await sink.deliver([envelope(), envelope()])
    assert {o.result for o in outcomes} == {Result.FAILED}
    assert all("HTTP 410" in (o.error or "") for o in outcomes)
    gone = [e for e in logs if e["event"] == "relay.webhook.gone"]
    assert len(gone) == 1 and gone[0]["destination"] == "hook" and gone[0]["rows"] == 2
    assert sink.available("hook")  # 410 is about the endpoint's wish, not its health


async def test_redirect_is_not_followed(receiver: Receiver, make_sink: SinkFactory) -> None:
    receiver.respond(302, headers={"Location": receiver.url + "/elsewhere"})
    sink = make_sink(
        retrying=dest(receiver.url + "/a"),
        strict=dest(receiver.url + "/b", retry_client_errors=False),
    )
    a, b = envelope("retrying"), envelope("strict")
    outcomes = {o.id: o for o in await deliver_all(sink, [a, b])}
    assert outcomes[a.id].result is Result.RETRY
    assert outcomes[b.id].result is Result.FAILED
    assert "redirects are not followed" in (outcomes[b.id].error or "")
    # The outcomes are in, so anything a redirect would have sent has been sent.
    assert sorted(r.path for r in receiver.requests) == ["/a", "/b"]


@pytest.mark.parametrize("status", [400, 401, 404, 422])
async def test_client_errors_retry_by_default_or_fail_when_configured(
    status: int, receiver: Receiver, make_sink: SinkFactory
) -> None:
    receiver.respond(status)
    sink = make_sink(
        retrying=dest(receiver.url), strict=dest(receiver.url, retry_client_errors=False)
    )
    a, b = envelope("retrying"), envelope("strict")
    outcomes = {o.id: o.result for o in await deliver_all(sink, [a, b])}
    assert outcomes == {a.id: Result.RETRY, b.id: Result.FAILED}


async def test_timeout_is_a_retry(receiver: Receiver, make_sink: SinkFactory) -> None:
    receiver.respond(200, delay=2.0)
    sink = make_sink(hook=dest(receiver.url, timeout=0.3))
    started = time.monotonic()
    outcome = await one(sink, envelope())
    took = time.monotonic() - started
    assert outcome.result is Result.RETRY and "timed out" in (outcome.error or "")
    assert took < 1.5  # gave up at the timeout, did not wait for the 2 s answer


async def test_connection_refused_and_reset_are_retries(
    receiver: Receiver, make_sink: SinkFactory
) -> None:
    receiver.respond(reset=True, times=1)
    sink = make_sink(
        dead=dest(f"http://127.0.0.1:{closed_port()}/"),
        flaky=dest(receiver.url),
    )
    dead, flaky = envelope("dead"), envelope("flaky")
    outcomes = {o.id: o for o in await deliver_all(sink, [dead, flaky])}
    assert outcomes[dead.id].result is Result.RETRY
    assert "cannot connect (ConnectionRefusedError)" in (outcomes[dead.id].error or "")
    assert outcomes[flaky.id].result is Result.RETRY
    assert "Error" in (outcomes[flaky.id].error or "")
    assert (await one(sink, envelope("flaky"))).result is Result.DELIVERED


async def test_dns_failure_is_a_retry(make_sink: SinkFactory) -> None:
    sink = make_sink(hook=dest("http://no-such-host.invalid/hook"))
    outcome = await one(sink, envelope())
    assert outcome.result is Result.RETRY and "DNS lookup" in (outcome.error or "")


# --- isolation -----------------------------------------------------------------------------


async def test_concurrency_limit_per_endpoint(receiver: Receiver, make_sink: SinkFactory) -> None:
    receiver.respond(200, delay=0.3)
    sink = make_sink(hook=dest(receiver.url, max_concurrency=3))
    outcomes = await sink.deliver([envelope() for _ in range(9)])
    assert {o.result for o in outcomes} == {Result.DELIVERED}
    assert receiver.max_in_flight == 3


async def test_slow_endpoint_does_not_delay_a_healthy_one(
    make_receiver: Callable[[], Receiver], make_sink: SinkFactory
) -> None:
    slow, healthy = make_receiver(), make_receiver()
    slow.respond(200, delay=2.0)  # hangs past the timeout: a dead endpoint
    sink = make_sink(
        slow=dest(slow.url, timeout=1.0, max_concurrency=2),
        healthy=dest(healthy.url),
    )
    batch = [envelope("slow") for _ in range(4)] + [envelope("healthy") for _ in range(20)]
    started = time.monotonic()
    task = asyncio.create_task(deliver_all(sink, batch))
    reqs = await asyncio.to_thread(healthy.wait_for, 20)
    healthy_done = max(r.at for r in reqs) - started
    outcomes = await task
    slow_done = time.monotonic() - started
    by_dest = {
        d: {o.result for o in outcomes if o.id in {e.id for e in batch if e.destination == d}}
        for d in ("slow", "healthy")
    }
    assert by_dest == {"slow": {Result.RETRY}, "healthy": {Result.DELIVERED}}
    # The slow endpoint's rows took two timeouts (4 rows, 2 at a time); the healthy rows
    # all arrived in a small fraction of that.
    assert slow_done >= 2.0
    assert healthy_done / slow_done < 0.25, (healthy_done, slow_done)


async def test_rows_queued_behind_a_slow_endpoint_are_deferred_not_held(
    make_receiver: Callable[[], Receiver], make_sink: SinkFactory
) -> None:
    slow, healthy = make_receiver(), make_receiver()
    slow.respond(200, delay=1.0)
    sink = make_sink(
        slot_wait=0.3, slow=dest(slow.url, max_concurrency=2), healthy=dest(healthy.url)
    )
    batch = [envelope("slow") for _ in range(10)] + [envelope("healthy") for _ in range(3)]
    task = asyncio.create_task(deliver_all(sink, batch))
    await asyncio.to_thread(slow.wait_for, 2)
    assert not sink.available("slow")  # congested: 10 rows for 2 slots
    assert sink.available("healthy")
    started = time.monotonic()
    outcomes = {o.id: o for o in await task}
    # The call ended when the two attempted rows did, not after five rounds of them.
    assert time.monotonic() - started < 2.0
    slow_results = [outcomes[e.id].result for e in batch if e.destination == "slow"]
    assert sorted(slow_results) == sorted([Result.DELIVERED] * 2 + [Result.DEFER] * 8)
    busy = next(o for o in outcomes.values() if o.result is Result.DEFER)
    assert "busy" in (busy.error or "") and busy.retry_in == 1.0
    assert len(slow.requests) == 2 and sink.available("slow")


async def test_circuit_opens_defers_probes_and_closes(
    receiver: Receiver, make_sink: SinkFactory
) -> None:
    receiver.respond(503, times=2)
    circuit = {"threshold": 2, "cooldown": 0.5, "max_cooldown": 10}
    sink = make_sink(hook=dest(receiver.url, max_concurrency=1, circuit=circuit))
    with structlog.testing.capture_logs() as logs:
        first = await sink.deliver([envelope() for _ in range(5)])
    assert [o.result for o in first] == [Result.RETRY] * 2 + [Result.DEFER] * 3
    assert all(o.retry_in and 0 < o.retry_in <= 1.0 for o in first[2:])
    assert "circuit open" in (first[2].error or "")
    assert len(receiver.requests) == 2  # deferred rows were not sent
    assert not sink.available("hook")
    assert [e["event"] for e in logs] == ["relay.webhook.circuit_opened"]

    await wait_until(lambda: sink.available("hook"), timeout=5)  # half-open after cool-down
    receiver.respond(200, delay=0.2)
    with structlog.testing.capture_logs() as logs:
        second = await sink.deliver([envelope() for _ in range(4)])
    assert {o.result for o in second} == {Result.DELIVERED}
    assert [e["event"] for e in logs] == ["relay.webhook.circuit_closed"]
    # The probe went alone; once it succeeded the rest followed.
    probe, *rest = receiver.requests[2:]
    assert all(r.at >= probe.at + 0.15 for r in rest)


async def test_failed_probe_reopens_with_longer_cooldown(
    receiver: Receiver, make_sink: SinkFactory
) -> None:
    receiver.respond(500)
    circuit = {"threshold": 1, "cooldown": 0.3, "max_cooldown": 10}
    sink = make_sink(hook=dest(receiver.url, max_concurrency=4, circuit=circuit))
    await one(sink, envelope())
    assert not sink.available("hook")
    await wait_until(lambda: sink.available("hook"), timeout=5)
    with structlog.testing.capture_logs() as logs:
        outcomes = await sink.deliver([envelope() for _ in range(4)])
    assert sorted(o.result for o in outcomes) == sorted([Result.RETRY] + [Result.DEFER] * 3)
    assert len(receiver.requests) == 2  # one probe only
    assert [e["event"] for e in logs] == ["relay.webhook.probe_failed"]
    deferred = [o for o in outcomes if o.result is Result.DEFER]
    assert all(o.retry_in and o.retry_in > 0.3 for o in deferred)  # cool-down doubled


async def wait_until(cond: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.02)


# --- SSRF guard ---------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::ffff:127.0.0.1]"])
async def test_private_address_refused_by_default(
    host: str, receiver: Receiver, make_sink: SinkFactory
) -> None:
    sink = make_sink(hook=dest(f"http://{host}:{receiver.port}/", allow_private_networks=False))
    outcome = await one(sink, envelope())
    assert outcome.result is Result.FAILED
    error = outcome.error or ""
    assert "SSRF" in error and "allow_private_networks" in error and "allowed_networks" in error
    assert receiver.requests == []
    assert sink.available("hook")  # refused by us, not down


@pytest.mark.parametrize(
    "allow",
    [{"allow_private_networks": True}, {"allowed_networks": ["127.0.0.0/8"]}],
    ids=["allow_private_networks", "allowed_networks"],
)
async def test_private_address_allowed_by_config(
    allow: dict[str, Any], receiver: Receiver, make_sink: SinkFactory
) -> None:
    allow = {"allow_private_networks": False, **allow}
    sink = make_sink(hook=dest(f"http://localhost:{receiver.port}/", **allow))
    assert (await one(sink, envelope())).result is Result.DELIVERED
    assert len(receiver.wait_for(1)) == 1


async def test_allow_list_is_exact(receiver: Receiver, make_sink: SinkFactory) -> None:
    sink = make_sink(
        hook=dest(
            receiver.url, allow_private_networks=False, allowed_networks=["10.0.0.0/8", "::1/128"]
        )
    )
    outcome = await one(sink, envelope())
    assert outcome.result is Result.FAILED and "127.0.0.1" in (outcome.error or "")
    assert receiver.requests == []


async def test_a_row_that_waited_past_its_lease_is_not_sent(
    receiver: Receiver, make_sink: SinkFactory
) -> None:
    """The endpoint takes one request at a time; the second row waits for the slot longer
    than the relay's lease on it lasts, so it is not sent (another relay may hold it now)."""
    receiver.respond(200, delay=1.0)
    sink = make_sink(hook=dest(receiver.url, max_concurrency=1))
    first = envelope()
    late = envelope()
    late.lease.until = time.monotonic() + 0.5
    outcomes = {o.id: o for o in await sink.deliver([first, late])}
    assert outcomes[first.id].result is Result.DELIVERED
    assert outcomes[late.id].result is Result.DEFER
    assert "lease expired" in (outcomes[late.id].error or "")
    assert [r.headers["webhook-id"] for r in receiver.requests] == [str(first.id)]
