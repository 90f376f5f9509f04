"""The real services the other tests stand on answer as expected."""

from __future__ import annotations

import httpx
from aiokafka import AIOKafkaProducer

from tests.support.kafka import consume
from tests.support.receiver import Receiver


async def test_broker_roundtrip(kafka_bootstrap: str) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, enable_idempotence=False)
    await producer.start()
    try:
        await producer.send_and_wait("harness", b"v", key=b"k", headers=[("h", b"1")])
    finally:
        await producer.stop()
    records = await consume(kafka_bootstrap, "harness", count=1)
    assert [(r.key, r.value, list(r.headers)) for r in records] == [(b"k", b"v", [("h", b"1")])]


async def test_receiver_scripts_answers(receiver: Receiver) -> None:
    receiver.respond(503, headers={"Retry-After": "7"}, times=1)
    async with httpx.AsyncClient() as client:
        first = await client.post(receiver.url + "/a", content=b"one")
        second = await client.post(receiver.url + "/b", content=b"two")
    assert (first.status_code, first.headers["retry-after"]) == (503, "7")
    assert second.status_code == 200
    got = receiver.wait_for(2)
    assert [(r.path, r.body) for r in got] == [("/a", b"one"), ("/b", b"two")]
