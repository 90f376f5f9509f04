"""Serving an ASGI app (the console, a FastAPI receiver) on loopback for a test."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn

from tests.support.relays import wait_until


class serve:
    """Serve an ASGI app with uvicorn on a free loopback port, on the test's event loop."""

    def __init__(self, app: Any) -> None:
        # Bound here and handed to uvicorn: a port found free and bound later may be taken
        # meanwhile (the suite's other worker binds servers all the time).
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = int(self.socket.getsockname()[1])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> str:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.socket]))
        await wait_until(lambda: self.server.started, timeout=10, what="server started")
        return f"http://127.0.0.1:{self.port}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        assert self.task is not None
        try:
            await asyncio.wait_for(self.task, 10)
        finally:
            self.socket.close()
