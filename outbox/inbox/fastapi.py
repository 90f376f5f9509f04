"""A FastAPI dependency that receives a webhook once: verified, marked, and committed before
the response leaves.

    from outbox.inbox.fastapi import verified_webhook
    from outbox.inbox.webhooks import ReceivedWebhook

    OrderHook = Annotated[
        ReceivedWebhook,
        verified_webhook(sessions, consumer="billing", secrets=[os.environ["ORDERS_SECRET"]]),
    ]

    @app.post("/hooks/orders")
    async def on_order(hook: OrderHook) -> dict[str, bool]:
        if hook.new:
            hook.db.add(Invoice(order_id=hook.json()["id"]))  # the same transaction
        return {"duplicate": hook.duplicate}

The dependency opens the transaction, marks ``webhook-id`` in it, and hands the request to the
endpoint with ``hook.db`` (an ``AsyncSession``, ``AsyncConnection`` or asyncpg
``Connection``, after ``db``). The transaction commits after the endpoint returns and before
FastAPI sends the response (``scope="function"``): a 2xx is only ever sent for a committed
effect, and an endpoint that raises rolls the mark back, so the sender's retry applies it. An
endpoint that caught a database error and returned left a transaction PostgreSQL would roll
back at COMMIT: that is answered 500 too (``TransactionAborted``), and logged.
A request that fails verification is answered 400 or 401 before any database work.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Depends, HTTPException, Request

from outbox.errors import OutboxError
from outbox.inbox._db import (
    Database,
    TransactionAborted,
    check_database,
    ensure_committable,
    is_one_connection,
    transaction,
)
from outbox.inbox._store import Inbox
from outbox.inbox.webhooks import (
    DEFAULT_TOLERANCE,
    ReceivedWebhook,
    RetryLater,
    WebhookReceiver,
    WebhookRejected,
)

WEBHOOK_HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")
DEFAULT_MAX_BODY_BYTES = 1024 * 1024


async def _bounded_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise HTTPException(413, f"body over {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPException(413, f"body over {limit} bytes")
    return bytes(body)


def verified_webhook(
    db: Database,
    *,
    consumer: str,
    secrets: str | Sequence[str],
    tolerance: float = DEFAULT_TOLERANCE,
    inbox: Inbox | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> Any:
    """A ``Depends(...)`` giving the endpoint a :class:`ReceivedWebhook` in an open
    transaction of ``db`` (an ``AsyncEngine``, ``async_sessionmaker``, asyncpg ``Pool``).

    The mark commits unless the endpoint **raises**: an endpoint that cannot apply the event
    now must raise (``hook.retry_later()`` raises a 503), never return an error response,
    which would commit the mark without the effect and turn the sender's retry into a
    duplicate."""
    receiver = WebhookReceiver(consumer=consumer, secrets=secrets, tolerance=tolerance, inbox=inbox)
    check_database(db)
    if is_one_connection(db):
        raise TypeError(
            "verified_webhook serves concurrent requests, and one asyncpg Connection runs one "
            "transaction at a time: pass an asyncpg Pool (or an AsyncEngine, async_sessionmaker)"
        )

    async def received_webhook(request: Request) -> AsyncIterator[ReceivedWebhook]:
        # Nothing is read from a request that cannot be a webhook, and never more than
        # max_body_bytes: an unauthenticated client must not make the receiver buffer more.
        missing = [h for h in WEBHOOK_HEADERS if h not in request.headers]
        if missing:
            raise HTTPException(400, f"not a webhook: no {', '.join(missing)} header")
        body = await _bounded_body(request, max_body_bytes)
        try:
            verified = receiver.verify(request.headers, body)
        except WebhookRejected as exc:
            raise HTTPException(exc.status_code, exc.answer) from None
        try:
            async with transaction(db) as tx:
                hook = await receiver.mark(tx, verified)
                yield hook
                if hook.new:  # a duplicate's effect committed before: nothing at stake
                    await ensure_committable(
                        tx, consumer=receiver.consumer, event_id=hook.id, source="webhook"
                    )
        except RetryLater as exc:  # rolled back by the transaction; the sender retries
            raise HTTPException(503, str(exc), headers={"retry-after": "5"}) from None
        except TransactionAborted as exc:  # rolled back, logged; the sender retries
            raise HTTPException(exc.status_code, exc.answer) from None

    try:
        # Ended before the response is sent: the commit happens first.
        return Depends(received_webhook, scope="function")
    except TypeError:  # pragma: no cover - FastAPI before 0.121 has no scope
        raise OutboxError(
            "verified_webhook needs FastAPI 0.121 or later (Depends(scope='function')), "
            "so that the mark commits before the response is sent"
        ) from None
