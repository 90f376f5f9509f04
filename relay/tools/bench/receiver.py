"""A fast local webhook receiver for the benchmark, in a process of its own (so its work is
not counted against the relay's interpreter): uvicorn serving a 204 to every POST."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from relay.tools.localbroker import free_port, wait_for_port

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:  # drain the body, as a real receiver would
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _serve(port: int) -> None:
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


@contextlib.contextmanager
def local_receiver() -> Iterator[str]:
    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(target=_serve, args=(port,), daemon=True)
    proc.start()
    try:
        wait_for_port(port, timeout=20)
        yield f"http://127.0.0.1:{port}/hooks"
    finally:
        proc.terminate()
        proc.join(5)
