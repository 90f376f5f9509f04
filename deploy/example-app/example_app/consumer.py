"""A consumer of the service's own ``order.created`` events: each customer's order count and
total, with every event applied once although Kafka may deliver it more than once.

    APP_DATABASE_URL=postgresql://app@127.0.0.1/app APP_KAFKA_BOOTSTRAP_SERVERS=kafka:9092 \\
        python -m example_app.consumer

Adding to a total is not idempotent: an event delivered twice (a relay that crashed between
sending and recording, this consumer restarting before its offsets were committed) would count
twice. ``outbox.inbox.kafka`` marks each event's ``outbox-id`` in the transaction that adds it
and commits the Kafka offsets after that transaction, so each order counts once. The
``outbox_inbox`` table comes from ``outbox-relay migrate``, like the outbox table.
"""

from __future__ import annotations

import asyncio
import json
import os
from decimal import Decimal
from typing import Any

from aiokafka import AIOKafkaConsumer
from sqlalchemy import Integer, Numeric, Text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from example_app.main import DATABASE_URL_ENV, ORDER_CREATED, database_url
from outbox.inbox.kafka import KafkaInbox

BOOTSTRAP_ENV = "APP_KAFKA_BOOTSTRAP_SERVERS"
TOPIC_ENV = "APP_ORDERS_TOPIC"  # the topic the relay maps the `orders` destination to
# What this process reads (the web service's are main.ENV_VARS).
ENV_VARS = (DATABASE_URL_ENV, BOOTSTRAP_ENV, TOPIC_ENV)

# The consumer group, and this consumer's name in the inbox.
NAME = "order-stats"


class Base(DeclarativeBase):
    pass


class CustomerStats(Base):
    __tablename__ = "customer_stats"

    customer: Mapped[str] = mapped_column(Text, primary_key=True)
    orders: Mapped[int] = mapped_column(Integer)
    total: Mapped[Decimal] = mapped_column(Numeric(14, 2))


async def count_order(record: Any, session: AsyncSession) -> None:
    """The effect of one event, in the transaction that marked it (the inbox runs this only
    for events it has not seen)."""
    event = json.loads(record.value)
    if event.get("type") != ORDER_CREATED:
        return
    add = insert(CustomerStats).values(
        customer=event["customer"], orders=1, total=Decimal(event["total"])
    )
    await session.execute(
        add.on_conflict_do_update(
            index_elements=[CustomerStats.customer],
            set_={
                "orders": CustomerStats.orders + 1,
                "total": CustomerStats.total + add.excluded.total,
            },
        )
    )


async def create_tables(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)


def order_stats(
    consumer: AIOKafkaConsumer, sessions: async_sessionmaker[AsyncSession]
) -> KafkaInbox:
    return KafkaInbox(consumer, sessions, count_order, name=NAME)


async def main() -> None:
    engine = create_async_engine(database_url(), pool_size=2)
    await create_tables(engine)
    consumer = AIOKafkaConsumer(
        os.environ.get(TOPIC_ENV, "orders"),
        bootstrap_servers=os.environ[BOOTSTRAP_ENV],
        group_id=NAME,
        enable_auto_commit=False,  # offsets are committed after the database, by the inbox
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        await order_stats(consumer, async_sessionmaker(engine)).run()
    finally:
        await consumer.stop()
        await engine.dispose()


if __name__ == "__main__":
    asyncio.run(main())
