"""Typed events: declared once, checked at ``enqueue``, exported for the relay's documents.

    from outbox.catalog import Catalog

    catalog = Catalog(title="shop events", validate="reject")

    @catalog.event("order.created", version=3, destinations=["orders"], key="the order id")
    class OrderCreated(BaseModel):
        order_id: int

    outbox.catalog.use(catalog)  # or Outbox(catalog=catalog), or Django's OUTBOX_CATALOG

Validation needs jsonschema-rs (``pip install 'outbox-relay[catalog]'``), loaded on a type's
first checked event. Where it is installed it also checks each schema as it is declared or
loaded; declaring examples needs it whatever the mode (each is checked against its schema:
consumers copy them). A catalog whose types are all ``off`` and declare no example runs
without it.
"""

from __future__ import annotations

from outbox.catalog.catalog import Catalog, Unknown
from outbox.catalog.loading import load_catalog
from outbox.catalog.types import EventType, Mode
from outbox.errors import CatalogError, EventSchemaError

__all__ = [
    "Catalog",
    "CatalogError",
    "EventSchemaError",
    "EventType",
    "Mode",
    "Unknown",
    "load_catalog",
    "use",
]


def use(catalog: Catalog | None) -> None:
    """Check the events of the module-level ``outbox.enqueue`` functions against ``catalog``
    (``None``: no longer). Call it once at start; ``Outbox`` instances keep their own."""
    if catalog is not None and not isinstance(catalog, Catalog):
        raise TypeError(f"use takes a Catalog or None, got {type(catalog).__name__}")
    from outbox import writer

    writer._default.catalog = catalog
