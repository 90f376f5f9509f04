"""An ASGI app served by uvicorn on the tool's own event loop (the demo's receiver and console,
the benchmark's console), on a socket the caller bound: started before the block runs, stopped
when it ends."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn


class QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The tools handle signals themselves (relay.tools.stopping): SIGTERM or Ctrl-C
        # cancels the run, and this server stops with everything else it started.
        yield


@contextlib.asynccontextmanager
async def served(
    app: Any, sock: socket.socket, what: str, **config: Any
) -> AsyncIterator[asyncio.Task[None]]:
    """``app`` served on ``sock`` until the block ends (``config``: uvicorn's); the server's
    task, which ends if it stops. Raises what stopped it before it started (``what`` names
    it). The socket is closed afterwards."""
    settings = uvicorn.Config(app, log_config=None, log_level="warning", **config)
    server = QuietServer(settings)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                await task  # raises what stopped it
                raise OSError(f"{what} stopped before it started")
            await asyncio.sleep(0.01)
        yield task
    finally:
        server.should_exit = True
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        sock.close()
