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
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass

from relay.tools.localbroker import free_port, wait_for_port

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
            length = _content_length(bytes(self.buffer[:end]))
            total = end + 4 + length
            if len(self.buffer) < total:
                return
            del self.buffer[:total]
            assert self.transport is not None
            self.transport.write(RESPONSE)


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


async def _serve_forever(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Http, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def _serve(port: int) -> None:
    try:
        import uvloop

        uvloop.run(_serve_forever(port))
    except ImportError:
        asyncio.run(_serve_forever(port))


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
    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(target=_serve, args=(port,), daemon=True)
    proc.start()
    try:
        wait_for_port(port, timeout=20)
        assert proc.pid is not None
        yield LocalReceiver(f"http://127.0.0.1:{port}/hooks", proc.pid)
    finally:
        proc.terminate()
        proc.join(5)
