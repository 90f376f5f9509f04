"""``webhooks.id_prefix``: a ``webhook-id`` unique across outboxes.

Row ids are unique within one outbox only (every outbox starts at 1), so a receiver of two
services' webhooks sees the same ids from both. With ``[webhooks] id_prefix`` the relay sends
``webhook-id: <prefix><row id>``, signed with the prefix (the signed content is
``id.timestamp.body``), from webhook and endpoints destinations alike. Checked with a real
receiver and the reference ``standardwebhooks`` verifier, the real relay, and the inbox of a
FastAPI receiver that consumes two outboxes under one consumer name.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from standardwebhooks import WebhookVerificationError

import outbox
from outbox.dburl import to_asyncpg_dsn, to_sqlalchemy_async_url
from outbox.inbox import ReceivedWebhook
from outbox.inbox.fastapi import verified_webhook
from outbox.migrate import migrate
from relay.config import ConfigError
from relay.settings import load_settings
from relay.sinks.webhook.config import WebhookClientSettings
from relay.sinks.webhook.sink import WebhookSink
from tests.support.asgi import serve
from tests.support.receiver import Receiver
from tests.support.relays import running, settings, wait_until
from tests.webhook_helpers import SECRET, dest, envelope, verify

DB = "postgresql://root@127.0.0.1:5432/postgres"


# --- the setting ---------------------------------------------------------------------------


def test_id_prefix_is_unset_by_default_and_loads_from_the_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_settings(database_url=DB).webhooks.id_prefix is None
    assert load_settings(database_url=DB, webhooks={"id_prefix": ""}).webhooks.id_prefix is None
    path = tmp_path / "relay.toml"
    path.write_text(f'database_url = "{DB}"\n[webhooks]\nid_prefix = "billing-"\n')
    assert load_settings(path).webhooks.id_prefix == "billing-"
    monkeypatch.setenv("OUTBOX_WEBHOOKS_ID_PREFIX", "orders.v1:")
    assert load_settings(path).webhooks.id_prefix == "orders.v1:"  # the environment wins


@pytest.mark.parametrize(
    ("prefix", "problem"),
    [
        ("billing service-", "space"),
        ("billing\t", "tab"),
        ("billing\n", "line break"),
        ("bill\x00", "control character"),
        ("bill\x7f", "control character"),
        ("facturación-", "printable ASCII"),
        ("b" * 65, "at most 64 characters"),
    ],
)
def test_a_bad_id_prefix_is_refused_at_load_naming_the_key(prefix: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(database_url=DB, webhooks={"id_prefix": prefix})
    message = str(err.value)
    assert "webhooks.id_prefix" in message and problem in message, message


# --- webhook destinations: the prefixed id is the signed id -------------------------------


@pytest.fixture
async def prefixed_sink() -> AsyncIterator[Callable[..., WebhookSink]]:
    sinks: list[WebhookSink] = []

    def make(url: str, prefix: str = "billing-", **kw: Any) -> WebhookSink:
        sink = WebhookSink(WebhookClientSettings(id_prefix=prefix), {"hook": dest(url, **kw)})
        sinks.append(sink)
        return sink

    yield make
    for s in sinks:
        await s.close()


async def test_the_prefix_is_in_the_webhook_id_and_in_what_is_signed(
    receiver: Receiver, prefixed_sink: Callable[..., WebhookSink]
) -> None:
    sink = prefixed_sink(receiver.url + "/hooks")
    await sink.start()
    env = envelope(id=42)
    receiver.respond(status=500, times=1)  # a retry keeps the id
    await sink.deliver([env])
    await sink.deliver([env])
    first, retry = receiver.wait_for(2)
    assert first.headers["webhook-id"] == retry.headers["webhook-id"] == "billing-42"
    for req in (first, retry):
        verify(SECRET, req.body, req.headers)  # the reference verifier, as receivers use it
        # Signed over the prefixed id: the same signature does not pass for the bare row id.
        with pytest.raises(WebhookVerificationError):
            verify(SECRET, req.body, {**req.headers, "webhook-id": "42"})


async def test_without_a_prefix_the_webhook_id_is_the_row_id(
    receiver: Receiver, prefixed_sink: Callable[..., WebhookSink]
) -> None:
    sink = prefixed_sink(receiver.url, prefix="")
    await sink.deliver([envelope(id=7)])
    [req] = receiver.wait_for(1)
    assert req.headers["webhook-id"] == "7"
    verify(SECRET, req.body, req.headers)


@pytest.mark.parametrize("mode", ["binary", "structured"])
async def test_a_cloudevent_keeps_the_row_id_as_its_id(
    receiver: Receiver, prefixed_sink: Callable[..., WebhookSink], mode: str
) -> None:
    """CloudEvents identify an event by source and id together, and its Kafka copy carries
    the row id: the id attribute stays the row id, the webhook-id carries the prefix."""
    sink = prefixed_sink(
        receiver.url,
        envelope="cloudevents",
        source="/billing",
        cloudevents_mode=mode,
        default_type="invoice.paid",
    )
    await sink.deliver([envelope(id=9)])
    [req] = receiver.wait_for(1)
    assert req.headers["webhook-id"] == "billing-9"
    ce_id = req.headers["ce-id"] if mode == "binary" else json.loads(req.body)["id"]
    assert ce_id == "9"
    verify(SECRET, req.body, req.headers)


# --- endpoints destinations: the same request path ----------------------------------------


async def test_endpoints_destinations_send_the_prefixed_id(db_url: str, receiver: Receiver) -> None:
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    try:
        async with engine.begin() as conn:
            ep = await outbox.endpoints.create(
                conn, destination="customers", url=receiver.url, allow_private_networks=True
            )
            [row_id] = await outbox.enqueue_many(
                conn, [{"destination": "customers", "payload": {"n": 1}}]
            )
    finally:
        await engine.dispose()
    s = settings(
        db_url,
        "127.0.0.1:9",
        destinations={"customers": {"kind": "endpoints", "allow_private_networks": True}},
        webhooks={"id_prefix": "billing-"},
        relay={"poll_interval": 0.2},
    )
    async with running(s):
        await wait_until(lambda: receiver.requests, what="the delivery")
    [req] = receiver.requests
    assert req.headers["webhook-id"] == f"billing-{row_id}"
    verify(ep.secret, req.body, req.headers)


# --- the inbox: two outboxes, one receiver, one consumer name -----------------------------


async def one_event(dsn: str, n: int) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            [row_id] = await outbox.enqueue_many(
                conn, [{"destination": "hook", "payload": {"n": n}}]
            )
        return row_id
    finally:
        await conn.close()


async def all_delivered(dsn: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        return bool(await conn.fetchval("SELECT bool_and(status = 'delivered') FROM outbox"))
    finally:
        await conn.close()


async def test_one_inbox_dedupes_two_outboxes_by_their_prefixed_ids(
    db_url: str, empty_db_url: str
) -> None:
    """Both outboxes' first event is row 1: without prefixes the receiver would take the
    second for a duplicate of the first. Each is also delivered twice, and applied once."""
    await migrate(empty_db_url)
    orders, payments = to_asyncpg_dsn(db_url), to_asyncpg_dsn(empty_db_url)
    assert await one_event(orders, 1) == await one_event(payments, 2) == 1

    receiver_db: AsyncEngine = create_async_engine(to_sqlalchemy_async_url(db_url))
    async with receiver_db.begin() as c:
        await c.execute(text("CREATE TABLE effects (event_id text, n int)"))
    hook_dep = verified_webhook(async_sessionmaker(receiver_db), consumer="ledger", secrets=SECRET)
    app = FastAPI()
    answered: list[tuple[str, bool]] = []

    @app.post("/hook")
    async def on_hook(hook: ReceivedWebhook = hook_dep) -> dict[str, bool]:
        if hook.new:
            await hook.db.execute(
                text("INSERT INTO effects VALUES (:e, :n)"), {"e": hook.id, "n": hook.json()["n"]}
            )
        answered.append((hook.id, hook.duplicate))
        return {"duplicate": hook.duplicate}

    try:
        async with serve(app) as url:
            hook = {
                "kind": "webhook",
                "url": url + "/hook",
                "secrets": [SECRET],
                "allow_private_networks": True,
            }
            relays = [
                settings(
                    dsn_url,
                    "127.0.0.1:9",
                    destinations={"hook": hook},
                    webhooks={"id_prefix": prefix},
                    relay={"poll_interval": 0.2},
                )
                for dsn_url, prefix in ((db_url, "orders-"), (empty_db_url, "payments-"))
            ]
            async with running(relays[0]), running(relays[1]):
                for dsn in (orders, payments):
                    await wait_until(lambda dsn=dsn: all_delivered(dsn), what="delivered")
                # Both again, as after a relay crash between sending and recording.
                for dsn in (orders, payments):
                    conn = await asyncpg.connect(dsn)
                    await conn.execute("UPDATE outbox SET status = 'pending', run_after = now()")
                    await conn.close()
                await wait_until(lambda: len(answered) == 4, what="redelivered")
        async with receiver_db.connect() as c:
            effects = (await c.execute(text("SELECT event_id, n FROM effects ORDER BY 1"))).all()
            marks = (await c.execute(text("SELECT event_id FROM outbox_inbox ORDER BY 1"))).all()
    finally:
        await receiver_db.dispose()
    assert [tuple(r) for r in effects] == [("orders-1", 1), ("payments-1", 2)]
    assert [r[0] for r in marks] == ["orders-1", "payments-1"]
    assert sorted(answered) == [
        ("orders-1", False),
        ("orders-1", True),
        ("payments-1", False),
        ("payments-1", True),
    ]
