"""Broker restart: the Kafka broker stops mid-run while the application keeps committing, and
comes back on the same port. Relay processes stay up and catch up by themselves.

The test broker keeps messages in memory, so a restart loses what it held: the test reads
what reached the broker before the stop, then what reached it after the restart, and checks
every row's state and time of delivery against the two phases (see the assertions). What it
proves: no row is marked delivered without an acknowledgement, the relays survive the outage
and deliver everything committed before, during and after it once the broker is back."""

from __future__ import annotations

import asyncio
import signal
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from relay.tools.localbroker import LocalBroker
from tests.support.faults import (
    Writer,
    all_delivered,
    end_of_run,
    events,
    fetch,
    fetchval,
    fleet,
    install_audit,
    max_lag,
    read_copies,
    relay_config,
)
from tests.support.kafka import consume, outbox_id
from tests.support.relays import wait_until

pytestmark = pytest.mark.slow

MARGIN = timedelta(seconds=2)  # an ack just before the stop may be recorded just after it


@pytest.mark.timeout(300)
async def test_broker_restart_mid_run_loses_nothing(
    db_url: str,
    tmp_path: Path,
    long_run: bool,
    fault_report: dict[str, object],
) -> None:
    total, span, down = (20_000, 30.0, 8.0) if long_run else (6_000, 12.0, 5.0)
    topic = f"broker-{uuid.uuid4().hex[:8]}"
    broker = LocalBroker()
    broker.start()
    writer = Writer(db_url, total, chunk=200, rate=total / span)
    await install_audit(db_url)
    try:
        with fleet(tmp_path) as relays:
            for rid in ("kafka-a", "kafka-b"):
                cfg = relay_config(db_url, broker.bootstrap, topic, relay_id=rid)
                cfg["kafka"]["request_timeout_ms"] = 2000
                relays.start(cfg, rid)
            writing = asyncio.create_task(writer.run())
            await wait_until(
                lambda: _delivered_at_least(db_url, total // 5), timeout=60, what="phase 1"
            )
            # Phase 1: what the first broker holds, read up to the moment it stops.
            before = await consume(broker.bootstrap, topic, count=total, timeout=3)
            stopped_at = await fetchval(db_url, "SELECT clock_timestamp()")
            broker.stop()
            await asyncio.sleep(down)  # the outage itself: the writer keeps committing
            assert len(relays.alive()) == 2, relays.logs()[-3000:]
            restarted_at = await fetchval(db_url, "SELECT clock_timestamp()")
            # The test broker acknowledges produce requests for a topic it does not have and
            # drops them (a real broker answers UNKNOWN_TOPIC_OR_PARTITION), and a relay's
            # producer still knows the topic from before the restart: freeze the relays until
            # the empty broker has the topic again, so what this test measures is the relay.
            for p in relays.alive():
                p.signal(signal.SIGSTOP)
            try:
                broker.start()  # same port, empty
                await _create_topic(broker.bootstrap, topic)
            finally:
                for p in relays.alive():
                    p.signal(signal.SIGCONT)
            ids = await writing

            async def delivered() -> bool:
                assert len(relays.alive()) == 2, relays.logs()[-3000:]
                return await all_delivered(db_url, total)

            await wait_until(delivered, timeout=120, interval=0.2, what="caught up")
            clean = await end_of_run(db_url)
            logs = relays.logs()
            rows = await fetch(db_url, "SELECT id, status, delivered_at FROM outbox")
            after_ids = [r["id"] for r in rows if r["delivered_at"] >= restarted_at]
            after = await read_copies(broker.bootstrap, topic, after_ids, timeout=60)
    finally:
        broker.stop()

    assert {r["status"] for r in rows} == {"delivered"} and len(rows) == len(ids) == total
    # Nothing is marked delivered while no broker was there to acknowledge it.
    lying = [r["id"] for r in rows if stopped_at + MARGIN < r["delivered_at"] < restarted_at]
    assert not lying, lying[:5]
    # Phase 1: every row delivered well before the stop is on the first broker.
    seen_before = {outbox_id(r) for r in before}
    early = {r["id"] for r in rows if r["delivered_at"] < stopped_at - MARGIN}
    assert early <= seen_before, sorted(early - seen_before)[:5]
    # Phase 2: every row delivered after the restart is on the new broker (read_copies
    # checks each id is there with one content); they include all rows committed meanwhile.
    assert len(after_ids) >= 1
    assert events(logs, "relay.sink.unavailable") and events(logs, "relay.sink.recovered")
    fault_report.update(
        events=total,
        relays=2,
        broker_down_s=down,
        delivered_before_stop=len(early),
        delivered_after_restart=len(after_ids),
        in_stop_margin=total - len(early) - len(after_ids),
        duplicates_after_restart=after.duplicates,
        max_lag_s=await max_lag(db_url),
        **clean,
    )


async def _create_topic(bootstrap: str, topic: str) -> None:
    """Create the topic, then prove it stores what it acknowledges: a probe (no outbox-id,
    which read_copies leaves out) written to every partition and read back. Right after a
    restart the test broker could acknowledge the relays' first writes and keep nothing."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=4, replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=False)
    await producer.start()
    try:
        for partition in range(4):
            await producer.send_and_wait(topic, b'{"probe": true}', partition=partition)
    finally:
        await producer.stop()
    probes = await consume(bootstrap, topic, count=4, timeout=30)
    assert len(probes) >= 4, "the restarted broker did not keep the probes"


async def _delivered_at_least(db_url: str, n: int) -> bool:
    return bool(
        await fetchval(db_url, "SELECT count(*) >= $1 FROM outbox WHERE status = 'delivered'", n)
    )
