"""Shared bits for the webhook tests: secrets, destinations, envelopes, an independent verifier."""

from __future__ import annotations

import atexit
import base64
import hashlib
import hmac
import itertools
import os
import socket
import time
from typing import Any

from standardwebhooks import Webhook

from relay.model import Envelope, Lease
from relay.sinks.webhook.config import WebhookDestination


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


SECRET = new_secret()
_ids = itertools.count(1000)


def dest(url: str, **kw: Any) -> WebhookDestination:
    """A webhook destination for the loopback receiver (private networks allowed)."""
    kw.setdefault("secrets", [SECRET])
    kw.setdefault("allow_private_networks", True)
    return WebhookDestination.model_validate({"kind": "webhook", "url": url, **kw})


def envelope(
    destination: str = "hook",
    payload: bytes = b'{"type":"order.created","id":1}',
    *,
    id: int | None = None,
    headers: dict[str, str] | None = None,
    attempts: int = 0,
    content_type: str = "application/json",
) -> Envelope:
    return Envelope(
        id=id if id is not None else next(_ids),
        destination=destination,
        key=None,
        payload=payload,
        content_type=content_type,
        headers=headers or {},
        attempts=attempts,
        created=time.time(),
        token=1,
        lease=Lease(time.monotonic() + 3600),
    )


def verify(secret: str, body: bytes, headers: dict[str, str]) -> None:
    """Check a request's signature with the reference library, not with the relay's signer."""
    Webhook(secret).verify(body, headers, json_parse=False)


def verify_bytes(secret: str, body: bytes, headers: dict[str, str], tolerance: float = 300) -> None:
    """Check a signature over any body, text or not, by the Standard Webhooks spec itself
    (the reference library takes text bodies only): base64 HMAC-SHA256 of
    ``{webhook-id}.{webhook-timestamp}.{body}`` under the secret's key, as one of the
    space-separated ``v1,…`` signatures, with a timestamp within ``tolerance`` seconds."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    offered = headers["webhook-signature"].split(" ")
    assert any(hmac.compare_digest(expected, sig) for sig in offered), "bad signature"
    assert abs(time.time() - int(headers["webhook-timestamp"])) <= tolerance, "stale timestamp"


_RESERVED: list[socket.socket] = []
atexit.register(lambda: [s.close() for s in _RESERVED])


def closed_port() -> int:
    """A loopback port nothing listens on: connecting to it is refused at once. Its socket
    stays bound, not listening, until the tests end: a port merely freed was handed again to
    the next server bound to port 0 (a relay's own HTTP listener, which answered 404 where
    the test expected a refusal and an open circuit)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _RESERVED.append(s)
    return int(s.getsockname()[1])


def open_port(port: int) -> int:
    """Let go of a port closed_port() holds, for a server the test starts on it now."""
    for s in [s for s in _RESERVED if s.getsockname()[1] == port]:
        _RESERVED.remove(s)
        s.close()
    return port
