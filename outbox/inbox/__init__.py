"""The consumer's inbox: apply each event once, although it is delivered at least once.

    async with session.begin():
        if await outbox.inbox.mark(session, consumer="billing", event_id=outbox_id):
            session.add(Invoice(...))  # the effect, in the same transaction as the mark

``mark`` records (consumer, event id) in the caller's open transaction with ``INSERT … ON
CONFLICT DO NOTHING RETURNING`` and says whether the event is new. The mark and the effect
commit together, so a redelivery (a relay or consumer crash, a Kafka rebalance, a webhook
retry) finds the mark and changes nothing, and a crash before the commit leaves neither.

Helpers built on it: ``outbox.inbox.kafka`` (aiokafka consumers, offsets committed after the
database), ``outbox.inbox.webhooks`` (Standard Webhooks verification and marking, for any
framework), ``outbox.inbox.fastapi`` (a dependency). The table is ``outbox_inbox``
(migration 0008); ``purge_inbox`` keeps it to a retention window. Guide: docs/consumers.md.
"""

from __future__ import annotations

from outbox.inbox._db import TransactionAborted
from outbox.inbox._store import (
    MAX_CONSUMER_BYTES,
    MAX_EVENT_ID_BYTES,
    Inbox,
    mark,
    mark_sync,
    purge_inbox,
    purge_inbox_sync,
)
from outbox.inbox.webhooks import (
    BadSignature,
    MalformedWebhook,
    ReceivedWebhook,
    StaleTimestamp,
    WebhookReceiver,
    WebhookRejected,
    verify_and_mark,
    verify_and_mark_sync,
)

__all__ = [
    "MAX_CONSUMER_BYTES",
    "MAX_EVENT_ID_BYTES",
    "BadSignature",
    "Inbox",
    "MalformedWebhook",
    "ReceivedWebhook",
    "StaleTimestamp",
    "TransactionAborted",
    "WebhookReceiver",
    "WebhookRejected",
    "mark",
    "mark_sync",
    "purge_inbox",
    "purge_inbox_sync",
    "verify_and_mark",
    "verify_and_mark_sync",
]
