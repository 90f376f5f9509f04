"""The shop's event catalog, for ``OUTBOX_CATALOG = "orders.events:catalog"`` in a test."""

from __future__ import annotations

from outbox.catalog import Catalog, EventType

catalog = Catalog(title="shop events", validate="reject")
catalog.add(
    EventType.from_schema(
        "order.created",
        {
            "type": "object",
            "properties": {"id": {"type": "integer"}},
            "required": ["id"],
            "additionalProperties": False,
        },
        destinations=["orders"],
    )
)
