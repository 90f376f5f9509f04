"""The demo's webhook receivers: one local HTTP server on a loopback port, in the demo's own
process, whose paths stand for the receivers of the webhook destination and of each endpoint.

Each path has its signing secret: every request is checked with the ``standardwebhooks``
library, as a customer's receiver would check it (not with the relay's own signer), and
recorded with its ``webhook-id``. A verified request gets 204, unless it is the first attempt of
an event the demo chose to refuse once (503, so that the relay's retry shows); a bad signature
gets 401.

Served by uvicorn, which the console already brings: no other server to install.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from relay.tools.demo.errors import DemoError
from relay.tools.serving import served

Message = dict[str, Any]
# Checks a request's signature (secret, body, headers): returns its payload, or raises.
Verify = Callable[[str, bytes, dict[str, str]], Any]


@dataclass(frozen=True)
class Arrival:
    """One request as it arrived: at which path, its ``webhook-id``, what it was answered, when
    (``time.monotonic()``), and its payload if its signature was verified (else None)."""

    path: str
    webhook_id: str
    status: int
    at: float
    payload: Any


class Receiver:
    """An ASGI app recording what it receives; ``url`` is its base once served."""

    def __init__(self, verify: Verify) -> None:
        self.url = ""
        self._verify = verify
        self.arrivals: list[Arrival] = []
        self._secrets: dict[str, str] = {}
        self._refuse_once: set[tuple[str, str]] = set()

    def expect(self, path: str, secret: str) -> str:
        """Take requests at ``path`` signed with ``secret``; the URL to send them to."""
        self._secrets[path] = secret
        return self.url + path

    def refuse_once(self, path: str, webhook_id: str) -> None:
        """Answer the first request for ``webhook_id`` at ``path`` with 503."""
        self._refuse_once.add((path, webhook_id))

    def at(self, path: str) -> list[Arrival]:
        return [a for a in self.arrivals if a.path == path]

    def answer(self, path: str, body: bytes, headers: dict[str, str]) -> int:
        webhook_id = headers.get("webhook-id", "")
        secret = self._secrets.get(path)
        payload = None
        if secret is None:
            status = 404
        else:
            try:
                payload = self._verify(secret, body, headers)
            except Exception:  # a bad signature or timestamp, or a body that is not JSON
                status = 401
            else:
                status = 503 if (path, webhook_id) in self._refuse_once else 204
                self._refuse_once.discard((path, webhook_id))
        self.arrivals.append(Arrival(path, webhook_id, status, time.monotonic(), payload))
        return status

    async def __call__(
        self,
        scope: Message,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        status = self.answer(scope["path"], body, headers)
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _standard_webhooks() -> Verify:
    """The reference library's check, as a receiver of ours would call it."""
    try:
        from standardwebhooks import Webhook
    except ImportError as exc:
        raise DemoError(
            "the demo's webhook receivers check signatures with the standardwebhooks package, "
            "which is not installed: pip install 'outbox-relay[demo]'"
        ) from exc
    return lambda secret, body, headers: Webhook(secret).verify(body, headers)


@contextlib.asynccontextmanager
async def receiving() -> AsyncIterator[Receiver]:
    """A receiver served on a free loopback port until the block ends."""
    receiver = Receiver(_standard_webhooks())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    receiver.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with served(
        receiver,
        sock,
        "the demo's webhook receiver",
        interface="asgi3",
        lifespan="off",
        access_log=False,
    ):
        yield receiver
