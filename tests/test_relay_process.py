"""The relay as a real process: config errors, SIGKILL mid-batch, SIGTERM under load."""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import outbox
from outbox.dburl import to_asyncpg_dsn
from tests.support.faults import HELD_IDS, HOLDS, fetch, fetchval
from tests.support.kafka import consume_ids, outbox_id
from tests.support.relays import RelayProcess, status_counts, wait_until, write_config


def config(db_url: str, bootstrap: str, topic: str, **relay: Any) -> dict[str, Any]:
    return {
        "database_url": db_url,
        "log_format": "json",
        "relay": {"lease": 3, "poll_interval": 0.2, "shutdown_timeout": 10, **relay},
        "kafka": {"bootstrap_servers": bootstrap, "enable_idempotence": False},
        "http": {"host": "127.0.0.1", "port": 0},
        "destinations": {"orders": {"kind": "kafka", "topic": topic}},
    }


@pytest.fixture
def procs() -> Iterator[list[RelayProcess]]:
    started: list[RelayProcess] = []
    yield started
    for p in started:
        p.stop()


async def enqueue_batches(db_url: str, batches: int, size: int) -> list[int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    ids: list[int] = []
    try:
        for b in range(batches):
            async with conn.transaction():
                ids += await outbox.enqueue_many(
                    conn,
                    [
                        {"destination": "orders", "key": f"k{i % 50}", "payload": {"b": b, "i": i}}
                        for i in range(size)
                    ],
                )
    finally:
        await conn.close()
    return ids


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("database_url = 'postgresql://x/y'\n[relay\n", "not valid TOML"),
        (
            "database_url = 'postgresql://x/y'\n[relay]\nbatch_sz = 3\n",
            "relay.batch_sz: unknown key",
        ),
        ("database_url = 'postgresql://x/y'\n[relay]\nlease = 'long'\n", "relay.lease:"),
        ("[relay]\nlease = 5\n", "database_url: required"),
        ("database_url = 'mysql://x/y'\n", "postgresql://"),
        (
            "database_url = 'postgresql://x/y'\n[destinations.o]\nkind = 'carrier-pigeon'\n",
            "destinations.o",
        ),
        (
            "database_url = 'postgresql://x/y'\n[kafka]\nacks = 1\n",
            "enable_idempotence = true needs acks = 'all'",
        ),
    ],
)
def test_bad_config_exits_2_naming_the_key(tmp_path: Path, toml: str, expected: str) -> None:
    cfg = tmp_path / "relay.toml"
    cfg.write_text(toml)
    res = run_cli("run", "--config", str(cfg), env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 2, res.stderr
    assert expected in res.stderr


def test_missing_config_file(tmp_path: Path) -> None:
    res = run_cli("run", "--config", str(tmp_path / "nope.toml"))
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_env_overrides_file_and_check(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path / "relay.toml",
        {"database_url": "postgresql://file/db", "relay": {"batch_size": 10}},
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "OUTBOX_RELAY_BATCH_SIZE": "oops",
    }
    res = run_cli("run", "--config", str(cfg), "--check", env=env)
    assert res.returncode == 2 and "relay.batch_size" in res.stderr  # the env value was used
    env["OUTBOX_RELAY_BATCH_SIZE"] = "20"
    env["OUTBOX_DESTINATIONS"] = '{"orders": {"kind": "kafka", "topic": "orders"}}'
    res = run_cli("run", "--config", str(cfg), "--check", env=env)
    assert res.returncode == 0, res.stderr
    assert "1 destination" in res.stdout


def test_unreachable_database_exits_1(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path / "relay.toml",
        {
            "database_url": "postgresql://root:hunter2@127.0.0.1:1/x",
            "relay": {"startup_timeout": 1},
            "destinations": {"o": {"kind": "kafka", "topic": "o"}},
        },
    )
    res = run_cli("run", "--config", str(cfg))
    assert res.returncode == 1
    assert "cannot reach the database" in res.stderr
    assert "hunter2" not in res.stderr + res.stdout


async def test_sigkill_mid_batch_loses_nothing(
    db_url: str, kafka_bootstrap: str, tmp_path: Path, procs: list[RelayProcess]
) -> None:
    topic = f"kill-{uuid.uuid4().hex[:8]}"
    ids = await enqueue_batches(db_url, 10, 1000)
    cfg = write_config(
        tmp_path / "relay.toml", config(db_url, kafka_bootstrap, topic, batch_size=100)
    )
    victim = RelayProcess(cfg).start()
    procs.append(victim)

    async def some_delivered() -> bool:
        c = await status_counts(db_url)
        return c.get("delivered", 0) > 0 and bool(await fetchval(db_url, HOLDS, None))

    await wait_until(some_delivered, timeout=30, interval=0.01, what="victim mid-stream")
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    held = await fetch(db_url, HELD_IDS, None)  # running, or in flight in a batch lease
    survivor = RelayProcess(cfg).start()
    procs.append(survivor)

    async def done() -> bool:
        return (await status_counts(db_url)).get("delivered", 0) == len(ids)

    await wait_until(done, timeout=60, what="all delivered after the lease")
    records = await consume_ids(kafka_bootstrap, topic, ids, timeout=30)
    seen = Counter(outbox_id(r) for r in records)
    assert set(seen) == set(ids)  # every event arrived
    # A redelivery is the same message under the same id, which consumers deduplicate on.
    first: dict[int, tuple[bytes | None, bytes | None]] = {}
    for r in records:
        assert first.setdefault(outbox_id(r), (r.key, r.value)) == (r.key, r.value)
    assert held  # the kill really left rows mid-delivery
    rows = await status_counts(db_url)
    assert rows == {"delivered": len(ids)}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
async def test_sigterm_under_load_exits_0_and_leaves_nothing_running(
    db_url: str, kafka_bootstrap: str, tmp_path: Path, procs: list[RelayProcess], sig: int
) -> None:
    """SIGTERM, and SIGHUP too (a closed terminal, a supervisor's reload): a graceful stop,
    never a crash that leaves held rows to wait for their lease."""
    topic = f"term-{uuid.uuid4().hex[:8]}"
    cfg = write_config(
        tmp_path / "relay.toml", config(db_url, kafka_bootstrap, topic, batch_size=50)
    )
    relay = RelayProcess(cfg).start()
    procs.append(relay)
    writer = asyncio.create_task(enqueue_batches(db_url, 40, 250))
    await wait_until(lambda: _delivered_at_least(db_url, 500), timeout=30, what="relay under load")
    relay.signal(sig)
    loop = asyncio.get_running_loop()
    stopped_at = loop.time()
    status = await asyncio.to_thread(relay.wait, 30)
    # Within shutdown_timeout (10 s), plus the interpreter's own exit.
    assert loop.time() - stopped_at < 12
    ids = await writer
    assert status == 0, relay.output()[-2000:]
    counts = await status_counts(db_url)
    assert counts.get("running", 0) == 0, counts
    assert '"event": "relay.stopped"' in relay.output()
    # `run` uses the relay's default event loop: uvloop where it is installed.
    loop_kind = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    assert f'"event_loop": "{loop_kind}"' in relay.output()
    assert f'"reason": "{signal.Signals(sig).name}"' in relay.output()
    # Nothing lost: a second relay finishes the rest.
    finisher = RelayProcess(cfg).start()
    procs.append(finisher)
    await wait_until(
        lambda: _delivered_at_least(db_url, len(ids)), timeout=60, what="the rest delivered"
    )
    records = await consume_ids(kafka_bootstrap, topic, ids, timeout=30)
    assert {outbox_id(r) for r in records} == set(ids)
    # Nor sent twice: what the stopping relay delivered was recorded before it let go of the
    # rest, so the finisher sent only rows that had never been sent.
    copies = Counter(outbox_id(r) for r in records)
    assert [i for i, n in copies.items() if n > 1] == []
    assert '"event": "relay.shutdown.unrecorded"' not in relay.output()


async def _delivered_at_least(db_url: str, n: int) -> bool:
    return (await status_counts(db_url)).get("delivered", 0) >= n
