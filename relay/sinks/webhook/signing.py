"""Standard Webhooks signatures: ``v1,<base64 HMAC-SHA256 of "id.timestamp.body">``.

Signed over the body *bytes*, so binary payloads (protobuf, Avro) sign as well as JSON.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Sequence

SECRET_PREFIX = "whsec_"  # noqa: S105 - the format's prefix, not a secret
MIN_SECRET_BYTES = 24  # the Standard Webhooks specification's floor


def decode_secret(secret: str) -> bytes:
    """The HMAC key of a ``whsec_<base64>`` secret. Messages never echo the secret."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(
            "a webhook secret must look like 'whsec_<base64>' (Standard Webhooks format)"
        )
    body = secret[len(SECRET_PREFIX) :].strip()
    try:
        # Unpadded base64 is common in the wild; accept it as the reference library does.
        key = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the part of a webhook secret after 'whsec_' is not base64") from None
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(
            f"a webhook secret must encode at least {MIN_SECRET_BYTES} random bytes "
            f"(this one has {len(key)}); make one with: "
            'echo "whsec_$(openssl rand -base64 32)"'
        )
    return key


class Signer:
    """Signs with every key at once, so receivers can rotate secrets without a gap."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            raise ValueError("a signer needs at least one key")
        self._keys = tuple(keys)

    def __repr__(self) -> str:  # never the keys
        return f"Signer(<{len(self._keys)} key(s)>)"

    def sign(self, msg_id: str, timestamp: int, body: bytes) -> str:
        """The ``webhook-signature`` header value: one ``v1,…`` per key, space-separated."""
        message = f"{msg_id}.{timestamp}.".encode() + body
        return " ".join(
            "v1," + base64.b64encode(hmac.new(k, message, hashlib.sha256).digest()).decode()
            for k in self._keys
        )
