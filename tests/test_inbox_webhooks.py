"""Receiving webhooks once (outbox.inbox.webhooks, outbox.inbox.fastapi): the verification on its
own, ``verify_and_mark`` against a real database, and a FastAPI app served on loopback with the
dependency, fed by the real relay: duplicates answered 200 and applied once, bad signatures
401, stale timestamps refused."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI, HTTPException
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session
from standardwebhooks import Webhook
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import outbox
from outbox import OutboxError, OutboxValidationError
from outbox.dburl import to_asyncpg_dsn, to_sqlalchemy_async_url
from outbox.inbox import (
    BadSignature,
    MalformedWebhook,
    ReceivedWebhook,
    StaleTimestamp,
    WebhookReceiver,
    WebhookRejected,
    verify_and_mark,
    verify_and_mark_sync,
)
from outbox.inbox.fastapi import verified_webhook
from outbox.webhooks.signing import Signer, decode_secret
from tests.support.asgi import serve
from tests.support.relays import running, settings, wait_until
from tests.webhook_helpers import SECRET, new_secret

OTHER = new_secret()


def signed(
    secret: str,
    body: bytes | str,
    msg_id: str = "42",
    at: float | None = None,
) -> dict[str, str]:
    """Headers as a Standard Webhooks sender makes them, by the reference library."""
    stamp = int(time.time() if at is None else at)
    data = body.decode() if isinstance(body, bytes) else body
    signature = Webhook(secret).sign(msg_id, datetime.fromtimestamp(stamp, UTC), data)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(stamp),
        "webhook-signature": signature,
        "content-type": "application/json",
    }


# --- verification alone --------------------------------------------------------------------


def test_a_request_signed_by_the_reference_library_or_the_relay_verifies() -> None:
    receiver = WebhookReceiver(consumer="c", secrets=[SECRET])
    body = b'{"n":1}'
    got = receiver.verify(signed(SECRET, body, "17"), body)
    assert (got.id, got.body, got.json()) == ("17", body, {"n": 1})
    # The relay's own signer, over a body that is not text (the reference library takes text).
    binary = bytes(range(256))
    now = int(time.time())
    headers = {
        "Webhook-Id": "18",  # any case
        "Webhook-Timestamp": str(now),
        "Webhook-Signature": Signer([decode_secret(SECRET)]).sign("18", now, binary),
    }
    assert receiver.verify(headers, binary).timestamp == now


def test_rotation_any_secret_matches_any_signature() -> None:
    """During a rotation the relay signs with both secrets, and the receiver may hold either,
    or both."""
    body = b"{}"
    now = int(time.time())
    both = Signer([decode_secret(OTHER), decode_secret(SECRET)]).sign("1", now, body)
    headers = {"webhook-id": "1", "webhook-timestamp": str(now), "webhook-signature": both}
    for secrets in ([SECRET], [OTHER], [OTHER, SECRET]):
        WebhookReceiver(consumer="c", secrets=secrets).verify(headers, body)
    # A receiver holding the new and the old secret takes a request signed with the old only.
    WebhookReceiver(consumer="c", secrets=[new_secret(), SECRET]).verify(signed(SECRET, body), body)
    with pytest.raises(BadSignature):
        WebhookReceiver(consumer="c", secrets=[new_secret()]).verify(headers, body)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda h, b: (h, b + b" "), BadSignature),  # the body was altered
        (lambda h, b: ({**h, "webhook-id": "43"}, b), BadSignature),  # another message's id
        (lambda h, b: (signed(OTHER, b), b), BadSignature),  # another secret
        (lambda h, b: ({**h, "webhook-signature": "v1"}, b), BadSignature),
        (lambda h, b: ({**h, "webhook-signature": "v1,!!!not base64"}, b), BadSignature),
        (lambda h, b: ({**h, "webhook-signature": "v2,abc v1a,xyz"}, b), BadSignature),
        (lambda h, b: ({**h, "webhook-signature": "v1,ÿ"}, b), BadSignature),
        (lambda h, b: ({**h, "webhook-timestamp": str(int(time.time()) + 1)}, b), BadSignature),
        (lambda h, b: (signed(SECRET, b, at=time.time() - 301), b), StaleTimestamp),
        (lambda h, b: (signed(SECRET, b, at=time.time() + 301), b), StaleTimestamp),
        (lambda h, b: ({**h, "webhook-timestamp": "1.5"}, b), MalformedWebhook),
        (lambda h, b: ({**h, "webhook-timestamp": "-5"}, b), MalformedWebhook),
        (lambda h, b: ({k: v for k, v in h.items() if k != "webhook-id"}, b), MalformedWebhook),
        (lambda h, b: ({**h, "webhook-signature": ""}, b), MalformedWebhook),
        (lambda h, b: (signed(SECRET, b, "x" * 1025), b), MalformedWebhook),
    ],
)
def test_what_is_refused_and_with_which_status(
    change: Callable[[dict[str, str], bytes], tuple[dict[str, str], bytes]],
    error: type[WebhookRejected],
) -> None:
    body = b'{"n":1}'
    headers, sent = change(signed(SECRET, body), body)
    with pytest.raises(WebhookRejected) as caught:
        WebhookReceiver(consumer="c", secrets=[SECRET]).verify(headers, sent)
    assert type(caught.value) is error
    assert caught.value.status_code == (400 if error is MalformedWebhook else 401)


def test_tolerance_is_a_setting() -> None:
    body = b"{}"
    headers = signed(SECRET, body, at=time.time() - 20)
    WebhookReceiver(consumer="c", secrets=SECRET).verify(headers, body)  # within 300 s
    strict = WebhookReceiver(consumer="c", secrets=SECRET, tolerance=10)
    with pytest.raises(StaleTimestamp, match=r"s old, beyond the tolerance of 10 s"):
        strict.verify(headers, body)


def test_bad_settings_fail_at_set_up_and_secrets_are_not_shown() -> None:
    with pytest.raises(OutboxError, match="whsec_"):
        WebhookReceiver(consumer="c", secrets=["hunter2"])
    with pytest.raises(OutboxError, match="at least 24 random bytes"):
        WebhookReceiver(consumer="c", secrets=["whsec_c2hvcnQ="])
    with pytest.raises(OutboxValidationError, match="at least one"):
        WebhookReceiver(consumer="c", secrets=[])
    for tolerance in (0, -1, float("nan"), float("inf")):
        with pytest.raises(OutboxValidationError, match="tolerance"):
            WebhookReceiver(consumer="c", secrets=SECRET, tolerance=tolerance)
    with pytest.raises(OutboxValidationError, match="consumer"):
        WebhookReceiver(consumer="", secrets=SECRET)
    with pytest.raises(TypeError, match="AsyncEngine or async_sessionmaker"):
        verified_webhook("postgresql://db", consumer="c", secrets=SECRET)
    receiver = WebhookReceiver(consumer="c", secrets=[SECRET, OTHER])
    assert SECRET not in repr(receiver) and "2 secret(s)" in repr(receiver)
    with pytest.raises(TypeError, match="raw request body"):
        receiver.verify(signed(SECRET, "{}"), "{}")  # type: ignore[arg-type]


# --- verify_and_mark against the database ---------------------------------------------------


async def test_verify_and_mark_marks_in_the_callers_transaction(db_url: str) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    body = b'{"n":1}'
    try:
        answers = []
        for _ in range(2):
            async with conn.transaction():
                hook = await verify_and_mark(
                    conn, consumer="c", headers=signed(SECRET, body), body=body, secrets=SECRET
                )
                answers.append((hook.id, hook.new, hook.duplicate, hook.db is conn))
        assert answers == [("42", True, False, True), ("42", False, True, True)]
        async with conn.transaction():
            with pytest.raises(BadSignature):
                await verify_and_mark(
                    conn,
                    consumer="c",
                    headers=signed(OTHER, body, "43"),
                    body=body,
                    secrets=SECRET,
                )
        rows = await conn.fetch("SELECT consumer, event_id FROM outbox_inbox")
        with pytest.raises(TypeError, match="one transaction at a time: pass an asyncpg Pool"):
            verified_webhook(conn, consumer="c", secrets=SECRET)  # requests run concurrently
    finally:
        await conn.close()
    assert [tuple(r) for r in rows] == [("c", "42")]  # nothing for the refused request

    engine = create_engine("postgresql+psycopg://" + db_url.partition("://")[2])
    try:
        with Session(engine) as session, session.begin():
            hook = verify_and_mark_sync(
                session, consumer="c", headers=signed(SECRET, body), body=body, secrets=[SECRET]
            )
            assert hook.duplicate
            other = verify_and_mark_sync(
                session, consumer="d", headers=signed(SECRET, body), body=body, secrets=[SECRET]
            )
            assert other.new  # another consumer's marks are its own
    finally:
        engine.dispose()


# --- a FastAPI receiver served on loopback, fed by the real relay -------------------------


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]


class SlowFirstAnswer:
    """ASGI middleware: the first answer to each id in ``ids`` leaves late, after the
    endpoint committed: the relay times out, as if the answer were lost, and sends again."""

    def __init__(self, app: Any, ids: set[str], delay: float) -> None:
        self.app, self.ids, self.delay = app, ids, delay

    async def __call__(self, scope: Scope, receive: Any, send: Send) -> None:
        headers = dict(scope.get("headers") or [])
        msg_id = headers.get(b"webhook-id", b"").decode()
        if msg_id not in self.ids:
            await self.app(scope, receive, send)
            return
        self.ids.discard(msg_id)

        async def late(message: Message) -> None:
            if message["type"] == "http.response.start":
                await asyncio.sleep(self.delay)
            await send(message)

        await self.app(scope, receive, late)


def receiver_app(
    db_url: str, pool: asyncpg.Pool, slow_ids: set[str], fail_once: set[int]
) -> tuple[Any, list[tuple[str, bool]]]:
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    sessions = async_sessionmaker(engine)
    # The receiver holds the new secret and the relay's current one (a rotation under way).
    # (A default rather than an Annotated alias: this module's annotations are strings, and
    # FastAPI resolves them in the module's globals, where a local alias is not.)
    order_hook = verified_webhook(sessions, consumer="billing", secrets=[new_secret(), SECRET])
    answered: list[tuple[str, bool]] = []
    app = FastAPI()

    @app.post("/hooks/orders")
    async def on_order(hook: ReceivedWebhook = order_hook) -> dict[str, bool]:
        if hook.new:
            n = hook.json()["n"]
            await hook.db.execute(
                text("INSERT INTO effects VALUES (:e, :n)"), {"e": hook.id, "n": n}
            )
            if n in fail_once:  # after the business write: the whole transaction rolls back
                fail_once.discard(n)
                raise HTTPException(503, "try again")
        answered.append((hook.id, hook.duplicate))
        return {"duplicate": hook.duplicate}

    async def plain(request: Request) -> Response:
        """Starlette without dependencies: verify_and_mark in the route's own transaction."""
        body = await request.body()
        async with pool.acquire() as conn, conn.transaction():
            try:
                hook = await verify_and_mark(
                    conn, consumer="plain", headers=request.headers, body=body, secrets=[SECRET]
                )
            except WebhookRejected as exc:
                return Response(exc.answer, status_code=exc.status_code)
            if hook.new:
                await conn.execute("INSERT INTO effects VALUES ($1, -1)", "plain-" + hook.id)
        return JSONResponse({"duplicate": hook.duplicate})

    app.add_route("/plain", plain, methods=["POST"])
    app.state.engine = engine
    return SlowFirstAnswer(app, slow_ids, delay=4.0), answered


async def effects(db_url: str) -> list[tuple[str, int]]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        rows = await conn.fetch("SELECT event_id, n FROM effects ORDER BY event_id")
        return [(r[0], r[1]) for r in rows]
    finally:
        await conn.close()


@pytest.fixture
async def pool(db_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(to_asyncpg_dsn(db_url), min_size=1, max_size=4)
    await p.execute("CREATE TABLE effects (event_id text NOT NULL, n int NOT NULL)")
    try:
        yield p
    finally:
        await p.close()


async def test_relayed_webhooks_are_applied_once_and_duplicates_answered_200(
    db_url: str, pool: asyncpg.Pool
) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            ids = await outbox.enqueue_many(
                conn, [{"destination": "hook", "payload": {"n": n}} for n in range(12)]
            )
    finally:
        await conn.close()
    by_n = dict(enumerate(str(i) for i in ids))
    slow = {by_n[5], by_n[6]}  # answered after the relay gave up: sent again
    app, answered = receiver_app(db_url, pool, set(slow), fail_once={3})
    async with serve(app) as url:
        destination = {
            "kind": "webhook",
            "url": url + "/hooks/orders",
            "secrets": [SECRET],
            "allow_private_networks": True,
            # Long enough that only the slow answers (4 s) time out, although the receiver's
            # first requests are slow on a busy machine; and a circuit opened by them anyway
            # closes again within the test's wait.
            "timeout": 2.0,
            "circuit": {"cooldown": 1.0},
            "backoff": {"schedule": [0.2], "jitter": 0},
            "max_attempts": 10,
        }
        s = settings(
            db_url, "127.0.0.1:9", destinations={"hook": destination}, relay={"poll_interval": 0.2}
        )
        async with running(s):
            await wait_until(lambda: _delivered(pool, 12), timeout=30, what="all delivered")
            first_round = list(answered)
            attempts = dict(await pool.fetch("SELECT id::text, attempts FROM outbox"))
            # Every event again, as after a relay crash between sending and recording.
            await pool.execute("UPDATE outbox SET status = 'pending', run_after = now()")
            await wait_until(lambda: len(answered) >= len(first_round) + 12, what="redelivered")
            await wait_until(lambda: _delivered(pool, 12), what="all delivered again")
        await app.app.state.engine.dispose()
    assert await effects(db_url) == sorted((by_n[n], n) for n in range(12))
    # The lost answers came back as duplicates, 200; the failed attempt was applied on retry.
    assert sorted(i for i, dup in first_round if dup) == sorted(slow)
    assert sorted(i for i, dup in first_round if not dup) == sorted(by_n.values())
    assert sorted(i for i, dup in answered[len(first_round) :] if dup) == sorted(by_n.values())
    assert {i for i, n in attempts.items() if n == 2} == {by_n[3], *slow}


async def test_bad_signatures_and_stale_timestamps_are_refused(
    db_url: str, pool: asyncpg.Pool
) -> None:
    app, answered = receiver_app(db_url, pool, set(), set())
    body = '{"n": 7}'
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:

        async def post(path: str, headers: dict[str, str]) -> httpx.Response:
            return await client.post(path, content=body, headers=headers)

        for path in ("/hooks/orders", "/plain"):
            forged = await post(path, signed(OTHER, body, "900"))
            assert forged.status_code == 401
            assert "invalid webhook signature" in forged.text and "secret" not in forged.text
            stale = signed(SECRET, body, "901", at=time.time() - 301)
            assert (await post(path, stale)).status_code == 401
            future = signed(SECRET, body, "902", at=time.time() + 301)
            assert (await post(path, future)).status_code == 401
            assert (await post(path, {"content-type": "application/json"})).status_code == 400
            good = signed(SECRET, body, "903")
            first, again = await post(path, good), await post(path, good)
            assert (first.status_code, first.json()) == (200, {"duplicate": False})
            assert (again.status_code, again.json()) == (200, {"duplicate": True})
            # Committed before the answer left: visible the moment the 200 arrives.
            assert ("plain-903" if path == "/plain" else "903") in dict(await effects(db_url))
        await app.app.state.engine.dispose()
    assert answered == [("903", False), ("903", True)]
    assert await effects(db_url) == [("903", 7), ("plain-903", -1)]
    marks = await pool.fetch("SELECT consumer, event_id FROM outbox_inbox ORDER BY 1")
    assert [tuple(r) for r in marks] == [("billing", "903"), ("plain", "903")]


async def _delivered(pool: asyncpg.Pool, n: int) -> bool:
    return await pool.fetchval("SELECT count(*) FROM outbox WHERE status = 'delivered'") == n


async def test_the_answer_leaves_only_after_the_commit(db_url: str, pool: asyncpg.Pool) -> None:
    """A slow commit is waited for, and a commit that fails is not answered 2xx (the relay
    sends again), so a 2xx always stands for a committed effect and mark."""
    await pool.execute(
        """
        CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.n = 13 THEN RAISE EXCEPTION 'the commit fails'; END IF;
            PERFORM pg_sleep(0.5);
            RETURN NULL;
        END $$;
        CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON effects
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();
        """
    )
    app, answered = receiver_app(db_url, pool, set(), set())
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:
        ok = await client.post(
            "/hooks/orders", content='{"n": 1}', headers=signed(SECRET, '{"n": 1}', "1")
        )
        assert ok.status_code == 200
        assert await effects(db_url) == [("1", 1)]  # committed by the time the 200 arrived
        bad = signed(SECRET, '{"n": 13}', "2")
        failed = await client.post("/hooks/orders", content='{"n": 13}', headers=bad)
        assert failed.status_code == 500
        await app.app.state.engine.dispose()
    assert await effects(db_url) == [("1", 1)]
    marks = await pool.fetch("SELECT event_id FROM outbox_inbox ORDER BY 1")
    assert [r[0] for r in marks] == ["1"]  # the failed commit took its mark with it
    assert answered == [("1", False), ("2", False)]  # the endpoint ran; its commit failed


# --- from the hostile review: each failed before its fix -------------------------------


async def test_retry_later_rolls_the_mark_back_and_big_or_headerless_bodies_are_refused(
    db_url: str, pool: asyncpg.Pool
) -> None:
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    sessions = async_sessionmaker(engine)
    hook_dep = verified_webhook(sessions, consumer="c", secrets=[SECRET], max_body_bytes=1000)
    app = FastAPI()
    busy = {"yes": True}

    @app.post("/hook")
    async def on_hook(hook: ReceivedWebhook = hook_dep) -> dict[str, bool]:
        if hook.new:
            await hook.db.execute(text("INSERT INTO effects VALUES (:e, 1)"), {"e": hook.id})
            if busy.pop("yes", False):
                hook.retry_later("downstream is down")  # raises: the mark is not kept
        return {"duplicate": hook.duplicate}

    body = b'{"n": 1}'
    try:
        async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:
            first = await client.post("/hook", content=body, headers=signed(SECRET, body, "7"))
            assert first.status_code == 503 and first.headers["retry-after"]
            again = await client.post("/hook", content=body, headers=signed(SECRET, body, "7"))
            assert again.status_code == 200 and again.json() == {"duplicate": False}
            big = b"x" * 5000
            r = await client.post("/hook", content=big, headers=signed(SECRET, big, "8"))
            assert r.status_code == 413
            r = await client.post("/hook", content=b"y" * 5000)  # not even a webhook
            assert r.status_code == 400 and "webhook-id" in r.text
    finally:
        await engine.dispose()
    assert await effects(db_url) == [("7", 1)]
