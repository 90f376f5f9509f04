"""Receiving webhooks once: verify the Standard Webhooks signature, then mark ``webhook-id`` in
the receiver's transaction. For any framework: headers, the raw body and a connection in.

    try:
        hook = await verify_and_mark(
            conn, consumer="billing", headers=request.headers, body=raw_body, secrets=SECRETS
        )
    except WebhookRejected as exc:
        return Response(exc.answer, status_code=exc.status_code)  # 400, or 401: bad or stale
    if hook.new:
        ...  # apply the effect with `conn`, in the same transaction
    await hook.check_committable()  # raises if a statement failed: PostgreSQL would roll back
    return Response(status_code=200)  # a duplicate is answered 200 too: the sender stops

Our own verification rather than the reference library's (``standardwebhooks``), which the
tests use to check the relay: that one reads the body as text (a binary payload fails with a
UnicodeDecodeError), takes one secret, has a fixed tolerance, and raises ValueError or
binascii.Error on a malformed signature header instead of its verification error.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from outbox.errors import OutboxError, OutboxValidationError
from outbox.inbox._db import aborted, committable_problem, committable_problem_sync
from outbox.inbox._store import AsyncTarget, Inbox, SyncTarget, _default, check_consumer
from outbox.inbox._store import check_event_id as _check_id
from outbox.webhooks.signing import decode_secret

DEFAULT_TOLERANCE = 300.0  # seconds, either way: the Standard Webhooks recommendation
_TIMESTAMP = re.compile(r"[0-9]{1,12}")  # Unix seconds, as the specification sends them


class WebhookRejected(OutboxError):
    """A request that is not a valid webhook: answer ``status_code``, change nothing.

    ``reason`` says why, for the log; ``answer`` is what a response may say (a malformed
    request is told what is wrong with it, a forged or replayed one only that it failed).
    """

    status_code = 400

    @property
    def answer(self) -> str:
        return self.reason

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class MalformedWebhook(WebhookRejected):
    """A Standard Webhooks header is missing or unreadable (400)."""

    status_code = 400


class BadSignature(WebhookRejected):
    """No signature matches any of the secrets (401)."""

    status_code = 401

    @property
    def answer(self) -> str:
        return "invalid webhook signature"


class StaleTimestamp(WebhookRejected):
    """Signed correctly, but ``webhook-timestamp`` is outside the tolerance (401): a replayed
    request, or a clock far off. The relay signs every attempt afresh, so a retry passes once
    the clocks agree."""

    status_code = 401

    @property
    def answer(self) -> str:
        return "webhook-timestamp outside the tolerance"


@dataclass(frozen=True, slots=True)
class VerifiedWebhook:
    """A request whose signature and timestamp were checked."""

    id: str  # webhook-id: the outbox row id, the same on every redelivery
    timestamp: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True, slots=True)
class ReceivedWebhook(VerifiedWebhook):
    """A verified request, marked in ``db``'s transaction.

    ``new``: apply the effect with ``db``, in that transaction. Otherwise (``duplicate``) it
    was applied before: answer 2xx without applying it again.
    """

    new: bool
    db: Any  # the session or connection the mark was written with
    consumer: str = ""  # whose mark it is (for the log of a transaction that cannot commit)

    @property
    def duplicate(self) -> bool:
        return not self.new

    async def check_committable(self) -> None:
        """Raise ``TransactionAborted`` (``status_code`` 500, logged as
        ``inbox.handler.aborted``) if the transaction of the mark can no longer commit.

        Call it last in the transaction, before answering: a statement that failed in it
        (an error the code caught) makes PostgreSQL answer its COMMIT with ROLLBACK,
        without an error, and a 2xx would then acknowledge an event neither applied nor
        sent again. Raising rolls back, and the sender's retry applies it. One round trip;
        nothing for a duplicate, whose effect committed before."""
        if self.new:
            problem = await committable_problem(self.db)
            if problem is not None:
                raise aborted(self.consumer, self.id, problem, source="webhook")

    def check_committable_sync(self) -> None:
        """:meth:`check_committable` for a SQLAlchemy ``Session`` or ``Connection``."""
        if self.new:
            problem = committable_problem_sync(self.db)
            if problem is not None:
                raise aborted(self.consumer, self.id, problem, source="webhook")

    def retry_later(self, reason: str = "not applied now; send it again later") -> NoReturn:
        """Refuse the event for now: raises, so the transaction (and the mark) rolls back and
        the sender's retry applies it. Answering an error without raising would commit the
        mark alone."""
        raise RetryLater(reason)


class RetryLater(OutboxError):
    """Raised by :meth:`ReceivedWebhook.retry_later`; frameworks answer it 503."""

    status_code = 503


def _key(secret: object) -> bytes:
    if not isinstance(secret, str):
        raise TypeError(f"a webhook secret is a 'whsec_…' str, got {type(secret).__name__}")
    # The relay's own reading of the format, so what it signs with, this verifies with.
    try:
        return decode_secret(secret)
    except ValueError as exc:
        raise OutboxError(str(exc)) from None


class WebhookReceiver:
    """One receiving endpoint: its consumer name, its secrets and tolerance, its inbox.

    ``secrets``: every secret a valid request may be signed with; during a rotation, the new
    and the old one. A request passes when any of its ``v1,`` signatures matches any secret.
    Secrets are checked here, at set-up, not at the first request.
    """

    def __init__(
        self,
        *,
        consumer: str,
        secrets: str | Sequence[str],
        tolerance: float = DEFAULT_TOLERANCE,
        inbox: Inbox | None = None,
    ) -> None:
        self.consumer = check_consumer(consumer)
        listed = [secrets] if isinstance(secrets, str) else list(secrets)
        if not listed:
            raise OutboxValidationError("secrets", "give at least one 'whsec_…' secret")
        self._keys = tuple(_key(s) for s in listed)
        if (
            not isinstance(tolerance, int | float)
            or isinstance(tolerance, bool)
            or not (math.isfinite(tolerance) and tolerance > 0)
        ):
            raise OutboxValidationError("tolerance", "must be a positive number of seconds")
        self.tolerance = float(tolerance)
        self.inbox = inbox or _default

    def __repr__(self) -> str:  # never the secrets
        return f"WebhookReceiver(consumer={self.consumer!r}, <{len(self._keys)} secret(s)>)"

    def verify(
        self, headers: Mapping[str, str], body: bytes, *, now: float | None = None
    ) -> VerifiedWebhook:
        """Check the request's signature and timestamp; raise a ``WebhookRejected`` if not."""
        if not isinstance(body, bytes | bytearray | memoryview):
            raise TypeError("body must be the raw request body, as bytes")
        got = {k.lower(): v for k, v in headers.items()}
        names = ("webhook-id", "webhook-timestamp", "webhook-signature")
        missing = [n for n in names if not got.get(n)]
        if missing:
            raise MalformedWebhook(f"missing header(s): {', '.join(missing)}")
        msg_id, stamp, signatures = (got[n] for n in names)
        try:
            msg_id = _check_id(msg_id, "webhook-id")
        except OutboxValidationError as exc:
            raise MalformedWebhook(str(exc)) from None
        if not _TIMESTAMP.fullmatch(stamp):
            raise MalformedWebhook("webhook-timestamp is not a Unix time in seconds")
        raw = bytes(body)
        signed = f"{msg_id}.{stamp}.".encode() + raw
        expected = [
            base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()) for key in self._keys
        ]
        offered = [
            s[3:].encode("utf-8", "replace") for s in signatures.split() if s.startswith("v1,")
        ]
        # Every comparison is made (no early exit), each in constant time.
        matched = False
        for want in expected:
            for sig in offered:
                matched |= hmac.compare_digest(want, sig)
        if not matched:
            raise BadSignature(f"no v1 signature matches any of the {len(self._keys)} secret(s)")
        when = int(stamp)
        skew = (time.time() if now is None else now) - when
        if abs(skew) > self.tolerance:
            side = "old" if skew > 0 else "in the future"
            raise StaleTimestamp(
                f"webhook-timestamp is {abs(skew):.0f} s {side}, beyond the tolerance of "
                f"{self.tolerance:g} s"
            )
        return VerifiedWebhook(msg_id, when, raw)

    async def mark(self, conn: AsyncTarget, hook: VerifiedWebhook) -> ReceivedWebhook:
        """Mark a verified request in ``conn``'s open transaction."""
        new = await self.inbox.mark(conn, consumer=self.consumer, event_id=hook.id)
        return ReceivedWebhook(
            hook.id, hook.timestamp, hook.body, new=new, db=conn, consumer=self.consumer
        )

    def mark_sync(self, conn: SyncTarget, hook: VerifiedWebhook) -> ReceivedWebhook:
        new = self.inbox.mark_sync(conn, consumer=self.consumer, event_id=hook.id)
        return ReceivedWebhook(
            hook.id, hook.timestamp, hook.body, new=new, db=conn, consumer=self.consumer
        )

    async def verify_and_mark(
        self, conn: AsyncTarget, headers: Mapping[str, str], body: bytes
    ) -> ReceivedWebhook:
        return await self.mark(conn, self.verify(headers, body))

    def verify_and_mark_sync(
        self, conn: SyncTarget, headers: Mapping[str, str], body: bytes
    ) -> ReceivedWebhook:
        return self.mark_sync(conn, self.verify(headers, body))


async def verify_and_mark(
    conn: AsyncTarget,
    *,
    consumer: str,
    headers: Mapping[str, str],
    body: bytes,
    secrets: str | Sequence[str],
    tolerance: float = DEFAULT_TOLERANCE,
    inbox: Inbox | None = None,
) -> ReceivedWebhook:
    """Verify a Standard Webhooks request and mark its ``webhook-id`` in ``conn``'s open
    transaction (SQLAlchemy ``AsyncSession``/``AsyncConnection``, asyncpg ``Connection``).

    Raises ``WebhookRejected`` (``status_code`` 400 or 401) before touching the database when
    the request is malformed, signed with none of ``secrets``, or stamped more than
    ``tolerance`` seconds away from now. Otherwise returns the request with ``new``: apply
    the effect with ``conn`` when it is True; answer 2xx either way.
    """
    receiver = WebhookReceiver(consumer=consumer, secrets=secrets, tolerance=tolerance, inbox=inbox)
    return await receiver.verify_and_mark(conn, headers, body)


def verify_and_mark_sync(
    conn: SyncTarget,
    *,
    consumer: str,
    headers: Mapping[str, str],
    body: bytes,
    secrets: str | Sequence[str],
    tolerance: float = DEFAULT_TOLERANCE,
    inbox: Inbox | None = None,
) -> ReceivedWebhook:
    """``verify_and_mark`` for a SQLAlchemy ``Session`` or ``Connection``."""
    receiver = WebhookReceiver(consumer=consumer, secrets=secrets, tolerance=tolerance, inbox=inbox)
    return receiver.verify_and_mark_sync(conn, headers, body)
