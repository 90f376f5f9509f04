"""Per-key order end to end: real relay processes, a flaky real HTTP receiver, a SIGKILL."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import signal
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

import outbox
from outbox.dburl import to_asyncpg_dsn
from tests.support.receiver import Receiver, Script
from tests.support.relays import RelayProcess, status_counts, wait_until

KEYS = 200
PER_KEY = 100
SECRET = "whsec_" + base64.b64encode(b"ordered-delivery-test-secret").decode()


def config(path: Path, db_url: str, url: str) -> Path:
    path.write_text(
        f"""
database_url = "{db_url}"
log_format = "json"
[relay]
lease = 3
poll_interval = 0.2
shutdown_timeout = 5
batch_size = 200
max_attempts = 1000
backoff = {{ base = 0.05, factor = 2, max = 0.5, jitter = 0.1 }}
[http]
enabled = false
[destinations.ledger]
kind = "webhook"
url = "{url}/ledger"
allow_private_networks = true
secrets = ["{SECRET}"]
ordering = "key"
max_concurrency = 64
max_attempts = 1000
backoff = {{ base = 0.05, factor = 2, max = 0.5, jitter = 0.1 }}
circuit = {{ threshold = 1000 }}
"""
    )
    return path


@pytest.fixture
def procs() -> Iterator[list[RelayProcess]]:
    started: list[RelayProcess] = []
    yield started
    for p in started:
        p.stop()


async def write_events(db_url: str, writers: int = 8) -> dict[str, list[int]]:
    """KEYS x PER_KEY events from concurrent transactions; some commit late on purpose, so
    later ids of a key are often committed before earlier ones (about 900 events/s)."""
    ids: dict[str, list[int]] = defaultdict(list)
    todo = [f"acct-{k:03}" for k in range(KEYS) for _ in range(PER_KEY)]
    random.Random(1).shuffle(todo)
    queue = iter(todo)

    async def writer(w: int) -> None:
        rng = random.Random(w)
        conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
        try:
            while True:
                chunk = [k for _, k in zip(range(rng.randint(1, 20)), queue, strict=False)]
                if not chunk:
                    return
                async with conn.transaction():
                    got = await outbox.enqueue_many(
                        conn,
                        [{"destination": "ledger", "key": k, "payload": {"key": k}} for k in chunk],
                    )
                    if rng.random() < 0.2:
                        await asyncio.sleep(rng.uniform(0.02, 0.2))
                for k, i in zip(chunk, got, strict=True):
                    ids[k].append(i)
                # Paced below what the relays deliver, so keys have no backlog and their
                # newest rows are heads: a late commit of a lower id then really competes.
                await asyncio.sleep(rng.uniform(0.05, 0.12))
        finally:
            await conn.close()

    await asyncio.gather(*(writer(w) for w in range(writers)))
    return ids


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_per_key_order_survives_failures_and_a_killed_relay(
    db_url: str, receiver: Receiver, tmp_path: Path, procs: list[RelayProcess]
) -> None:
    rng = random.Random(5)
    receiver.respond_with(lambda: Script(500) if rng.random() < 0.1 else Script(200))
    cfg = config(tmp_path / "relay.toml", db_url, receiver.url)
    procs.extend(RelayProcess(cfg).start() for _ in range(3))
    writing = asyncio.create_task(write_events(db_url))

    async def delivered(n: int) -> bool:
        for p in procs[1:]:
            assert p.proc is not None and p.proc.poll() is None, p.output()[-2000:]
        return (await status_counts(db_url)).get("delivered", 0) >= n

    await wait_until(lambda: delivered(KEYS * PER_KEY // 4), timeout=120, what="a quarter")
    procs[0].signal(signal.SIGKILL)
    procs[0].wait(10)
    ids = await writing
    total = KEYS * PER_KEY
    await wait_until(lambda: delivered(total), timeout=180, interval=0.2, what="all delivered")
    assert await status_counts(db_url) == {"delivered": total}

    # What the receiver saw, attempt by attempt.
    first_ok: dict[int, float] = {}
    attempts: list[tuple[int, str, float]] = []
    for r in receiver.requests:
        if len(r.body) != int(r.headers["content-length"]):
            # Cut off mid-request by the SIGKILL: never acknowledged, sent again later.
            assert r.status is None
            continue
        eid = int(r.headers["webhook-id"])
        key = json.loads(r.body)["key"]
        attempts.append((eid, key, r.at))
        if r.status == 200 and r.done is not None:
            first_ok[eid] = min(first_ok.get(eid, r.done), r.done)
    assert set(first_ok) == {i for v in ids.values() for i in v}  # nothing lost
    for key, key_ids in ids.items():
        # First deliveries of a key, in time order, are exactly its ids in enqueue order.
        assert sorted(key_ids, key=first_ok.__getitem__) == sorted(key_ids), key
    # Stronger: no row was ever sent before every earlier row of its key was acknowledged.
    earlier = {k: sorted(v) for k, v in ids.items()}
    violations = [
        (eid, prev)
        for eid, key, at in attempts
        for prev in earlier[key]
        if prev < eid and first_ok[prev] > at
    ]
    assert violations == []
    assert sum(1 for r in receiver.requests if r.status == 500) > 100  # failures did happen
