"""The reference service: an order and its ``order.created`` event, in one transaction.

    APP_DATABASE_URL=postgresql://app@127.0.0.1/app uvicorn example_app.main:app

``POST /orders`` inserts the order, flushes it (so it has an id), enqueues the event on the
same session, and commits once: both rows exist, or neither does. The relay running next to
this service delivers the event to the ``orders`` destination afterwards.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, Field
from sqlalchemy import BigInteger, DateTime, Identity, Numeric, Text, func, text
from sqlalchemy.ext.asyncio import (
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import outbox
from outbox.dburl import to_sqlalchemy_async_url

# Every environment variable this service reads (the deploy tests check the manifests
# against this list).
DATABASE_URL_ENV = "APP_DATABASE_URL"
ENV_VARS = (DATABASE_URL_ENV,)

# The logical destination; the relay's config maps it to a Kafka topic (or a webhook).
ORDERS_DESTINATION = "orders"
ORDER_CREATED = "order.created"


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    # Fetch server defaults (created_at) in the INSERT's RETURNING, not in a later lazy load.
    __mapper_args__ = {"eager_defaults": True}  # noqa: RUF012 - read by SQLAlchemy

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    customer: Mapped[str] = mapped_column(Text)
    total: Mapped[Decimal] = mapped_column(Numeric(12, 2))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class OrderIn(BaseModel):
    customer: str = Field(min_length=1, max_length=200)
    total: Decimal = Field(gt=0, max_digits=12, decimal_places=2)


class OrderOut(BaseModel):
    id: int
    customer: str
    total: Decimal
    created_at: datetime


class OrderCreated(OrderOut):
    event_id: int


def order_created_event(order: Order) -> dict[str, Any]:
    """The event's body: what consumers need, in JSON types (money as a string)."""
    return {
        "type": ORDER_CREATED,
        "id": order.id,
        "customer": order.customer,
        "total": str(order.total),
        "created_at": order.created_at.isoformat(),
    }


def database_url() -> str:
    url = os.environ.get(DATABASE_URL_ENV)
    if not url:
        raise RuntimeError(f"set {DATABASE_URL_ENV} to the service's PostgreSQL URL")
    return to_sqlalchemy_async_url(url)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine = create_async_engine(database_url(), pool_size=5, pool_pre_ping=True)
    # A real service creates its tables with its migrations (Alembic); the outbox table comes
    # from `outbox-relay migrate`. The lock keeps replicas that start together from racing.
    async with engine.begin() as conn:
        await conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('example_app.schema'))"))
        await conn.run_sync(Base.metadata.create_all)
    app.state.sessions = async_sessionmaker(engine, expire_on_commit=False)
    try:
        yield
    finally:
        await engine.dispose()


app = FastAPI(title="orders (outbox-relay example)", lifespan=lifespan)


async def session(request: Request) -> AsyncIterator[AsyncSession]:
    sessions: async_sessionmaker[AsyncSession] = request.app.state.sessions
    async with sessions() as s:
        yield s


Session = Annotated[AsyncSession, Depends(session)]


@app.post("/orders", status_code=201)
async def create_order(body: OrderIn, db: Session) -> OrderCreated:
    async with db.begin():  # one transaction: commits both rows at the end, or neither
        order = Order(customer=body.customer, total=body.total)
        db.add(order)
        await db.flush()  # the INSERT runs now and gives the order its id
        event_id = await outbox.enqueue(
            db,
            destination=ORDERS_DESTINATION,
            key=str(order.id),  # Kafka key: one order's events stay in one partition
            payload=order_created_event(order),
            headers={"event-type": ORDER_CREATED},
        )
    return OrderCreated(
        id=order.id,
        customer=order.customer,
        total=order.total,
        created_at=order.created_at,
        event_id=event_id,
    )


@app.get("/orders/{order_id}")
async def get_order(order_id: int, db: Session) -> OrderOut:
    order = await db.get(Order, order_id)
    if order is None:
        raise HTTPException(status_code=404, detail=f"no order {order_id}")
    return OrderOut(
        id=order.id, customer=order.customer, total=order.total, created_at=order.created_at
    )


@app.get("/healthz")
async def healthz(db: Session) -> dict[str, str]:
    await db.execute(text("SELECT 1"))
    return {"status": "ok"}
