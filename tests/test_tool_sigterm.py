"""A bench stopped by SIGTERM (`timeout`, a cancelled CI job, `kill`) stops what it started as
Ctrl-C does: its local broker ends and its scratch database is dropped; it exits 143 saying so.
Before, SIGTERM killed it where it stood and left both behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import asyncpg

from outbox.dburl import to_asyncpg_dsn


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found.update(int(c) for c in text)
    return found


def _local_ports(pid: int) -> set[int]:
    """The local TCP ports of ``pid``'s sockets (from /proc: no psutil here)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def _scratch_of(admin: asyncpg.Connection, pid: int) -> str | None:
    """The scratch database the bench ``pid`` has a connection to, if any yet."""
    name: str | None = await admin.fetchval(
        "SELECT datname FROM pg_stat_activity "
        "WHERE client_port = ANY($1::int[]) AND datname LIKE 'outbox\\_bench\\_%' LIMIT 1",
        sorted(_local_ports(pid)),
    )
    return name


async def test_a_bench_stopped_by_sigterm_leaves_no_broker_and_no_database(
    pg_admin_url: str, tmp_path: Path
) -> None:
    # Its error output to a file, not a pipe: what it started and left behind would hold a
    # pipe open, and reading it would wait for them.
    errors = tmp_path / "stderr"
    with errors.open("wb") as err_file:
        bench = ["bench", "steady", "--sink", "kafka", "--rate", "20", "--seconds", "300"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "relay.cli", *bench, "--database-url", pg_admin_url],
            stdout=subprocess.DEVNULL,
            stderr=err_file,
        )
    admin = await asyncpg.connect(to_asyncpg_dsn(pg_admin_url))
    database: str | None = None
    broker: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        # Running: its scratch database has the relay's sessions, and its broker is a child.
        while time.monotonic() < deadline and proc.poll() is None:
            database = database or await _scratch_of(admin, proc.pid)
            broker = {c for c in _children(proc.pid) if "tansu" in _cmdline(c)}
            if database and broker:
                break
            await asyncio.sleep(0.2)
        assert proc.poll() is None, errors.read_text()
        assert database and broker, (database, broker)
        await asyncio.sleep(1.0)  # writers and relay under way

        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        err = errors.read_text()
        assert proc.returncode == 143, err
        assert "stopped by SIGTERM" in err, err
        assert not [c for c in broker if _alive(c)], "the local broker outlived the bench"
        left = await admin.fetchval("SELECT count(*) FROM pg_database WHERE datname = $1", database)
        assert left == 0, f"{database} was left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for child in broker:  # whatever happened, nothing of this test outlives it
            if _alive(child):
                os.kill(child, signal.SIGKILL)
        if database:
            await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.close()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
