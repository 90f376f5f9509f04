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

    __slots__ = ("_macs",)

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            raise ValueError("a signer needs at least one key")
        # Keyed once: each signature copies a keyed HMAC instead of hashing the key again.
        self._macs = tuple(hmac.new(k, digestmod=hashlib.sha256) for k in keys)

    def __repr__(self) -> str:  # never the keys
        return f"Signer(<{len(self._macs)} key(s)>)"

    def sign(self, msg_id: str, timestamp: int, body: bytes) -> str:
        """The ``webhook-signature`` header value: one ``v1,…`` per key, space-separated."""
        head = f"{msg_id}.{timestamp}.".encode()
        signatures = []
        for keyed in self._macs:
            mac = keyed.copy()
            mac.update(head)
            mac.update(body)
            signatures.append("v1," + base64.b64encode(mac.digest()).decode())
        return " ".join(signatures)
