"""The console that `outbox-relay demo --keep` serves on its database (relay/tools/demo/console.py):
on `outbox-relay ui`'s port where it is free, and the command it prints to serve the console
again works as printed, wherever the console was served."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from relay.tools.demo import _next_steps
from relay.tools.demo import console as serving


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_consoles_port_is_taken_again_right_after_a_console_closed_its_connections() -> None:
    """A console stopped with a browser's connection open closes that connection itself
    (TIME_WAIT on its side for a minute). The next demo's console still takes the port, as
    `outbox-relay ui` would: it moved to another port, which the `ui` command printed before
    did not name."""
    port = _free_port()
    first = serving.bind(port=port)
    first.listen()
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = first.accept()
    accepted.close()  # the server side closes first
    client.close()
    first.close()
    again = serving.bind(port=port)
    try:
        assert again.getsockname()[1] == port
    finally:
        again.close()


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def _ui(command: str) -> subprocess.Popen[str]:
    """The command the demo printed, run by a shell as a person would paste it (in a process
    group of its own, stopped whole)."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    return subprocess.Popen(
        ["bash", "-c", command],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


async def test_served_on_another_port_the_command_printed_serves_it_there_again(
    db_url: str, held_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its port taken, the console is served on a free one; the command printed when it stops
    names that port (the `ui` command's default is the port that was taken), and it serves
    the console there, signed in with the token printed."""
    token = "demo-console-token-0123456789"
    again = _next_steps(db_url, token, True)
    task = asyncio.create_task(serving.serve(db_url, "public", token, again, port=held_port))
    out = ""
    for _ in range(500):
        out += capsys.readouterr().out
        if "console: " in out or task.done():
            break
        await asyncio.sleep(0.02)
    served = re.search(r"console: http://127\.0\.0\.1:(\d+)/", out)
    assert served, out
    port = int(served[1])
    assert port not in (held_port, serving.PORT)
    task.cancel()
    await task  # a stop asked for is the end of the console, not a failure
    out += capsys.readouterr().out
    found = re.search(r"^console stopped; serve it again with: (.+)$", out, re.M)
    assert found, out
    command = found[1]
    assert shlex.split(command)[-2:] == ["--port", str(port)], command
    proc = _ui(command)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                    login = await client.post("/login", data={"token": token, "next": "/"})
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the console did not start again"
                await asyncio.sleep(0.1)
        assert login.status_code == 303, login.text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=10)
