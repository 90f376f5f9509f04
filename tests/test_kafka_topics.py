"""A topic the cluster refuses fails (or retries) its own rows; the circuit that all Kafka
destinations share opens only when the cluster itself is unreachable."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
from structlog.testing import capture_logs

import outbox
from outbox.dburl import to_asyncpg_dsn
from tests.support.kafka import consume_ids
from tests.support.relays import running, settings, wait_until


async def enqueue(db_url: str, destination: str, n: int) -> list[int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            return await outbox.enqueue_many(
                conn, [{"destination": destination, "payload": {"i": i}} for i in range(n)]
            )
    finally:
        await conn.close()


async def test_a_topic_the_cluster_refuses_stays_with_its_own_rows(
    db_url: str, kafka_bootstrap: str
) -> None:
    good_topic = f"good-{uuid.uuid4().hex[:8]}"
    s = settings(
        db_url,
        kafka_bootstrap,
        relay={"poll_interval": 0.05, "backoff": {"base": 0.1, "factor": 1, "jitter": 0}},
        destinations={
            "good": {"kind": "kafka", "topic": good_topic},
            "bad": {"kind": "kafka", "topic": "placeholder"},
        },
    )
    with capture_logs() as logs:
        async with running(s) as relay:
            # A topic the broker refuses ("..": the config refuses it now, so it is set here,
            # as a topic deleted or made forbidden on the cluster would be).
            sink = relay.sinks["bad"]
            sink.topics["bad"] = ".."  # type: ignore[attr-defined]
            bad = await enqueue(db_url, "bad", 5)
            good = []
            for _ in range(10):  # healthy traffic alongside, for a few seconds
                good += await enqueue(db_url, "good", 20)
                await asyncio.sleep(0.2)

            async def settled() -> bool:
                conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
                try:
                    n = await conn.fetchval(
                        "SELECT count(*) FROM outbox WHERE destination = 'good' "
                        "AND status = 'delivered'"
                    )
                    retried = await conn.fetchval(
                        "SELECT min(attempts) FROM outbox WHERE destination = 'bad'"
                    )
                finally:
                    await conn.close()
                return bool(n == len(good) and retried and retried >= 3)

            await wait_until(settled, timeout=20, what="good delivered, bad retried")
    events = [e["event"] for e in logs]
    assert "relay.sink.unavailable" not in events  # the cluster never looked down
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        errors = await conn.fetch("SELECT status, last_error FROM outbox WHERE destination = 'bad'")
    finally:
        await conn.close()
    assert all(r["status"] == "pending" for r in errors)
    assert all("topic '..' of destination 'bad' does not exist" in r["last_error"] for r in errors)
    records = await consume_ids(kafka_bootstrap, good_topic, good)
    assert len(records) >= len(good)
    assert bad  # claimed, retried, never sent


async def test_an_outage_is_not_mistaken_for_a_missing_topic(db_url: str) -> None:
    """aiokafka says "unknown topic" when metadata times out, an unreachable cluster
    included: rows of a topic the relay has not used yet, enqueued during an outage, wait
    behind the open circuit (no attempt spent), and are delivered once the broker is back."""
    from relay.tools.localbroker import LocalBroker

    broker = LocalBroker()
    broker.start()
    a_topic, b_topic = f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
    s = settings(
        db_url,
        broker.bootstrap,
        relay={"max_attempts": 3, "backoff": {"base": 0.2, "factor": 1, "jitter": 0}},
        kafka={"request_timeout_ms": 1500},
        destinations={
            "a": {"kind": "kafka", "topic": a_topic},
            "b": {"kind": "kafka", "topic": b_topic},
        },
    )
    try:
        with capture_logs() as logs:
            async with running(s):
                first = await enqueue(db_url, "a", 1)
                await wait_until(lambda: _delivered(db_url, first), what="a delivered")
                broker.stop()
                later = await enqueue(db_url, "b", 3)
                await wait_until(
                    lambda: any(e["event"] == "relay.sink.unavailable" for e in logs),
                    timeout=20,
                    what="the circuit opens",
                )
                await asyncio.sleep(3)  # long enough for three attempts, were they spent
                conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
                try:
                    during = await conn.fetch(
                        "SELECT status, last_error FROM outbox WHERE id = ANY($1)", later
                    )
                finally:
                    await conn.close()
                broker.start()
                await wait_until(lambda: _delivered(db_url, later), timeout=60, what="b")
    finally:
        broker.stop()
    assert all(r["status"] in ("pending", "running") for r in during), during
    assert not any("does not exist" in (r["last_error"] or "") for r in during), during


async def _delivered(db_url: str, ids: list[int]) -> bool:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        n = await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE id = ANY($1) AND status = 'delivered'", ids
        )
    finally:
        await conn.close()
    return bool(n == len(ids))
