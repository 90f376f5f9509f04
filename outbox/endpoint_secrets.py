"""Endpoint secrets: generated in the Standard Webhooks format, encrypted at rest when a key is
configured.

With ``OUTBOX_ENDPOINT_SECRET_KEY`` set (one Fernet key, or several separated by commas, the
first used to encrypt: that is how the key itself is rotated), secrets are stored as ``enc:``
followed by a Fernet token (AES-128-CBC and HMAC-SHA256, from the ``cryptography`` package).
Without it they are stored as they are, and reading an encrypted one is an error that names
the variable.
"""

from __future__ import annotations

import base64
import os
import secrets as _random
from collections.abc import Mapping

from outbox.errors import OutboxError

KEY_VARIABLE = "OUTBOX_ENDPOINT_SECRET_KEY"
SECRET_PREFIX = "whsec_"  # noqa: S105 - the format's prefix, not a secret
SEALED_PREFIX = "enc:"
SECRET_BYTES = 32  # above the Standard Webhooks floor of 24


def generate() -> str:
    """A new ``whsec_<base64>`` secret of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(_random.token_bytes(SECRET_BYTES)).decode()


def check(secret: str) -> str:
    """``secret`` if it is a usable Standard Webhooks secret, else OutboxError saying why."""
    from relay.sinks.webhook.signing import decode_secret  # the relay's own reading of it

    try:
        decode_secret(secret)
    except ValueError as exc:
        raise OutboxError(str(exc)) from None
    return secret


class SecretBox:
    """Seals and opens stored secrets with the configured keys (none: stored as given)."""

    def __init__(self, keys: str | None) -> None:
        self._fernet = None
        if keys and keys.strip():
            from cryptography.fernet import Fernet, MultiFernet

            try:
                self._fernet = MultiFernet(
                    [Fernet(k.strip().encode()) for k in keys.split(",") if k.strip()]
                )
            except ValueError:
                raise OutboxError(
                    f"{KEY_VARIABLE} is not a Fernet key (32 url-safe base64-encoded bytes); "
                    "make one with: python -c 'from cryptography.fernet import Fernet; "
                    "print(Fernet.generate_key().decode())'"
                ) from None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> SecretBox:
        return cls((os.environ if environ is None else environ).get(KEY_VARIABLE))

    @property
    def encrypts(self) -> bool:
        return self._fernet is not None

    def __repr__(self) -> str:  # never the keys
        return f"SecretBox(encrypts={self.encrypts})"

    def seal(self, secret: str) -> str:
        if self._fernet is None:
            return secret
        return SEALED_PREFIX + self._fernet.encrypt(secret.encode()).decode()

    def open(self, stored: str) -> str:
        if not stored.startswith(SEALED_PREFIX):
            return stored
        if self._fernet is None:
            raise OutboxError(
                f"this endpoint's secret is encrypted, but {KEY_VARIABLE} is not set here; "
                "set it to the key the secrets were encrypted with"
            )
        from cryptography.fernet import InvalidToken

        try:
            return self._fernet.decrypt(stored[len(SEALED_PREFIX) :].encode()).decode()
        except InvalidToken:
            raise OutboxError(
                f"this endpoint's secret cannot be decrypted with {KEY_VARIABLE}: the key "
                "differs from the one it was encrypted with (list every key still in use, "
                "comma-separated, newest first)"
            ) from None
