"""The request path (relay/sinks/webhook/requests.py) on its own, against a real receiver on
loopback: what one ``RequestPath.send`` returns, the contract the webhook sink and the
endpoints sink both rely on (the outcome, and the answer kept for a message log)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from relay.breaker import State
from relay.model import Result
from relay.sinks.webhook.config import WebhookClientSettings
from relay.sinks.webhook.requests import RequestPath, Target
from tests.support.receiver import Receiver
from tests.webhook_helpers import SECRET, dest, envelope, verify


@pytest.fixture
async def path() -> AsyncIterator[RequestPath]:
    p = RequestPath(WebhookClientSettings())
    await p.start()
    yield p
    await p.close()


def target(path: RequestPath, url: str, **kw: Any) -> Target:
    d = dest(url, **kw)
    return path.target("hook", d, d.url, d.signing_keys())


async def test_a_2xx_is_delivered_with_its_status_body_and_duration(
    receiver: Receiver, path: RequestPath
) -> None:
    receiver.respond(202, body=b"thanks")
    env = envelope()
    answer = await path.send(target(path, receiver.url), env)
    assert answer.outcome.result is Result.DELIVERED and answer.outcome.id == env.id
    assert answer.outcome.status_class == "2xx"
    assert (answer.status, answer.body) == (202, b"thanks")
    assert answer.ms > 0
    [req] = receiver.requests
    assert req.headers["webhook-id"] == str(env.id)
    verify(SECRET, req.body, req.headers)


async def test_a_410_fails_the_row_keeps_the_answer_and_spares_the_circuit(
    receiver: Receiver, path: RequestPath
) -> None:
    receiver.respond(410, body=b"no such hook")
    t = target(path, receiver.url, circuit={"threshold": 1})
    answer = await path.send(t, envelope())
    assert answer.outcome.result is Result.FAILED
    assert (answer.outcome.error or "").startswith("HTTP 410")
    assert (answer.status, answer.body) == (410, b"no such hook")
    assert t.breaker.state is State.CLOSED  # the endpoint answered: it is not down


async def test_a_429_asks_for_its_retry_after(receiver: Receiver, path: RequestPath) -> None:
    receiver.respond(429, headers={"Retry-After": "7"}, body=b"slow down")
    answer = await path.send(target(path, receiver.url), envelope())
    assert answer.outcome.result is Result.RETRY and answer.outcome.retry_in == 7.0
    assert answer.outcome.status_class == "4xx"
    assert (answer.status, answer.body) == (429, b"slow down")
    assert "slow down" in (answer.outcome.error or "")


async def test_a_timeout_is_a_retry_without_an_answer_and_counts_against_the_circuit(
    receiver: Receiver, path: RequestPath
) -> None:
    receiver.respond(200, delay=1.0)
    t = target(path, receiver.url, timeout=0.3, circuit={"threshold": 1})
    answer = await path.send(t, envelope())
    assert answer.outcome.result is Result.RETRY
    assert "timed out" in (answer.outcome.error or "")
    assert (answer.status, answer.body) == (None, b"")
    assert 250 <= answer.ms < 1000, answer.ms
    assert t.breaker.state is State.OPEN
    # Open: the next row is deferred, unattempted, until the probe.
    later = await path.send(t, envelope())
    assert later.outcome.result is Result.DEFER and later.status is None
    assert len(receiver.requests) == 1


async def test_a_check_that_objects_sends_nothing(receiver: Receiver, path: RequestPath) -> None:
    answer = await path.send(target(path, receiver.url), envelope(), lambda: "changed meanwhile")
    assert answer.outcome.result is Result.DEFER
    assert answer.outcome.error == "changed meanwhile"
    assert (answer.status, answer.ms) == (None, 0.0)
    assert receiver.requests == []


async def test_a_private_address_is_refused_before_any_request(
    receiver: Receiver, path: RequestPath
) -> None:
    t = target(path, receiver.url, allow_private_networks=False)
    answer = await path.send(t, envelope())
    assert answer.outcome.result is Result.FAILED
    assert "refused by the SSRF guard" in (answer.outcome.error or "")
    assert answer.status is None and receiver.requests == []


async def test_a_target_sends_again_once_the_pools_are_reopened(
    receiver: Receiver, path: RequestPath
) -> None:
    """A target keeps the pool it was sent through; closing the request path and starting
    it again must not leave it with the closed one."""
    t = target(path, receiver.url)
    assert (await path.send(t, envelope())).status == 200
    await path.close()
    await path.start()
    again = await path.send(t, envelope())
    assert again.outcome.result is Result.DELIVERED, again.outcome.error
    assert len(receiver.requests) == 2


async def test_a_send_after_close_is_put_back_and_opens_no_pool(
    receiver: Receiver, path: RequestPath
) -> None:
    """A request still going out as the sink stops (a batch cut short) is put back, not
    attempted: it must not open pools that nothing would close."""
    t = target(path, receiver.url)
    await path.close()
    answer = await path.send(t, envelope())
    assert answer.outcome.result is Result.DEFER, answer.outcome
    assert "request path is closed" in (answer.outcome.error or "")
    assert answer.status is None and receiver.requests == []
    assert path._pools is None  # nothing opened
