"""outbox.endpoints: endpoints registered at runtime, on the real database (async and sync)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta

import pytest
from cryptography.fernet import Fernet
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import outbox
from outbox import OutboxError, OutboxValidationError
from outbox.dburl import to_sqlalchemy_async_url
from outbox.endpoints import EndpointNotFound, Endpoints

LOCAL = "http://127.0.0.1:9/in"


@pytest.fixture
async def aengine(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    yield engine
    await engine.dispose()


@pytest.fixture
def sengine(db_url: str) -> Iterator[Engine]:
    engine = create_engine("postgresql+psycopg://" + db_url.partition("://")[2])
    yield engine
    engine.dispose()


def _key(secret: str) -> bytes:
    assert secret.startswith("whsec_")
    return base64.b64decode(secret.removeprefix("whsec_"))


async def test_create_returns_a_secret_once_and_list_never_shows_it(aengine: AsyncEngine) -> None:
    async with AsyncSession(aengine) as s, s.begin():
        ep = await outbox.endpoints.create(
            s,
            destination="customer-events",
            url=LOCAL,
            tenant="acme",
            event_types=["invoice.paid", "invoice.voided", "invoice.paid"],
            rate_limit=5,
            description="Acme's billing",
            allow_private_networks=True,
        )
    assert ep.secret is not None and len(_key(ep.secret)) == 32
    assert ep.event_types == ("invoice.paid", "invoice.voided")  # duplicates dropped
    assert (ep.tenant, ep.rate_limit, ep.enabled) == ("acme", 5, True)
    assert ep.secret not in repr(ep)
    async with AsyncSession(aengine) as s:
        [listed] = await outbox.endpoints.list(s, destination="customer-events")
        assert listed.secret is None and "secret" not in listed.as_dict()
        assert await outbox.endpoints.list(s, tenant="other") == []
        shown = await outbox.endpoints.get(s, ep.id, show_secret=True)
        assert shown.secret == ep.secret
        stored = (await s.execute(text("SELECT secret FROM outbox_endpoints"))).scalar_one()
    assert stored == ep.secret  # no key configured: stored as given


async def test_a_rolled_back_registration_leaves_nothing(aengine: AsyncEngine) -> None:
    async with AsyncSession(aengine) as s:
        async with s.begin():
            await outbox.endpoints.create(
                s, destination="d", url=LOCAL, allow_private_networks=True
            )
            await s.rollback()
        assert await outbox.endpoints.list(s) == []


async def test_private_and_unresolvable_urls_are_refused_before_any_sql(
    aengine: AsyncEngine,
) -> None:
    async with AsyncSession(aengine) as s, s.begin():
        with pytest.raises(OutboxValidationError, match=r"non-public address.*127\.0\.0\.1"):
            await outbox.endpoints.create(s, destination="d", url=LOCAL)
        with pytest.raises(OutboxValidationError, match="non-public address"):
            await outbox.endpoints.create(s, destination="d", url="http://localhost:9/")
        with pytest.raises(OutboxValidationError, match="does not resolve"):
            await outbox.endpoints.create(s, destination="d", url="https://no-such-host.invalid/")
        with pytest.raises(OutboxValidationError, match="credentials"):
            await outbox.endpoints.create(s, destination="d", url="https://u:p@example.com/")
        with pytest.raises(OutboxValidationError, match="http:// or https://"):
            await outbox.endpoints.create(s, destination="d", url="ftp://example.com/")
        with pytest.raises(OutboxValidationError, match="event_types"):
            await outbox.endpoints.create(
                s, destination="d", url=LOCAL, event_types="invoice.paid", check_dns=False
            )
        with pytest.raises(OutboxValidationError, match="rate_limit"):
            await outbox.endpoints.create(
                s, destination="d", url=LOCAL, rate_limit=0, check_dns=False
            )
        with pytest.raises(OutboxValidationError, match="secret"):
            await outbox.endpoints.create(
                s, destination="d", url=LOCAL, secret="whsec_c2hvcnQ=", check_dns=False
            )
        # The transaction is still usable: nothing reached the database.
        assert (await s.execute(text("SELECT count(*) FROM outbox_endpoints"))).scalar() == 0


async def test_update_disable_enable_and_not_found(aengine: AsyncEngine) -> None:
    async with AsyncSession(aengine) as s, s.begin():
        ep = await outbox.endpoints.create(
            s,
            destination="d",
            url=LOCAL,
            tenant="acme",
            event_types=["a"],
            allow_private_networks=True,
        )
        changed = await outbox.endpoints.update(s, ep.id, tenant=None, event_types=[])
        assert (changed.tenant, changed.event_types, changed.url) == (None, (), LOCAL)
        moved = await outbox.endpoints.update(
            s, ep.id, url="http://127.0.0.1:10/x", allow_private_networks=True
        )
        assert (moved.url, moved.tenant) == ("http://127.0.0.1:10/x", None)
        off = await outbox.endpoints.disable(s, ep.id, reason="customer asked")
        assert (off.enabled, off.disabled_reason) == (False, "customer asked")
        on = await outbox.endpoints.enable(s, ep.id)
        assert (on.enabled, on.disabled_reason, on.disabled_at) == (True, None, None)
        with pytest.raises(EndpointNotFound, match="no endpoint 999"):
            await outbox.endpoints.disable(s, 999)
        with pytest.raises(EndpointNotFound):
            await outbox.endpoints.delete(s, 999)


async def test_rotate_keeps_the_previous_secret_for_a_while(aengine: AsyncEngine) -> None:
    async with AsyncSession(aengine) as s, s.begin():
        ep = await outbox.endpoints.create(
            s, destination="d", url=LOCAL, allow_private_networks=True
        )
        new = await outbox.endpoints.rotate_secret(s, ep.id, keep_previous=timedelta(hours=2))
        assert new.secret and new.secret != ep.secret
        assert new.previous_secret_until is not None
        left = new.previous_secret_until - datetime.now(UTC)
        assert timedelta(hours=1, minutes=59) < left <= timedelta(hours=2)
        row = (await s.execute(text("SELECT secret, previous_secret FROM outbox_endpoints"))).one()
        assert tuple(row) == (new.secret, ep.secret)


async def test_delete_cancels_unfinished_deliveries(aengine: AsyncEngine) -> None:
    async with AsyncSession(aengine) as s, s.begin():
        ep = await outbox.endpoints.create(
            s, destination="d", url=LOCAL, allow_private_networks=True
        )
        await s.execute(
            text(
                "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, status) "
                "VALUES (1, :e, 'd', 'pending'), (2, :e, 'd', 'running'), "
                "(3, :e, 'd', 'delivered')"
            ),
            {"e": ep.id},
        )
        assert await outbox.endpoints.delete(s, ep.id) == 2
        rows = (
            await s.execute(
                text("SELECT event_id, status, last_error FROM outbox_deliveries ORDER BY 1")
            )
        ).all()
    assert [tuple(r) for r in rows] == [
        (1, "cancelled", f"endpoint {ep.id} was deleted"),
        (2, "cancelled", f"endpoint {ep.id} was deleted"),
        (3, "delivered", None),
    ]


async def test_secrets_are_encrypted_at_rest_with_a_key(aengine: AsyncEngine) -> None:
    key = Fernet.generate_key().decode()
    sealed = Endpoints(secret_key=key)
    async with AsyncSession(aengine) as s, s.begin():
        ep = await sealed.create(s, destination="d", url=LOCAL, allow_private_networks=True)
        stored = (await s.execute(text("SELECT secret FROM outbox_endpoints"))).scalar_one()
        assert stored.startswith("enc:") and ep.secret and ep.secret not in stored
        assert (await sealed.get(s, ep.id, show_secret=True)).secret == ep.secret
        # Key rotation: a new key first, the old one still listed, reads the old secret.
        rotated = Endpoints(secret_key=f"{Fernet.generate_key().decode()},{key}")
        assert (await rotated.get(s, ep.id, show_secret=True)).secret == ep.secret
        with pytest.raises(OutboxError, match="OUTBOX_ENDPOINT_SECRET_KEY is not set"):
            await Endpoints(secret_key="").get(s, ep.id, show_secret=True)
        wrong = Endpoints(secret_key=Fernet.generate_key().decode())
        with pytest.raises(OutboxError, match="cannot be decrypted"):
            await wrong.get(s, ep.id, show_secret=True)
    with pytest.raises(OutboxError, match="not a Fernet key"):
        Endpoints(secret_key="not-a-key")


def test_the_sync_functions_work_on_a_session(sengine: Engine) -> None:
    with Session(sengine) as s, s.begin():
        ep = outbox.endpoints.create_sync(
            s, destination="d", url=LOCAL, event_types=["x"], allow_private_networks=True
        )
        assert outbox.endpoints.get_sync(s, ep.id).event_types == ("x",)
        assert [e.id for e in outbox.endpoints.list_sync(s)] == [ep.id]
        assert outbox.endpoints.update_sync(s, ep.id, rate_limit=3).rate_limit == 3
        assert not outbox.endpoints.disable_sync(s, ep.id).enabled
        assert outbox.endpoints.enable_sync(s, ep.id).enabled
        assert outbox.endpoints.rotate_secret_sync(s, ep.id).secret != ep.secret
        assert outbox.endpoints.delete_sync(s, ep.id) == 0
        assert outbox.endpoints.list_sync(s) == []
    with pytest.raises(TypeError, match="Session or Connection"), Session(sengine) as s:
        outbox.endpoints.list_sync(object())  # type: ignore[arg-type]


async def test_enqueue_stores_event_type_and_tenant(aengine: AsyncEngine) -> None:
    async with AsyncSession(aengine) as s, s.begin():
        one = await outbox.enqueue(
            s, destination="d", payload={}, event_type="invoice.paid", tenant="acme"
        )
        [two, three] = await outbox.enqueue_many(
            s,
            [
                {"destination": "d", "payload": {}, "event_type": "a.b"},
                {"destination": "d", "payload": {}},
            ],
        )
        rows = (
            await s.execute(text("SELECT id, event_type, tenant FROM outbox ORDER BY id"))
        ).all()
    assert [tuple(r) for r in rows] == [
        (one, "invoice.paid", "acme"),
        (two, "a.b", None),
        (three, None, None),
    ]
    async with AsyncSession(aengine) as s, s.begin():
        with pytest.raises(OutboxValidationError, match=r"event_type.*control"):
            await outbox.enqueue(s, destination="d", payload={}, event_type="a\nb")
        with pytest.raises(OutboxValidationError, match="tenant"):
            await outbox.enqueue(s, destination="d", payload={}, tenant="")


# --- review findings: each input is refused before SQL, or fails without harm -------------


async def test_enqueue_without_labels_works_before_migration_0006(aengine: AsyncEngine) -> None:
    """An app deployed before `migrate` ran must keep enqueueing (rolling upgrades)."""
    async with aengine.begin() as c:
        await c.execute(text("ALTER TABLE outbox DROP COLUMN event_type, DROP COLUMN tenant"))
    async with AsyncSession(aengine) as s, s.begin():
        await outbox.enqueue(s, destination="d", payload={})
        await outbox.enqueue_many(s, [{"destination": "d", "payload": {}}])
        assert (await s.execute(text("SELECT count(*) FROM outbox"))).scalar() == 2


async def test_a_database_error_never_shows_the_secret(aengine: AsyncEngine) -> None:
    async with AsyncSession(aengine) as s, s.begin():
        ep = await outbox.endpoints.create(
            s, destination="d", url=LOCAL, allow_private_networks=True
        )
    async with aengine.begin() as c:  # any database refusal will do
        await c.execute(text("ALTER TABLE outbox_endpoints ADD CHECK (length(description) < 3)"))
    for call in (
        lambda s: outbox.endpoints.create(
            s, destination="d", url=LOCAL, description="long", allow_private_networks=True
        ),
        lambda s: outbox.endpoints.update(s, ep.id, description="long"),
    ):
        async with AsyncSession(aengine) as s:
            with pytest.raises(Exception) as caught:
                await call(s)
            assert "whsec_" not in str(caught.value)
            assert "outbox_endpoints" in str(caught.value)  # still says what failed
    async with aengine.begin() as c:
        await c.execute(text("ALTER TABLE outbox_endpoints ADD CHECK (previous_secret IS NULL)"))
    async with AsyncSession(aengine) as s:
        with pytest.raises(Exception) as caught:
            await outbox.endpoints.rotate_secret(s, ep.id)
        assert "whsec_" not in str(caught.value)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda e, s: e.create(s, destination="d", url=LOCAL, rate_limit=2**31), "rate_limit"),
        (lambda e, s: e.update(s, 1, rate_limit=2**31), "rate_limit"),
        (lambda e, s: e.delete(s, 2**63), "endpoint_id"),
        (lambda e, s: e.get(s, 2**63), "endpoint_id"),
        (lambda e, s: e.disable(s, 2**63), "endpoint_id"),
        (lambda e, s: e.rotate_secret(s, 1, keep_previous=timedelta.max), "keep_previous"),
        (lambda e, s: e.list(s, destination="a\x00b"), "destination"),
        (lambda e, s: e.list(s, destination=123), "destination"),
        (lambda e, s: e.list(s, tenant="\ud800"), "tenant"),
        (
            lambda e, s: e.create(s, destination="d", url=LOCAL, event_types=["a", None]),
            "event_types",
        ),
        (lambda e, s: e.create(s, destination="d", url=LOCAL, event_types=[[1]]), "event_types"),
        (lambda e, s: e.create(s, destination="d", url=LOCAL, event_types={"a": 1}), "event_types"),
        (
            lambda e, s: e.create(s, destination="d", url=LOCAL, event_types=iter(int, 1)),
            "event_types",
        ),
    ],
)
async def test_out_of_range_input_is_refused_and_the_transaction_stays_usable(
    aengine: AsyncEngine, call: object, field: str
) -> None:
    api = Endpoints()
    async with AsyncSession(aengine) as s, s.begin():
        with pytest.raises(OutboxValidationError) as caught:
            await call(api, s)  # type: ignore[operator]
        assert caught.value.field == field
        assert (await s.execute(text("SELECT 1"))).scalar() == 1


def test_the_same_inputs_leave_a_psycopg_transaction_usable(sengine: Engine) -> None:
    with Session(sengine) as s, s.begin():
        for bad in (
            lambda: outbox.endpoints.delete_sync(s, 2**63),
            lambda: outbox.endpoints.update_sync(s, 1, rate_limit=2**31),
            lambda: outbox.endpoints.list_sync(s, destination=123),  # type: ignore[arg-type]
        ):
            with pytest.raises(OutboxValidationError):
                bad()
        assert s.execute(text("SELECT 1")).scalar() == 1


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]:6379/",
        "http://[::ffff:127.0.0.1]/",
        "http://10.0.0.5/",
    ],
)
async def test_skipping_dns_never_skips_the_address_check_of_an_ip(
    aengine: AsyncEngine, url: str
) -> None:
    async with AsyncSession(aengine) as s, s.begin():
        ep = await outbox.endpoints.create(
            s, destination="d", url=LOCAL, allow_private_networks=True, check_dns=False
        )
        with pytest.raises(OutboxValidationError, match="non-public"):
            await outbox.endpoints.create(s, destination="d", url=url, check_dns=False)
        with pytest.raises(OutboxValidationError, match="non-public"):
            await outbox.endpoints.update(s, ep.id, url=url, check_dns=False)


def test_a_star_import_does_not_shadow_builtins() -> None:
    scope: dict[str, object] = {}
    exec("from outbox.endpoints import *", scope)
    assert "list" not in scope and "get" not in scope and "Endpoints" in scope


async def test_rotation_defaults_to_24_hours_and_encrypts_both_secrets(
    aengine: AsyncEngine,
) -> None:
    sealed = Endpoints(secret_key=Fernet.generate_key().decode())
    async with AsyncSession(aengine) as s, s.begin():
        ep = await sealed.create(s, destination="d", url=LOCAL, allow_private_networks=True)
        new = await sealed.rotate_secret(s, ep.id)
        assert new.previous_secret_until is not None
        left = new.previous_secret_until - datetime.now(UTC)
        assert timedelta(hours=23, minutes=59) < left <= timedelta(hours=24)
        row = (await s.execute(text("SELECT secret, previous_secret FROM outbox_endpoints"))).one()
        assert all(v.startswith("enc:") for v in row)
        assert sealed.box.open(row[0]) == new.secret and sealed.box.open(row[1]) == ep.secret


async def test_only_a_change_of_what_relays_use_notifies_them(db_url: str) -> None:
    import asyncpg

    from outbox.dburl import to_asyncpg_dsn

    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    heard: list[str] = []
    await conn.add_listener("public.outbox", lambda *a: heard.append(a[3]))
    try:
        await conn.execute(
            "INSERT INTO outbox_endpoints (destination, url, secret) VALUES ('d', 'u', 's')"
        )
        await conn.execute("UPDATE outbox_endpoints SET failing_since = now()")
        await conn.execute("UPDATE outbox_endpoints SET last_success_at = now()")
        await conn.execute("UPDATE outbox_endpoints SET enabled = false")
        await conn.execute("DELETE FROM outbox_endpoints")
        await asyncio.sleep(0.2)
    finally:
        await conn.close()
    assert heard == ["endpoints"] * 3  # insert, enabled, delete: not the health columns


async def test_a_second_rotation_inside_the_window_is_refused_unless_dropping_now(
    aengine: AsyncEngine,
) -> None:
    async with AsyncSession(aengine) as s, s.begin():
        ep = await outbox.endpoints.create(
            s, destination="d", url=LOCAL, allow_private_networks=True
        )
        first = await outbox.endpoints.rotate_secret(s, ep.id)
        with pytest.raises(OutboxValidationError, match="still valid until"):
            await outbox.endpoints.rotate_secret(s, ep.id)
        row = (await s.execute(text("SELECT previous_secret FROM outbox_endpoints"))).one()
        assert row[0] == ep.secret  # the original keeps its promised window
        # A leaked secret: drop the previous one at once.
        second = await outbox.endpoints.rotate_secret(s, ep.id, keep_previous=timedelta(0))
        assert second.secret not in (first.secret, ep.secret)


async def test_updates_keep_history_straight(aengine: AsyncEngine) -> None:
    async with AsyncSession(aengine) as s, s.begin():
        ep = await outbox.endpoints.create(
            s, destination="d", url=LOCAL, allow_private_networks=True
        )
        await s.execute(text("UPDATE outbox_endpoints SET failing_since = now()"))
        same = await outbox.endpoints.update(s, ep.id, url=LOCAL, allow_private_networks=True)
        assert same.failing_since is not None  # the same URL: the same failures
        fixed = await outbox.endpoints.update(
            s, ep.id, url="http://127.0.0.1:10/", allow_private_networks=True
        )
        assert fixed.failing_since is None  # a new URL starts afresh
        off = await outbox.endpoints.disable(s, ep.id, reason="auto: failing for 5 days")
        again = await outbox.endpoints.disable(s, ep.id)
        assert (again.disabled_at, again.disabled_reason) == (off.disabled_at, off.disabled_reason)


async def test_deleting_a_missing_endpoint_touches_no_delivery(aengine: AsyncEngine) -> None:
    async with AsyncSession(aengine) as s, s.begin():
        await s.execute(
            text(
                "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination) "
                "VALUES (1, 77, 'd')"
            )
        )
        with pytest.raises(EndpointNotFound):
            await outbox.endpoints.delete(s, 77)
        status = (await s.execute(text("SELECT status FROM outbox_deliveries"))).scalar()
    assert status == "pending"
