"""The catalog's check at enqueue, against a real database: valid events stored as given,
invalid ones refused with the field at fault before any SQL (the caller's transaction goes
on, on every driver), ``warn`` logging without values, ``off`` compiling nothing, unknown
types by policy, and jsonschema-rs agreeing with the ``jsonschema`` oracle."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any, Literal
from uuid import UUID

import asyncpg
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import AwareDatetime, BaseModel, Field
from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

import outbox
import outbox.catalog
from outbox import EventSchemaError, Outbox
from outbox.catalog import Catalog, EventType, validation
from outbox.dburl import to_asyncpg_dsn
from tests.support.schemas import document, invalid, oracle, valid
from tests.test_enqueue import BUSINESS, aengine, orders, rows, sengine

__all__ = ["aengine", "sengine"]  # fixtures, used by name


class Line(BaseModel):
    sku: str = Field(min_length=1, max_length=16)
    quantity: int = Field(ge=1, le=99)


class OrderCreated(BaseModel):
    order_id: int = Field(ge=1)
    currency: Literal["EUR", "USD"]
    placed_at: AwareDatetime
    lines: list[Line] = Field(min_length=1)
    reference: UUID | None = None


PAID = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {
        "invoice": {"type": "string", "minLength": 3, "maxLength": 20},
        "day": {"type": "string", "format": "date"},
        "cents": {"type": "integer", "minimum": 0, "maximum": 10_000_000},
        "state": {"enum": ["paid", "refunded"]},
    },
    "required": ["invoice", "cents"],
    "additionalProperties": False,
}
VALID_ORDER = {
    "order_id": 7,
    "currency": "EUR",
    "placed_at": "2024-05-01T10:00:00+00:00",
    "lines": [{"sku": "tea", "quantity": 2}],
}


def shop(mode: Literal["reject", "warn", "off"] = "reject", **kw: Any) -> Catalog:
    catalog = Catalog(title="shop", validate=mode, **kw)
    catalog.event("order.created", version=3, destinations=["orders"], key="the order id")(
        OrderCreated
    )
    catalog.add(EventType.from_schema("invoice.paid", PAID, destinations=["billing", "orders"]))
    return catalog


def stored(conn: Connection) -> list[bytes]:
    return [bytes(r[0]) for r in conn.execute(text("SELECT payload FROM outbox ORDER BY id"))]


TYPES = {t.name: t for t in shop()}
DOCS = {name: document(t.portable, t.definitions) for name, t in TYPES.items()}
DESTINATION = {"order.created": "orders", "invoice.paid": "billing"}


@pytest.fixture
def conn(sengine: Engine) -> Iterator[Connection]:
    with sengine.connect() as c:
        yield c


# --- the property: valid stored as given, invalid refused where it was broken ------------------


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_valid_events_are_stored_and_invalid_ones_refused_at_their_field(
    conn: Connection, data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(sorted(TYPES)))
    box = Outbox(catalog=shop())
    good = data.draw(valid(DOCS[name]))
    bad = data.draw(invalid(DOCS[name]))
    send: dict[str, Any] = {"destination": DESTINATION[name], "key": "k", "event_type": name}
    with conn.begin() as tx:  # rolled back: each example starts from an empty outbox
        with pytest.raises(EventSchemaError) as err:
            box.enqueue_sync(conn, payload=bad.value, **send)
        assert err.value.field == "payload" + bad.field, (bad.mutation, err.value)
        assert (err.value.event_type, err.value.version) == (name, TYPES[name].version)
        assert stored(conn) == []
        conn.execute(text("INSERT INTO orders VALUES (1, 10)"))  # the transaction goes on
        box.enqueue_sync(conn, payload=good, **send)
        expected = json.dumps(good, separators=(",", ":"), ensure_ascii=False).encode()
        assert stored(conn) == [expected]
        tx.rollback()


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_jsonschema_rs_agrees_with_the_oracle(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(TYPES)))
    doc = DOCS[name]
    value = data.draw(st.one_of(valid(doc), invalid(doc).map(lambda i: i.value)))
    schema = TYPES[name].schema
    rs = validation.compile_schema(schema, name)
    assert rs.is_valid(value) == oracle(schema).is_valid(value), value


# --- each driver: a refusal leaves the caller's transaction as it was ---------------------------

BAD = {"order_id": 0, "currency": "EUR", "placed_at": "2024-05-01T10:00:00Z", "lines": []}
TYPED: dict[str, Any] = {"destination": "orders", "key": "7", "event_type": "order.created"}


async def test_asyncpg_transaction_untouched(db_url: str) -> None:
    box = Outbox(catalog=shop())
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(BUSINESS)
        async with conn.transaction():
            await conn.execute("INSERT INTO orders VALUES (1, 10)")
            with pytest.raises(EventSchemaError, match=r"payload\.order_id"):
                await box.enqueue(conn, payload=BAD, **TYPED)
            await conn.execute("INSERT INTO orders VALUES (2, 10)")
            kept = await box.enqueue(conn, payload=VALID_ORDER, **TYPED)
    finally:
        await conn.close()
    assert [r["id"] for r in await rows(db_url)] == [kept]
    assert await orders(db_url) == [1, 2]


async def test_sqlalchemy_async_transaction_untouched(aengine: AsyncEngine, db_url: str) -> None:
    box = Outbox(catalog=shop())
    async with AsyncSession(aengine) as session, session.begin():
        await session.execute(text("INSERT INTO orders VALUES (1, 10)"))
        with pytest.raises(EventSchemaError, match=r"events\[1\]\.payload\.order_id"):
            await box.enqueue_many(
                session, [{"payload": VALID_ORDER, **TYPED}, {"payload": BAD, **TYPED}]
            )
        await session.execute(text("INSERT INTO orders VALUES (2, 10)"))
        kept = await box.enqueue(session, payload=VALID_ORDER, **TYPED)
    assert [r["id"] for r in await rows(db_url)] == [kept]
    assert await orders(db_url) == [1, 2]


def test_sqlalchemy_sync_transaction_untouched(sengine: Engine) -> None:
    box = Outbox(catalog=shop())
    with Session(sengine) as session, session.begin():
        session.execute(text("INSERT INTO orders VALUES (1, 10)"))
        with pytest.raises(EventSchemaError) as err:
            box.enqueue_sync(session, payload=BAD, **TYPED)
        assert (err.value.field, err.value.keyword) == ("payload.order_id", "minimum")
        session.execute(text("INSERT INTO orders VALUES (2, 10)"))
        box.enqueue_sync(session, payload=VALID_ORDER, **TYPED)
    with sengine.connect() as c:
        assert len(stored(c)) == 1
        assert [r[0] for r in c.execute(text("SELECT id FROM orders ORDER BY id"))] == [1, 2]


async def test_psycopg_transactions_untouched(db_url: str) -> None:
    box = Outbox(catalog=shop())
    with psycopg.connect(db_url) as c:
        c.execute(BUSINESS)
        c.execute("INSERT INTO orders VALUES (1, 10)")
        with pytest.raises(EventSchemaError) as err:
            box.enqueue_sync(c, payload=BAD, **TYPED)
        assert (err.value.field, err.value.keyword) == ("payload.order_id", "minimum")
        c.execute("INSERT INTO orders VALUES (2, 10)")
        box.enqueue_sync(c, payload=VALID_ORDER, **TYPED)
        c.commit()
    async with await psycopg.AsyncConnection.connect(db_url) as ac, ac.transaction():
        await ac.execute("INSERT INTO orders VALUES (3, 10)")
        with pytest.raises(EventSchemaError) as aerr:
            await box.enqueue(ac, payload=BAD, **TYPED)
        assert (aerr.value.field, aerr.value.keyword) == ("payload.order_id", "minimum")
        await ac.execute("INSERT INTO orders VALUES (4, 10)")
        await box.enqueue(ac, payload=VALID_ORDER, **TYPED)
    assert len(await rows(db_url)) == 2
    assert await orders(db_url) == [1, 2, 3, 4]


# --- modes, policies and the other checks --------------------------------------------------------


def test_warn_stores_and_logs_once_a_minute_without_values(
    conn: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    catalog = shop("warn")
    now = [1000.0]
    catalog._warnings.clock = lambda: now[0]
    box = Outbox(catalog=catalog)
    secret = {**VALID_ORDER, "currency": "secret-value-123"}
    # A key is data too: an unexpected one is logged as [*].
    secret_key = {"invoice": "inv-1", "cents": 1, "secret-key-456": 1}
    with caplog.at_level(logging.WARNING, logger="outbox.catalog"), conn.begin():
        for _ in range(3):
            box.enqueue_sync(conn, payload=secret, **TYPED)
        now[0] += 61
        box.enqueue_sync(conn, payload=secret, **TYPED)
        box.enqueue_sync(conn, payload=secret_key, destination="billing", event_type="invoice.paid")
        assert len(stored(conn)) == 5
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("outbox.catalog.invalid event_type=order.created version=3")
    assert "field=payload.currency keyword=enum destination=orders suppressed=0" in lines[0]
    assert lines[1].endswith("suppressed=2")
    assert "field=payload[*] keyword=additionalProperties destination=billing" in lines[2]
    assert "secret-value" not in caplog.text and "secret-key" not in caplog.text


def test_off_compiles_nothing(conn: Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> None:
        raise AssertionError("compiled a validator with validation off")

    monkeypatch.setattr(validation, "compile_schema", refuse)
    box = Outbox(catalog=shop("off"))
    with conn.begin():
        box.enqueue_sync(conn, payload=BAD, destination="elsewhere", event_type="order.created")
        assert len(stored(conn)) == 1
    catalog = shop("off")
    catalog.add(
        EventType.from_schema("strict", {"type": "object"}, destinations=["d"], validate="reject")
    )
    with pytest.raises(AssertionError, match="validation off"), conn.begin():
        Outbox(catalog=catalog).enqueue_sync(conn, payload={}, destination="d", event_type="strict")


@pytest.mark.parametrize(
    ("send", "field", "keyword"),
    [
        ({"destination": "billing", "key": "7"}, "destination", "destinations"),
        ({"destination": "orders"}, "key", "key"),
        ({"destination": "orders", "key": "7", "payload": b"{}"}, "content_type", "content_type"),
    ],
)
def test_destination_key_and_content_type_are_the_types(
    conn: Connection, send: dict[str, Any], field: str, keyword: str
) -> None:
    box = Outbox(catalog=shop())
    with conn.begin(), pytest.raises(EventSchemaError) as err:
        box.enqueue_sync(conn, **{"payload": VALID_ORDER, "event_type": "order.created", **send})
    assert (err.value.field, err.value.keyword) == (field, keyword)
    assert "order.created v3" in str(err.value)


def test_unknown_types_by_policy(conn: Connection, caplog: pytest.LogCaptureFixture) -> None:
    event: dict[str, Any] = {
        "destination": "orders",
        "payload": {"x": 1},
        "event_type": "order.shipped",
    }
    with conn.begin():
        Outbox(catalog=shop(unknown="allow")).enqueue_sync(conn, **event)
        with caplog.at_level(logging.WARNING, logger="outbox.catalog"):
            Outbox(catalog=shop(unknown="warn")).enqueue_sync(conn, **event)
        assert "outbox.catalog.unknown event_type=order.shipped" in caplog.text
        with pytest.raises(EventSchemaError, match=r"'order\.shipped' is not a type") as err:
            Outbox(catalog=shop(unknown="reject")).enqueue_sync(conn, **event)
        assert err.value.field == "event_type" and err.value.version is None
        # An event without a type is never checked.
        Outbox(catalog=shop(unknown="reject")).enqueue_sync(conn, destination="x", payload=b"1")
        assert len(stored(conn)) == 3


def test_str_bytes_and_non_str_keys_are_checked_as_stored(conn: Connection) -> None:
    box = Outbox(catalog=shop())
    paid: dict[str, Any] = {"destination": "billing", "event_type": "invoice.paid"}
    with conn.begin():
        with pytest.raises(EventSchemaError, match=r"payload\.cents"):
            box.enqueue_sync(
                conn,
                payload='{"invoice": "inv-1", "cents": -1}',
                content_type="application/json",
                **paid,
            )
        # An unexpected key is named by place only ([*]): a key may be personal data.
        with pytest.raises(EventSchemaError, match=r"payload\[\*\]: an unexpected property"):
            box.enqueue_sync(conn, payload={"invoice": "inv-1", "cents": 1, 1: 2}, **paid)
        box.enqueue_sync(
            conn,
            payload=b'{"invoice": "inv-1", "cents": 5}',
            content_type="application/json",
            **paid,
        )
        box.enqueue_sync(conn, payload={"invoice": "inv-2", "cents": 5, "state": "paid"}, **paid)
        assert len(stored(conn)) == 2


@pytest.fixture
def used() -> Iterator[Catalog]:
    catalog = shop()
    outbox.catalog.use(catalog)
    try:
        yield catalog
    finally:
        outbox.catalog.use(None)


def test_use_sets_the_module_level_functions(used: Catalog, conn: Connection) -> None:
    with conn.begin():
        with pytest.raises(EventSchemaError):
            outbox.enqueue_sync(conn, payload=BAD, **TYPED)
        with pytest.raises(EventSchemaError, match=r"events\[0\]"):
            outbox.enqueue_many_sync(conn, [{"payload": BAD, **TYPED}])
        assert Outbox().catalog is None  # an Outbox of one's own keeps its own
        outbox.catalog.use(None)
        outbox.enqueue_sync(conn, payload=BAD, **TYPED)
        assert len(stored(conn)) == 1
    with pytest.raises(TypeError):
        outbox.catalog.use("shop:catalog")  # type: ignore[arg-type]
