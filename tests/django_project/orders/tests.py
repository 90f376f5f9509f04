"""outbox.django in a real Django project, with pytest-django.

Not collected by the main test run (the name is Django's, not ``test_*.py``):
tests/test_django.py runs this file in a pytest of its own, with ``--ds shop.settings`` and
``OUTBOX_DJANGO_DATABASE_URL`` set to a fresh, outbox-migrated database, so that Django's
settings never reach the rest of the suite.
"""

from __future__ import annotations

import asyncio
import json
import os
from decimal import Decimal
from io import StringIO
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import connections, transaction

from orders.models import Order
from outbox import OutboxError
from outbox.django import enqueue, enqueue_many
from tests.support import relays
from tests.support.receiver import Receiver
from tests.support.relays import running, wait_until
from tests.webhook_helpers import SECRET, verify

URL = os.environ["OUTBOX_DJANGO_DATABASE_URL"]


@pytest.fixture(scope="session")
def django_db_setup(django_db_blocker: Any) -> None:
    """The database exists already, with the outbox migrated (tests/test_django.py made it):
    Django's own migrations add the orders table, no test database is created."""
    with django_db_blocker.unblock():
        call_command("migrate", verbosity=0)


@pytest.fixture(autouse=True)
def empty_outbox() -> None:
    """Each test starts with no event: Django's flush after a transactional test empties
    only the tables of Django's models."""
    with psycopg.connect(URL) as c:
        c.execute("TRUNCATE outbox")


def committed(table: str = "outbox") -> list[int]:
    """The ids another session sees, as the relay does: committed rows only."""
    with psycopg.connect(URL) as c:
        return [r[0] for r in c.execute(f"SELECT id FROM {table} ORDER BY id")]


async def relay_until_delivered(receiver: Receiver, ids: list[int]) -> None:
    hook = {
        "kind": "webhook",
        "url": receiver.url,
        "secrets": [SECRET],
        "allow_private_networks": True,
    }
    s = relays.settings(
        URL, "127.0.0.1:9", destinations={"orders": hook}, relay={"poll_interval": 0.2}
    )

    async def delivered() -> bool:
        async with await psycopg.AsyncConnection.connect(URL) as c:
            cur = await c.execute("SELECT status FROM outbox WHERE id = ANY(%s)", [ids])
            return {r[0] for r in await cur.fetchall()} == {"delivered"}

    async with running(s):
        await wait_until(delivered, timeout=20, what="the order's event delivered")


@pytest.mark.django_db(transaction=True)
def test_an_order_and_its_event_commit_together_and_are_relayed(receiver: Receiver) -> None:
    with pytest.raises(RuntimeError, match="payment declined"), transaction.atomic():
        Order.objects.create(total=Decimal("99.00"))
        enqueue(destination="orders", payload={"type": "order.created", "lost": True})
        raise RuntimeError("payment declined")
    assert not Order.objects.exists() and committed() == []

    payload = {"type": "order.created", "total": "12.50"}
    with transaction.atomic():
        order = Order.objects.create(total=Decimal("12.50"))
        event_id = enqueue(
            destination="orders", key=str(order.pk), payload=payload, event_type="order.created"
        )
        # Not committed yet: the relay, another session, cannot see it. That is why no
        # transaction.on_commit() hook is needed, unlike publishing to a broker from Django.
        assert committed() == [] and committed("orders_order") == []
    assert committed() == [event_id]
    assert committed("orders_order") == [order.pk]

    asyncio.run(relay_until_delivered(receiver, [event_id]))
    [request] = receiver.requests  # the rolled-back event never existed
    assert request.headers["webhook-id"] == str(event_id)
    verify(SECRET, request.body, request.headers)
    assert json.loads(request.body) == payload


@pytest.mark.django_db(transaction=True)
def test_a_block_that_raises_leaves_neither_the_order_nor_the_event() -> None:
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        Order.objects.create(total=Decimal("1.00"))
        enqueue_many(
            [{"destination": "orders", "payload": b"1"}, {"destination": "orders", "payload": b"2"}]
        )
        1 / 0  # noqa: B018
    assert committed("orders_order") == [] and committed() == []


@pytest.mark.django_db(transaction=True)
def test_enqueue_outside_atomic_is_refused_and_writes_nothing() -> None:
    with pytest.raises(OutboxError, match=r"transaction\.atomic\(using='default'\)"):
        enqueue(destination="orders", payload=b"alone")
    with pytest.raises(OutboxError, match=r"not in a transaction\.atomic"):
        enqueue_many([{"destination": "orders", "payload": b"alone"}])
    with pytest.raises(OutboxError, match="server_binding"):
        enqueue(destination="orders", payload=b"alone", using="server_binding")
    assert enqueue_many([]) == []  # nothing to add: nothing to refuse
    assert committed() == []


@pytest.mark.django_db(databases=["default", "server_binding"])
@pytest.mark.parametrize("using", ["default", "server_binding"])
def test_inside_a_testcase_transaction(using: str, django_assert_num_queries: Any) -> None:
    """pytest-django's django_db (Django's TestCase) wraps the test in atomic(): enqueue
    joins that transaction, which is rolled back afterwards. Client-side binding (Django's
    default with psycopg 3) and server-side binding both take the statements."""
    with django_assert_num_queries(2, using=using):
        one = enqueue(destination="orders", payload={"n": 1}, key="k", tenant="acme", using=using)
        many = enqueue_many(
            [
                {"destination": "orders", "payload": b"\x00\xff"},
                {"destination": "orders", "payload": "text", "headers": {"h": "v"}},
                {"destination": "orders", "payload": [1], "event_type": "order.paid"},
            ],
            using=using,
        )
    assert many == sorted(many) and min(many) > one
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT id, key, tenant, event_type, payload FROM outbox ORDER BY id")
        seen = cursor.fetchall()
    assert [r[0] for r in seen] == [one, *many]
    assert [(r[1], r[2], r[3]) for r in seen] == [
        ("k", "acme", None),
        (None, None, None),
        (None, None, None),
        (None, None, "order.paid"),
    ]
    assert [bytes(r[4]) for r in seen] == [b'{"n":1}', b"\x00\xff", b"text", b"[1]"]
    assert committed() == []  # the test's transaction never commits


@pytest.mark.django_db
def test_a_nested_block_that_raises_takes_only_its_own_event() -> None:
    with transaction.atomic():
        kept = enqueue(destination="orders", payload=b"outer")
        with pytest.raises(KeyError), transaction.atomic():  # a savepoint
            enqueue(destination="orders", payload=b"inner")
            raise KeyError
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT id FROM outbox")
            assert cursor.fetchall() == [(kept,)]


@pytest.mark.django_db(transaction=True)
def test_outbox_migrate_and_the_schema_setting(settings: Any) -> None:
    out = StringIO()
    call_command("outbox_migrate", schema="events", stdout=out)
    assert "applied 0001_" in out.getvalue()
    settings.OUTBOX_SCHEMA = "events"
    call_command("outbox_migrate", stdout=out)  # the setting is the command's default schema
    assert "schema 'events' is up to date" in out.getvalue()
    with transaction.atomic():
        event_id = enqueue(destination="orders", payload=b"x")
    assert committed("events.outbox") == [event_id] and committed() == []


@pytest.mark.django_db(transaction=True)
def test_a_catalog_refusal_leaves_the_atomic_block_usable(settings: Any) -> None:
    """OUTBOX_CATALOG: an event its type refuses raises before any SQL, and the block goes on
    to commit the order and a valid event, as if the refused one had never been tried."""
    from outbox import EventSchemaError

    settings.OUTBOX_CATALOG = "orders.events:catalog"
    with transaction.atomic():
        order = Order.objects.create(total=Decimal("5.00"))
        with pytest.raises(EventSchemaError) as err:
            enqueue(destination="orders", payload={"id": "one"}, event_type="order.created")
        assert err.value.field == "payload.id" and err.value.keyword == "type"
        with pytest.raises(
            EventSchemaError, match=r"events\[1\]\.payload\[\*\]: an unexpected property"
        ):
            enqueue_many(
                [
                    {"destination": "orders", "payload": {"id": 1}, "event_type": "order.created"},
                    {
                        "destination": "orders",
                        "payload": {"id": 1, "extra": 2},
                        "event_type": "order.created",
                    },
                ]
            )
        kept = enqueue(destination="orders", payload={"id": order.pk}, event_type="order.created")
    assert committed("orders_order") == [order.pk] and committed() == [kept]
    settings.OUTBOX_CATALOG = None
    with transaction.atomic():  # without the setting, nothing is checked
        enqueue(destination="orders", payload={"id": "one"}, event_type="order.created")
