"""outbox: write events in the same transaction as your business change.

    async with session.begin():
        session.add(order)
        await outbox.enqueue(session, destination="orders", key=str(order.id),
                             payload={"type": "order.created", "id": order.id})

The relay (``outbox-relay run``) delivers them afterwards, at least once, each carrying its
row id (``outbox-id`` / ``webhook-id``) so consumers can deduplicate.
"""

from outbox.enqueue import (
    EventSpec,
    Outbox,
    enqueue,
    enqueue_many,
    enqueue_many_sync,
    enqueue_sync,
)
from outbox.errors import OutboxError, OutboxValidationError
from outbox.message import DEFAULT_MAX_PAYLOAD_BYTES
from outbox.schema import (
    Status,
    define_outbox_table,
    define_paused_table,
    define_relays_table,
    metadata,
    outbox_table,
    paused_table,
    relays_table,
)

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "EventSpec",
    "Outbox",
    "OutboxError",
    "OutboxValidationError",
    "Status",
    "define_outbox_table",
    "define_paused_table",
    "define_relays_table",
    "enqueue",
    "enqueue_many",
    "enqueue_many_sync",
    "enqueue_sync",
    "metadata",
    "outbox_table",
    "paused_table",
    "relays_table",
]
