"""Endpoint secrets: generated in the Standard Webhooks format, encrypted at rest when a key is
configured.

With ``OUTBOX_ENDPOINT_SECRET_KEY`` set (one Fernet key, or several separated by commas, the
first used to encrypt: that is how the key itself is rotated), secrets are stored as ``enc:``
followed by a Fernet token (AES-128-CBC and HMAC-SHA256, from the ``cryptography`` package).
Without it they are stored as they are, and reading an encrypted one is an error that names
the variable. ``OUTBOX_ENDPOINT_SECRET_REQUIRE=1`` makes storing one unencrypted an error.
"""

from __future__ import annotations

import base64
import os
import secrets as _random
from collections.abc import Mapping
from typing import TYPE_CHECKING

from outbox.errors import OutboxError
from outbox.webhooks.signing import SECRET_PREFIX, decode_secret

if TYPE_CHECKING:
    from cryptography.fernet import Fernet, MultiFernet

KEY_VARIABLE = "OUTBOX_ENDPOINT_SECRET_KEY"
REQUIRE_VARIABLE = "OUTBOX_ENDPOINT_SECRET_REQUIRE"
SEALED_PREFIX = "enc:"
SECRET_BYTES = 32  # above the Standard Webhooks floor of 24


_YES = frozenset({"1", "true", "yes", "on"})
_NO = frozenset({"", "0", "false", "no", "off"})


class SecretEncryptionRequired(OutboxError):
    """A secret would be stored unencrypted where that is not allowed: the table holds
    encrypted secrets, or OUTBOX_ENDPOINT_SECRET_REQUIRE is set. Nothing was written."""


def is_sealed(stored: str | None) -> bool:
    """Whether a stored secret is encrypted (``enc:…``)."""
    return stored is not None and stored.startswith(SEALED_PREFIX)


def required(environ: Mapping[str, str] | None = None) -> bool:
    """OUTBOX_ENDPOINT_SECRET_REQUIRE as a yes or a no; anything else is an error, not a
    silent no (a typo must not turn the requirement off)."""
    value = (os.environ if environ is None else environ).get(REQUIRE_VARIABLE, "")
    word = value.strip().lower()
    if word in _YES:
        return True
    if word in _NO:
        return False
    raise OutboxError(
        f"{REQUIRE_VARIABLE} is {value[:40]!r}: set it to 1 (endpoint secrets must be stored "
        "encrypted) or 0 (the default: stored unencrypted when no key is set)"
    )


def generate() -> str:
    """A new ``whsec_<base64>`` secret of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(_random.token_bytes(SECRET_BYTES)).decode()


def check(secret: str) -> str:
    """``secret`` if it is a usable Standard Webhooks secret, else OutboxError saying why."""
    try:
        decode_secret(secret)
    except ValueError as exc:
        raise OutboxError(str(exc)) from None
    return secret


class SecretBox:
    """Seals and opens stored secrets with the configured keys (none: stored as given, unless
    ``required``)."""

    def __init__(self, keys: str | None, *, required: bool = False) -> None:
        self._fernet: MultiFernet | None = None
        self._first: Fernet | None = None
        self.required = required
        if keys and keys.strip():
            from cryptography.fernet import Fernet, MultiFernet

            try:
                each = [Fernet(k.strip().encode()) for k in keys.split(",") if k.strip()]
                self._fernet, self._first = MultiFernet(each), each[0]
            except ValueError:
                raise OutboxError(
                    f"{KEY_VARIABLE} is not a Fernet key (32 url-safe base64-encoded bytes); "
                    "make one with: python -c 'from cryptography.fernet import Fernet; "
                    "print(Fernet.generate_key().decode())'"
                ) from None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> SecretBox:
        env = os.environ if environ is None else environ
        return cls(env.get(KEY_VARIABLE), required=required(env))

    @property
    def encrypts(self) -> bool:
        return self._fernet is not None

    def __repr__(self) -> str:  # never the keys
        return f"SecretBox(encrypts={self.encrypts}, required={self.required})"

    def check_required(self) -> None:
        """SecretEncryptionRequired if secrets must be encrypted and there is no key here."""
        if self.required and self._fernet is None:
            raise SecretEncryptionRequired(
                f"{REQUIRE_VARIABLE} is set, so endpoint secrets are stored encrypted only, "
                f"but {KEY_VARIABLE} is not set here: set it to the key the application and "
                "the relays use"
            )

    def seal(self, secret: str) -> str:
        """The secret as it is stored: encrypted under the first key, or as it is when there
        is no key (SecretEncryptionRequired if that is not allowed)."""
        if self._fernet is None:
            self.check_required()
            return secret
        return SEALED_PREFIX + self._fernet.encrypt(secret.encode()).decode()

    def is_current(self, stored: str) -> bool:
        """Whether ``stored`` is encrypted under the first key (re-encrypting it would change
        nothing)."""
        if self._first is None or not is_sealed(stored):
            return False
        from cryptography.fernet import InvalidToken

        try:
            self._first.decrypt(stored[len(SEALED_PREFIX) :].encode())
        except InvalidToken:
            return False
        return True

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


def downgrade_refused(table: str) -> SecretEncryptionRequired:
    """What a writer without the key hears where the secrets are encrypted."""
    return SecretEncryptionRequired(
        f"the endpoint secrets in {table} are encrypted, but {KEY_VARIABLE} is not set here: "
        "refusing to store this one unencrypted beside them (nothing was changed). Set "
        f"{KEY_VARIABLE} to the key the application and the relays use, and run it again"
    )


def warn_unencrypted(endpoint_id: int, destination: str, table: str) -> None:
    """The warning event of a secret just stored unencrypted."""
    from outbox.logs import early_logger

    # An application that set up structlog gets the event in its logs; one that did not gets
    # it on stderr, never mixed into its stdout.
    early_logger("outbox").warning(
        "outbox.endpoints.secret_unencrypted",
        endpoint_id=endpoint_id,
        destination=destination,
        table=table,
        action=f"set {KEY_VARIABLE} (a Fernet key, the same for the application and the "
        "relays) to store secrets encrypted, then run `outbox-relay endpoints reencrypt`; "
        f"{REQUIRE_VARIABLE}=1 refuses unencrypted secrets",
    )
