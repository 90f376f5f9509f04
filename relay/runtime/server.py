"""The relay's HTTP listener: ``/metrics``, ``/healthz``, ``/readyz``, served by uvicorn.

uvicorn runs on the relay's own event loop. The socket is bound here, before uvicorn starts,
so a port in use is a clear start-up error; uvicorn's own signal handling is switched off
(the relay owns SIGTERM/SIGINT and stops the server as the last step of its shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, make_asgi_app

from relay.config import HttpSettings
from relay.obs import scrub

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# A probe answers (ok, details); details become the JSON body.
Probe = Callable[[], Awaitable[tuple[bool, dict[str, Any]]]]


class HttpStartupError(Exception):
    """The listener cannot start (usually: the port is taken)."""


# The operator console's place in the listener, with [ui] enabled = true; the tenant
# portal's, with [portal] enabled = true.
CONSOLE_PREFIX = "/ui"
PORTAL_PREFIX = "/portal"


def build_app(
    registry: CollectorRegistry,
    healthz: Probe,
    readyz: Probe,
    console: ASGIApp | None = None,
    portal: ASGIApp | None = None,
) -> ASGIApp:
    metrics_app: ASGIApp = make_asgi_app(registry=registry)
    probes = {"/healthz": healthz, "/readyz": readyz}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/metrics":
            await metrics_app(scope, receive, send)
            return
        for prefix, mounted in ((CONSOLE_PREFIX, console), (PORTAL_PREFIX, portal)):
            if mounted is not None and (path + "/").startswith(prefix + "/"):
                if path == prefix:
                    await _redirect(send, prefix + "/")
                    return
                # Mounted: it sees its prefix as root_path (Starlette's routing strips it).
                root = scope.get("root_path", "") + prefix
                await mounted({**scope, "root_path": root}, receive, send)
                return
        probe = probes.get(path)
        if probe is None:
            status, body = 404, {"error": f"no such path {path}; try /metrics /healthz /readyz"}
        else:
            ok, details = await probe()
            status, body = (200 if ok else 503), {"status": "ok" if ok else "fail", **details}
        # Probe details quote database and sink errors: scrubbed like every log line.
        data = scrub.scrub(json.dumps(body, default=str)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                    (b"cache-control", b"no-store"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})

    return app


async def _redirect(send: Send, location: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 308,
            "headers": [(b"location", location.encode()), (b"content-length", b"0")],
        }
    )
    await send({"type": "http.response.body", "body": b""})


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The relay handles signals itself; uvicorn would replace its handlers.
        yield


class HttpServer:
    def __init__(self, settings: HttpSettings, app: ASGIApp) -> None:
        self.settings = settings
        self.app = app
        self.port: int | None = None
        self._sock: socket.socket | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    def bind(self) -> None:
        host, port = self.settings.host, self.settings.port
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, _, _, _, addr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
                sock.listen(128)
            except OSError:
                sock.close()
                raise
        except OSError as exc:
            raise HttpStartupError(
                f"cannot listen on {host}:{port} for /metrics and probes: {exc}. Set http.port "
                "(OUTBOX_HTTP_PORT) to a free port, http.host to a local address, or "
                "http.enabled = false to run without the listener"
            ) from exc
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]

    async def start(self) -> None:
        if self._sock is None:
            self.bind()
        assert self._sock is not None
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
        )
        self._server = _Server(config)
        # The socket already listens: connections queue in its backlog until uvicorn accepts
        # them. The task is supervised by the relay, so a listener that dies stops it.
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name="http")

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._task), 5)
            if not self._task.done():
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
