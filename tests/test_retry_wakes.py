"""A retry this relay writes is claimed when it comes due, not at the poll: finished
deliveries look only for fresh deliveries (DELIVERY_LOOK), so nothing else claims it before
the poll (poll_interval 10 s here) when no other delivery is under way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.receiver import Receiver
from tests.support.relays import running, wait_until
from tests.test_endpoint_delivery import (
    SLOW_POLL,
    add_endpoint,
    aengine,  # noqa: F401  (fixture)
    delivered_to,
    endpoints_settings,
    enqueue,
)
from tests.test_endpoint_source import served


def _settings(db_url: str, **dest: Any) -> Any:
    """An endpoints destination retrying after 0.5 s, polled every 10 s."""
    return endpoints_settings(
        db_url, SLOW_POLL, **{"backoff": {"schedule": [0.5], "jitter": 0}, **dest}
    )


async def _retried_after(r: Receiver, event: int) -> float:
    """Seconds from the first request to the second, once ``event`` was delivered."""
    await wait_until(lambda: len(r.requests) >= 1, timeout=30, what="the first attempt")
    await wait_until(lambda: event in delivered_to(r), timeout=30, what="the retry")
    return r.requests[1].at - r.requests[0].at


async def test_a_retry_is_sent_when_it_comes_due_not_at_the_poll(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    make_receiver: Callable[..., Receiver],
) -> None:
    """A delivery answered 503 is due again 0.5 s later (its backoff): the relay claims it
    then. Finished deliveries used to run a claim every 0.1 s, which found it under load;
    they now look for fresh deliveries only (DELIVERY_LOOK), and with nothing else under way
    nothing but the poll would claim it."""
    r = make_receiver()
    r.respond(503, times=1)
    await add_endpoint(aengine, r.url)
    async with running(_settings(db_url)):
        [event] = await enqueue(db_url, [{"payload": {}}])
        took = await _retried_after(r, event)
    assert 0.5 <= took < 1.7, f"the retry came {took:.1f} s after the first attempt"


async def test_a_retry_written_while_an_earlier_one_waits_is_claimed_when_due(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    make_receiver: Callable[..., Receiver],
) -> None:
    """Two retries, due 0.5 s and about 0.75 s after the first attempt: the wake-up kept the
    first one's time only, and dropped the second's once it ran (found by review: the second
    waited for the poll)."""
    r = make_receiver()
    r.respond(503, times=2)
    await add_endpoint(aengine, r.url)
    async with running(_settings(db_url)):
        [first] = await enqueue(db_url, [{"payload": {"n": 1}}])
        await wait_until(lambda: len(r.requests) >= 1, timeout=30, what="the first attempt")
        await asyncio.sleep(0.25)
        [second] = await enqueue(db_url, [{"payload": {"n": 2}}])
        await wait_until(lambda: len(r.requests) >= 2, timeout=30, what="the second attempt")
        tried = r.requests[1].at
        await wait_until(
            lambda: {first, second} <= set(delivered_to(r)), timeout=30, what="both retries"
        )
    took = r.requests[-1].at - tried
    assert 0.5 <= took < 2.0, f"the second retry came {took:.1f} s after its first attempt"


async def test_a_retry_due_while_its_circuit_is_open_is_sent_at_the_probe(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    make_receiver: Callable[..., Receiver],
) -> None:
    """The 503 opens the endpoint's circuit (threshold 1) for 1.5 s; its retry is due 0.5 s
    after: the claim woken then leaves the endpoint out (its circuit is open), and nothing
    woke it when the probe came due (found by review: the retry waited for the poll)."""
    r = make_receiver()
    r.respond(503, times=1)
    await add_endpoint(aengine, r.url)
    circuit = {"threshold": 1, "cooldown": 1.5, "max_cooldown": 1.5}
    async with running(_settings(db_url, circuit=circuit)):
        [event] = await enqueue(db_url, [{"payload": {}}])
        took = await _retried_after(r, event)
    assert 1.5 <= took < 3.0, f"the retry came {took:.1f} s after the first attempt"


async def test_a_retry_due_while_its_endpoint_has_no_room_is_sent_when_it_has(
    db_url: str,
    aengine: AsyncEngine,  # noqa: F811
    make_receiver: Callable[..., Receiver],
) -> None:
    """The retry comes due while the endpoint's one request slot is taken by another
    delivery (slow: 1.5 s, past its 0.2 s budget): the claim woken then takes none of it.
    When that delivery finishes, only a look ran (it reads fresh deliveries only), where the
    claim that finished deliveries ran before would have taken the retry (found by review:
    it waited for the poll)."""
    r = make_receiver()
    r.respond(503, times=1)
    r.respond(200, delay=1.5, times=1)
    await add_endpoint(aengine, r.url)
    s = _settings(db_url, max_concurrency=1, slow_concurrency=1, latency_budget=0.2, timeout=5)
    async with running(s):
        [first] = await enqueue(db_url, [{"payload": {"n": 1}}])
        await wait_until(lambda: len(r.requests) >= 1, timeout=30, what="the first attempt")
        await enqueue(db_url, [{"payload": {"n": 2}}])
        await wait_until(lambda: len(r.requests) >= 2, timeout=30, what="the slow one")
        slow_started = r.requests[1].at
        await wait_until(lambda: first in delivered_to(r), timeout=30, what="the retry")
    took = r.requests[2].at - slow_started
    assert took < 3.0, f"the retry came {took:.1f} s after the slow delivery started"


async def test_retries_coming_due_one_after_another_wake_the_claim_ten_times_a_second_at_most(
    db_url: str,
) -> None:
    """A dead endpoint's thousands of retries, each due at its own time (jitter): the claim
    is woken as they come due, but not once for each."""
    async with served(db_url) as s:
        woken: list[float] = []
        s.source.on_due = lambda: woken.append(time.monotonic())
        now = time.monotonic()
        s.source.retries_written((i, 1, 0.3 + i * 0.0005) for i in range(1000))
        await asyncio.sleep(1.0)
        assert 3 <= len(woken) <= 9, woken
        assert woken[0] - now >= 0.3


def test_a_retry_waits_until_claimed_or_a_poll_interval_after_it_came_due() -> None:
    """DueRetries: a retry that came due waits (its endpoint's records claim again) until this
    relay claims it, or for a poll interval (another relay may have claimed it); a retry
    claimed or written again leaves no stale wake-up or waiting behind."""
    from relay.sinks.endpoints.retries import DueRetries

    r = DueRetries(grace=1.0)
    r.wrote([(10, 1, 5.0), (11, 1, 6.0), (12, 2, 5.5)])
    assert r.next_due() == 5.0 and not r.waiting(1, 4.9)
    assert r.waiting(1, 5.0) and not r.waiting(2, 5.0)
    r.claimed(10)
    assert not r.waiting(1, 5.2) and r.next_due() == 5.5
    r.wrote([(12, 2, 9.0)])  # tried again before it came due: only the new time counts
    assert r.next_due() == 6.0 and not r.waiting(2, 6.0)
    assert r.waiting(1, 6.5) and not r.waiting(1, 7.1)  # forgotten a poll interval after
    assert r.next_due() == 9.0 and r.waiting(2, 9.0)
    r.wake_at(20.0)
    r.claimed(12)
    assert not r.waiting(2, 9.1) and r.next_due() == 20.0


def test_past_the_retries_it_follows_a_retry_only_wakes_the_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failing endpoint's backlog of a million deliveries is not kept one by one: past
    TRACKED, a retry wakes the claim at the next tenth of a second after it is due (one
    wake-up for all those due then), and waits for no record."""
    from relay.sinks.endpoints import retries

    monkeypatch.setattr(retries, "TRACKED", 2)
    r = retries.DueRetries(grace=1.0)
    r.wrote([(1, 1, 5.0), (2, 1, 5.0), (3, 2, 5.01), (4, 2, 5.02), (5, 2, 7.0)])
    assert len(r._ids) == 2 and len(r._heap) == 4
    assert r.next_due() == 5.0
    assert r.waiting(1, 5.05) and not r.waiting(2, 5.05)
    r.came_due(5.2)
    assert r.next_due() == pytest.approx(7.0) and not r.waiting(2, 5.2)
