"""Running relays in tests: in-process for speed, as subprocesses for crash tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg

from outbox.dburl import to_asyncpg_dsn
from relay.app import Relay
from relay.config import Settings
from relay.settings import load_settings


def settings(db_url: str, bootstrap: str, **overrides: Any) -> Settings:
    """Test settings: idempotence off (the test broker rejects it), short timings."""
    relay: dict[str, Any] = {"lease": 5, "poll_interval": 0.5, "shutdown_timeout": 5}
    relay.update(overrides.pop("relay", {}))
    kafka: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "enable_idempotence": False,
        "request_timeout_ms": 5000,
    }
    kafka.update(overrides.pop("kafka", {}))
    # Many relays run side by side in tests: each listens on a free loopback port.
    http: dict[str, Any] = {"host": "127.0.0.1", "port": 0}
    http.update(overrides.pop("http", {}))
    destinations = overrides.pop(
        "destinations", {"orders": {"kind": "kafka", "topic": overrides.pop("topic", "orders")}}
    )
    return load_settings(
        None,
        database_url=db_url,
        relay=relay,
        kafka=kafka,
        http=http,
        destinations=destinations,
        **overrides,
    )


@contextlib.asynccontextmanager
async def running(s: Settings, cls: type[Relay] = Relay, **kw: Any) -> AsyncIterator[Relay]:
    relay = cls(s, **kw)
    task = asyncio.create_task(relay.run())
    started = asyncio.create_task(relay.started.wait())
    await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED, timeout=30)
    if task.done():
        started.cancel()
        task.result()
        raise RuntimeError("relay exited during start-up")
    try:
        yield relay
    finally:
        relay.stop()
        status = await asyncio.wait_for(task, 30)
        assert status == 0, f"relay exited with {status}"


async def wait_until(
    check: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05, what: str = ""
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s: {what}")
        await asyncio.sleep(interval)


async def status_counts(db_url: str) -> dict[str, int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        rows = await conn.fetch("SELECT status, count(*) FROM outbox GROUP BY status")
        return {r[0]: r[1] for r in rows}
    finally:
        await conn.close()


def write_config(path: Path, s: dict[str, Any]) -> Path:
    """Write a relay.toml (only the subset of TOML these tests need)."""

    def value(v: Any) -> str:
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()

    lines = []
    for k, v in s.items():
        if not isinstance(v, dict):
            lines.append(f"{k} = {value(v)}")
    for k, v in s.items():
        if isinstance(v, dict):
            subs = {kk: vv for kk, vv in v.items() if isinstance(vv, dict)}
            lines.append(f"[{k}]")
            lines.extend(f"{kk} = {value(vv)}" for kk, vv in v.items() if kk not in subs)
            for kk, vv in subs.items():
                lines.append(f"[{k}.{kk}]")
                lines.extend(f"{k3} = {value(v3)}" for k3, v3 in vv.items())
    path.write_text("\n".join(lines) + "\n")
    return path


class RelayProcess:
    """``outbox-relay run`` as a real subprocess, in its own process group."""

    def __init__(self, config: Path, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = config.with_suffix(f".{id(self)}.log")

    def start(self) -> RelayProcess:
        self._out = self.log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay.cli", "run", "--config", str(self.config)],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        return self

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        if hasattr(self, "_out"):
            self._out.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""
