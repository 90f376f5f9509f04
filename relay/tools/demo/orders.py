"""The demo's application: each order and its three events (to Kafka, to a webhook, to the
tenant's endpoints) written in one transaction, and one transaction that rolls back."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import outbox
from outbox.dburl import to_sqlalchemy_async_url
from outbox.sql import load
from outbox.writer import EventSpec

# The statements' text is in orders.sql beside this module, run through SQLAlchemy's text(),
# which binds :name itself.
_q = load("relay.tools.demo", "orders.sql", binds="named")

ORDERS = _q["orders"]
INSERT_ORDER = _q["insert_order"]
INSERT_ROLLED_BACK_ORDER = _q["insert_rolled_back_order"]

# The demo's destinations, one of each kind.
KAFKA = "orders"
WEBHOOK = "billing"
ENDPOINTS = "customer-events"
# The customers, each a tenant with an endpoint of its own; orders alternate between them.
TENANTS = ("acme", "globex")
EVENT_TYPE = "order.created"


@dataclass(frozen=True)
class Placed:
    """The committed events' outbox ids, by destination (the endpoints' by tenant)."""

    kafka: list[int]
    webhook: list[int]
    endpoints: dict[str, list[int]]

    @property
    def total(self) -> int:
        return len(self.kafka) + len(self.webhook) + sum(map(len, self.endpoints.values()))


# The Kafka header naming the demo run (its scratch database) that wrote a message: a broker of
# one's own keeps earlier runs' messages on the topic, with the same outbox ids.
RUN_HEADER = "demo-run"


def events(order_id: int, tenant: str, total: Decimal, run: str) -> list[EventSpec]:
    """An order's events: the same fact for the three uses."""
    payload = {"type": EVENT_TYPE, "order_id": order_id, "total": str(total)}
    return [
        {
            "destination": KAFKA,
            "key": str(order_id),
            "payload": payload,
            "headers": {"event-type": EVENT_TYPE, RUN_HEADER: run},
        },
        {"destination": WEBHOOK, "key": str(order_id), "payload": payload},
        {
            "destination": ENDPOINTS,
            "payload": {**payload, "customer": tenant},
            # Which endpoints receive it: those of its tenant that take its type.
            "tenant": tenant,
            "event_type": EVENT_TYPE,
        },
    ]


async def place_orders(db_url: str, count: int, run: str) -> Placed:
    """``count`` orders, each with its events in the same transaction, then one more whose
    transaction fails after enqueueing: neither the order nor its events survive. ``run``
    names this run in the Kafka events' headers."""
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    placed = Placed([], [], {t: [] for t in TENANTS})
    try:
        async with engine.begin() as conn:
            await conn.execute(text(ORDERS))
        for i in range(count):
            tenant = TENANTS[i % len(TENANTS)]
            total = Decimal(10 + i) + Decimal("0.99")
            async with AsyncSession(engine) as session, session.begin():
                insert = await session.execute(text(INSERT_ORDER), {"c": tenant, "t": total})
                order_id = insert.scalar_one()
                to_kafka, to_webhook, to_endpoints = await outbox.enqueue_many(
                    session, events(order_id, tenant, total, run)
                )
            placed.kafka.append(to_kafka)
            placed.webhook.append(to_webhook)
            placed.endpoints[tenant].append(to_endpoints)
        with contextlib.suppress(RuntimeError):
            async with AsyncSession(engine) as session, session.begin():
                await session.execute(text(INSERT_ROLLED_BACK_ORDER))
                await outbox.enqueue_many(session, events(0, TENANTS[0], Decimal(1), run))
                raise RuntimeError("payment declined")
    finally:
        await engine.dispose()
    return placed
