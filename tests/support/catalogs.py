"""An event catalog for the console's and the portal's tests: three types over a Kafka
destination, an endpoints destination (tests/support/portal.py's) and a webhook, with text
that a page must escape, written as the export a relay reads (``catalog export``)."""

from __future__ import annotations

import json
from pathlib import Path

from outbox.catalog import Catalog, EventType

ENDPOINTS = "customer-events"
KAFKA = "orders"
WEBHOOK = "hooks"
# What a page must show as text, never run or let reorder the line.
HOSTILE = "<script>alert('x')</script>\u202e"

CONFIG = f"""
database_url = "postgresql://root@127.0.0.1/none"
[kafka]
bootstrap_servers = ["kafka.internal:9092"]
[destinations.{KAFKA}]
kind = "kafka"
topic = "orders-topic"
[destinations.{ENDPOINTS}]
kind = "endpoints"
[destinations.{WEBHOOK}]
kind = "webhook"
url = "https://hooks.example.com/in?token=never-shown"
secret_env = "CATALOG_VIEW_TEST_SECRET"
"""


def shop_catalog() -> Catalog:
    """order.created on Kafka and the endpoints, invoice.paid (deprecated) on the endpoints
    and the webhook, stock.moved on Kafka only."""
    catalog = Catalog(title="shop events", version="7", validate="warn")
    order = {
        "type": "object",
        "properties": {"order_id": {"type": "integer"}, "note": {"type": "string"}},
        "required": ["order_id"],
        "description": f"An order {HOSTILE}",
    }
    catalog.add(
        EventType.from_schema(
            "order.created",
            order,
            version=3,
            destinations=[KAFKA, ENDPOINTS],
            key="the order id",
            description=f"An order was placed {HOSTILE}",
            examples=[{"order_id": 1, "note": "</pre><b>bold</b>"}],
        )
    )
    invoice = {"type": "object", "properties": {"invoice_id": {"type": "integer"}}}
    catalog.add(
        EventType.from_schema(
            "invoice.paid",
            invoice,
            destinations=[ENDPOINTS, WEBHOOK],
            deprecated=True,
            validate="reject",
            description="An invoice was paid.",
        )
    )
    stock = {"type": "object", "properties": {"sku": {"type": "string"}}}
    catalog.add(
        EventType.from_schema(
            "stock.moved", stock, destinations=[KAFKA], description="Internal: stock moved."
        )
    )
    return catalog


def write_export(folder: Path) -> str:
    """The catalog's export in ``folder``; its spec (a .json path)."""
    path = folder / "catalog.json"
    path.write_text(json.dumps(shop_catalog().export(), indent=2, sort_keys=True))
    return str(path)
