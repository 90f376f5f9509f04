"""Routes: each destination's rules, read once, and sinks that see one destination per call."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import asyncpg

import outbox
from outbox.dburl import to_asyncpg_dsn
from relay.model import Envelope, Outcome
from relay.pipeline.routes import attempt_limits, build_routes
from tests.support.relays import running, settings
from tests.support.sinks import MemorySink
from tests.webhook_helpers import new_secret

DESTINATIONS = {
    "plain": {"kind": "kafka", "topic": "plain"},
    "ordered": {
        "kind": "kafka",
        "topic": "ordered",
        "ordering": "key",
        "poison_policy": "park",
        "max_attempts": 3,
        "backoff": {"schedule": [1, 2]},
    },
    "blocking": {
        "kind": "webhook",
        "url": "http://127.0.0.1:1/in",
        "secrets": [new_secret()],
        "ordering": "key",
    },
}


class Recording(MemorySink):
    """Delivers everything; notes the destinations of each call."""

    def __init__(self) -> None:
        self.calls: list[set[str]] = []

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
        self.calls.append({e.destination for e in batch})
        return [Outcome.delivered(e.id) for e in batch]


def test_a_route_holds_its_destination_s_rules_or_the_relay_s() -> None:
    s = settings(
        "postgresql://x@127.0.0.1/db",
        "127.0.0.1:1",
        relay={"max_attempts": 7, "backoff": {"base": 4}},
        destinations=DESTINATIONS,
    )
    sink = Recording()
    routes = build_routes(s, dict.fromkeys(DESTINATIONS, sink))
    plain, ordered, blocking = routes["plain"], routes["ordered"], routes["blocking"]
    assert (plain.ordered, plain.parks_poison, plain.blocks_keys) == (False, False, False)
    assert (plain.max_attempts, plain.backoff.base) == (7, 4)  # the relay's
    assert (ordered.ordered, ordered.parks_poison, ordered.blocks_keys) == (True, True, False)
    assert ordered.max_attempts == 3 and ordered.backoff.schedule == [1, 2]  # its own
    assert (blocking.ordered, blocking.blocks_keys) == (True, True)
    assert all(r.sink is sink for r in routes.values())
    # Webhook destinations default to their own limit (see WebhookDestination).
    assert blocking.max_attempts == 10
    assert attempt_limits(s) == {"plain": 7, "ordered": 3, "blocking": 10}


async def test_a_sink_is_given_one_destination_per_call(db_url: str) -> None:
    """A claim that spans destinations of one sink reaches it as one call per destination:
    sinks never sort a batch out (or meet a destination that is not theirs)."""
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            await outbox.enqueue_many(
                conn,
                [{"destination": d, "payload": {"i": i}} for i in range(30) for d in ("a", "b")],
            )
    finally:
        await conn.close()
    sink = Recording()
    s = settings(
        db_url,
        "127.0.0.1:1",
        relay={"batch_size": 60},
        destinations={"a": {"kind": "kafka", "topic": "a"}, "b": {"kind": "kafka", "topic": "b"}},
    )
    async with running(s, sinks={"a": sink, "b": sink}) as relay:
        async with asyncio.timeout(20):
            while relay.stats["delivered"] < 60:
                await asyncio.sleep(0.05)
    assert sink.calls and all(len(c) == 1 for c in sink.calls), sink.calls
    assert set().union(*sink.calls) == {"a", "b"}


def test_a_sink_missing_part_of_the_interface_is_refused_at_construction() -> None:
    """A sink without ``kind`` would fail every row it is handed; one without ``circuits``
    every metrics scrape. Refused before anything is claimed."""
    import pytest

    from relay.app import Relay

    class Bare:  # deliver() alone, as a hand-written sink might start
        async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
            return [Outcome.delivered(e.id) for e in batch]

    s = settings("postgresql://root@127.0.0.1:5432/unused", "127.0.0.1:9")
    with pytest.raises(TypeError, match=r"'orders' \(Bare\) is not a relay.sinks.Sink") as e:
        Relay(s, sinks={"orders": Bare()})  # type: ignore[dict-item]
    assert "kind, start, available, ready, circuits, close" in str(e.value)
    Relay(s, sinks={"orders": MemorySink()})  # a whole sink is accepted
