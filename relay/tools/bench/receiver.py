"""A fast local webhook receiver for the benchmark, in a process of its own (so its work is
not counted against the relay's interpreter): a bare asyncio protocol answering every POST
with 204 over keep-alive connections, on uvloop where installed.

A framework server (uvicorn on h11) costs more CPU per request than the relay's client does
and would measure itself; this one reads the head, skips ``content-length`` bytes of body,
and answers. It serves nothing else and is never a product endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay.tools.localbroker import LocalBrokerError

RESPONSE = b"HTTP/1.1 204 No Content\r\nconnection: keep-alive\r\n\r\n"
MAX_HEAD = 65536


class _Http(asyncio.Protocol):
    def __init__(self) -> None:
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD and self.transport is not None:
                    self.transport.close()
                return
            head = bytes(self.buffer[:end])
            total = end + 4 + _content_length(head)
            if len(self.buffer) < total:
                return
            del self.buffer[:total]
            self.answer(head)

    def answer(self, head: bytes) -> None:
        """A whole request (its head; the body skipped) has arrived."""
        assert self.transport is not None
        self.transport.write(RESPONSE)


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


# --- Ports: each server binds port 0 in the receiver process, which then reports the port
# the kernel gave it. A port picked in the parent and bound later by the child could be taken
# in between (an outgoing connection of any process may be given it as its ephemeral port).


def _listening(servers: list[asyncio.Server], ports: Any, ready: Any) -> None:
    """In the receiver process: report each server's port, then that all are listening."""
    for index, server in enumerate(servers):
        ports[index] = server.sockets[0].getsockname()[1]
    ready.set()


def _start(
    ctx: Any, target: Callable[..., None], args: tuple[Any, ...], n: int, timeout: float = 20.0
) -> tuple[Any, list[int]]:
    """Start ``target(*args, ports, ready)`` in a process of its own and wait until it has
    bound its ``n`` ports (written to ``ports``, then ``ready`` set); returns the process and
    the ports. LocalBrokerError (the process ended) if it ends first or is not listening
    within ``timeout`` seconds."""
    ports = ctx.Array("i", n, lock=False)
    ready = ctx.Event()
    proc = ctx.Process(target=target, args=(*args, ports, ready), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if not proc.is_alive():
                proc.join(1)
                raise LocalBrokerError(
                    f"the receiver process (pid {proc.pid}) ended before listening, "
                    f"exit code {proc.exitcode}"
                )
            if time.monotonic() > deadline:
                _end(proc)
                raise LocalBrokerError(
                    f"the receiver process (pid {proc.pid}) was not listening after "
                    f"{timeout} s; ended it (exit code {proc.exitcode})"
                )
    except BaseException:
        _end(proc)
        raise
    return proc, list(ports)


def _end(proc: Any) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


async def _serve_forever(ports: Any, ready: Any) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Http, "127.0.0.1", 0, backlog=1024)
    _listening([server], ports, ready)
    async with server:
        await server.serve_forever()


def _serve(ports: Any, ready: Any) -> None:
    try:
        import uvloop

        uvloop.run(_serve_forever(ports, ready))
    except ImportError:
        asyncio.run(_serve_forever(ports, ready))


@dataclass
class LocalReceiver:
    url: str
    pid: int

    def cpu_seconds(self) -> float:
        """User + system CPU the receiver process has used so far (Linux /proc)."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks


@contextlib.contextmanager
def local_receiver() -> Iterator[LocalReceiver]:
    proc, (port,) = _start(multiprocessing.get_context("spawn"), _serve, (), 1)
    try:
        assert proc.pid is not None
        yield LocalReceiver(f"http://127.0.0.1:{port}/hooks", proc.pid)
    finally:
        _end(proc)


# --- Several endpoints in one process (``bench fanout``) -----------------------------------
#
# One port per endpoint, so each endpoint has connections of its own as distinct receivers
# would; a port may answer after a delay (a slow endpoint). Each port counts its requests in
# shared memory (read by the benchmark while it runs) and, when the process is told to stop
# (SIGTERM), writes when each request arrived and which event it carried (its webhook-id) to
# a file: the benchmark's commit-to-delivery latency is that time less the event's commit.


class _CountingHttp(_Http):
    """As _Http, and notes each request (arrival time, webhook-id); answers after ``delay``."""

    def __init__(self, index: int, delay: float, counts: Any, seen: list[tuple[int, int, float]]):
        super().__init__()
        self.index, self.delay, self.counts, self.seen = index, delay, counts, seen

    def answer(self, head: bytes) -> None:
        self.seen.append((self.index, _webhook_id(head), time.time()))
        self.counts[self.index] += 1
        assert self.transport is not None
        if self.delay > 0:
            asyncio.get_running_loop().call_later(self.delay, self._answer)
        else:
            self.transport.write(RESPONSE)

    def _answer(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(RESPONSE)


def _webhook_id(head: bytes) -> int:
    """The request's ``webhook-id`` (the event id), -1 if it has none."""
    at = head.find(b"\r\nwebhook-id:")
    if at < 0:
        at = head.lower().find(b"\r\nwebhook-id:")
    if at < 0:
        return -1
    end = head.find(b"\r\n", at + 2)
    try:
        return int(head[at + 13 : end if end > 0 else len(head)].strip())
    except ValueError:
        return -1


async def _serve_ports(
    delays: list[float], counts: Any, ports: Any, ready: Any
) -> list[tuple[int, int, float]]:
    loop = asyncio.get_running_loop()
    seen: list[tuple[int, int, float]] = []
    stop = asyncio.Event()
    # Before reporting ready: a SIGTERM from then on writes what was seen, even if early.
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    servers = []
    for index, delay in enumerate(delays):
        servers.append(
            await loop.create_server(
                lambda i=index, d=delay: _CountingHttp(i, d, counts, seen),  # type: ignore[misc]
                "127.0.0.1",
                0,
                backlog=1024,
            )
        )
    _listening(servers, ports, ready)
    await stop.wait()
    for server in servers:
        server.close()
    return seen


def _serve_many(delays: list[float], counts: Any, out: str, ports: Any, ready: Any) -> None:
    try:
        import uvloop

        seen = uvloop.run(_serve_ports(delays, counts, ports, ready))
    except ImportError:
        seen = asyncio.run(_serve_ports(delays, counts, ports, ready))
    Path(out + ".part").write_text(json.dumps(seen))
    os.replace(out + ".part", out)


@dataclass
class LocalReceivers:
    """Endpoints on loopback ports served by one process; see :func:`local_receivers`."""

    urls: list[str]
    pid: int
    counts: Any  # shared array: requests received per port, so far
    out: Path
    proc: Any

    def cpu_seconds(self) -> float:
        return LocalReceiver("", self.pid).cpu_seconds()

    def received(self) -> int:
        return sum(self.counts[i] for i in range(len(self.urls)))

    def stop(self) -> list[tuple[int, int, float]]:
        """Stop the process; every request it received: (port index, webhook-id, time)."""
        if self.proc.is_alive():
            self.proc.terminate()  # SIGTERM: it writes what it saw, then exits
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        if not self.out.exists():
            return []
        return [(int(i), int(e), float(t)) for i, e, t in json.loads(self.out.read_text())]


@contextlib.contextmanager
def local_receivers(delays: list[float], tmp: Path) -> Iterator[LocalReceivers]:
    """One receiver process serving ``len(delays)`` ports (URL ``/hooks/<n>``), port n
    answering after ``delays[n]`` seconds; always stopped on exit."""
    ctx = multiprocessing.get_context("spawn")
    counts = ctx.Array("q", len(delays), lock=False)
    out = tmp / f"received-{uuid.uuid4().hex}.json"
    proc, ports = _start(ctx, _serve_many, (list(delays), counts, str(out)), len(delays))
    receivers = None
    try:
        assert proc.pid is not None
        urls = [f"http://127.0.0.1:{port}/hooks/{n}" for n, port in enumerate(ports)]
        receivers = LocalReceivers(urls, proc.pid, counts, out, proc)
        yield receivers
    finally:
        if receivers is not None:
            receivers.stop()
        else:
            _end(proc)
