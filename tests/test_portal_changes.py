"""The tenant portal's changes, test sends and replays (relay/portal/changes.py, replays.py)
against a real database: each acts on the tenant's own endpoints and messages only; another
tenant's id is refused as an absent one, and nothing of theirs changes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from cryptography.fernet import Fernet

from relay.ops.selection import SelectionChanged
from relay.portal import changes, reads, replays
from relay.portal.scope import Scope
from tests.support.fan_outs import conn_fixture  # noqa: F401  (the conn fixture)
from tests.support.receiver import Receiver
from tests.support.relays import running, wait_until
from tests.test_endpoint_delivery import DEST, delivered_to, endpoints_settings

A = Scope("a", "tok-a", True, "public")
B = Scope("b", "tok-b", True, "public")
A_READS = Scope("a", "tok-r", False, "public")
LOCAL = changes.Policy((DEST,), max_endpoints=3, allow_private_networks=True)
URL = "http://127.0.0.1:9/in"

SNAPSHOT = (
    "SELECT (SELECT json_agg(e ORDER BY id) FROM outbox_endpoints e WHERE tenant = 'b'),"
    " (SELECT json_agg(d ORDER BY id) FROM outbox_deliveries d),"
    " (SELECT count(*) FROM outbox)"
)


async def failed_message(conn: asyncpg.Connection, endpoint_id: int, tenant: str) -> int:
    """A message of ``tenant`` to the endpoint, failed after its attempts."""
    event = await conn.fetchval(
        "INSERT INTO outbox (destination, payload, content_type, tenant, status)"
        " VALUES ($1, '{}', 'application/json', $2, 'delivered') RETURNING id",
        DEST,
        tenant,
    )
    return int(
        await conn.fetchval(
            "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, status,"
            " attempts, finished_at) VALUES ($1, $2, $3, 'failed', 4, now()) RETURNING id",
            event,
            endpoint_id,
            DEST,
        )
    )


async def test_another_tenants_endpoint_is_refused_as_absent_and_left_as_it_was(
    conn: asyncpg.Connection,
) -> None:
    theirs = await changes.create(conn, B, LOCAL, url=URL)
    message = await failed_message(conn, theirs.id, "b")
    before = await conn.fetchrow(SNAPSHOT)
    attempts: list[Callable[[int], Any]] = [
        lambda i: changes.update(conn, A, LOCAL, i, {"description": "mine now"}),
        lambda i: changes.disable(conn, A, i, "no"),
        lambda i: changes.enable(conn, A, i),
        lambda i: changes.delete(conn, A, i),
        lambda i: changes.rotate_secret(conn, A, i, timedelta(hours=1)),
        lambda i: changes.send_test(conn, A, i),
    ]
    for act in attempts:
        for target in (theirs.id, 999_999):
            with pytest.raises(reads.NotFound):
                await act(target)
    for target in (message, 999_999):
        with pytest.raises(reads.NotFound):
            await replays.replay_message(conn, A, target)
    with pytest.raises(reads.NotFound):
        await replays.count(conn, A, replays.Window(3600, endpoint_id=theirs.id))
    assert await conn.fetchrow(SNAPSHOT) == before


async def test_an_endpoint_is_added_for_the_tenant_with_the_operators_rules(
    conn: asyncpg.Connection,
) -> None:
    made = await changes.create(conn, A, LOCAL, url=URL, event_types=["order.paid"])
    assert made.tenant == "a" and made.destination == DEST and made.secret
    assert made.secret.startswith("whsec_")
    listed = await reads.endpoints(conn, A)
    assert [e.id for e in listed.items] == [made.id]
    strict = changes.Policy((DEST,))
    with pytest.raises(changes.Refused, match="public addresses"):
        await changes.create(conn, A, strict, url=URL)  # loopback: not for tenants by default
    with pytest.raises(changes.Refused, match="destination"):
        await changes.create(conn, A, LOCAL, url=URL, destination="kafka-orders")
    for _ in range(2):
        await changes.create(conn, A, LOCAL, url=URL)
    with pytest.raises(changes.Conflict, match="3 endpoints"):
        await changes.create(conn, A, LOCAL, url=URL)
    await changes.create(conn, B, LOCAL, url=URL)  # the bound is per tenant


async def test_only_what_a_tenant_may_change_is_changed(conn: asyncpg.Connection) -> None:
    ep = await changes.create(conn, A, LOCAL, url=URL)
    updated = await changes.update(conn, A, LOCAL, ep.id, {"description": "ours", "rate_limit": 5})
    assert updated.description == "ours" and updated.rate_limit == 5
    for field in ("tenant", "destination", "allow_private_networks", "secret"):
        with pytest.raises(changes.Refused, match="only"):
            await changes.update(conn, A, LOCAL, ep.id, {field: "b"})
    assert not (await changes.disable(conn, A, ep.id, "maintenance")).enabled
    assert (await changes.enable(conn, A, ep.id)).enabled
    assert await changes.delete(conn, A, ep.id) == 0
    with pytest.raises(reads.NotFound):
        await reads.endpoint(conn, A, ep.id)


async def test_a_read_only_token_changes_nothing(conn: asyncpg.Connection) -> None:
    ep = await changes.create(conn, A, LOCAL, url=URL)
    with pytest.raises(PermissionError):
        await changes.create(conn, A_READS, LOCAL, url=URL)
    with pytest.raises(PermissionError):
        await changes.disable(conn, A_READS, ep.id)
    with pytest.raises(PermissionError):
        await changes.send_test(conn, A_READS, ep.id)
    with pytest.raises(PermissionError):
        await replays.count(conn, A_READS, replays.Window(60))
    assert (await reads.endpoint(conn, A_READS, ep.id)).enabled


async def test_a_rotated_secret_is_shown_once_and_stored_encrypted(
    conn: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_ENDPOINT_SECRET_KEY", Fernet.generate_key().decode())
    ep = await changes.create(conn, A, LOCAL, url=URL)
    rotated = await changes.rotate_secret(conn, A, ep.id, timedelta(hours=2))
    assert rotated.secret and rotated.secret != ep.secret
    stored = await conn.fetchrow(
        "SELECT secret, previous_secret FROM outbox_endpoints WHERE id = $1", ep.id
    )
    assert stored["secret"].startswith("enc:") and stored["previous_secret"].startswith("enc:")
    listed = await reads.endpoints(conn, A)
    assert "secret" not in str(listed) and rotated.secret not in str(listed)


async def test_a_test_event_goes_to_that_endpoint_only_and_a_relay_delivers_it(
    db_url: str,
    conn: asyncpg.Connection,
    make_receiver: Callable[..., Receiver],
) -> None:
    target, other = make_receiver(), make_receiver()
    ep = await changes.create(conn, A, LOCAL, url=target.url)
    await changes.create(conn, A, LOCAL, url=other.url)  # the tenant's too, same destination
    picky = await changes.create(conn, A, LOCAL, url=other.url, event_types=["order.paid"])
    with pytest.raises(changes.Refused, match="does not take"):
        await changes.send_test(conn, A, picky.id)
    async with running(endpoints_settings(db_url)):
        sent = await changes.send_test(conn, A, ep.id)
        await wait_until(lambda: delivered_to(target) == [sent.event_id], what="delivered")
    assert other.requests == []
    body = json.loads(target.requests[0].body)
    assert body["type"] == "outbox.test" and body["endpoint_id"] == ep.id
    [message] = (await reads.messages(conn, A, reads.MessageFilters(endpoint_id=ep.id))).items
    assert message.id == sent.delivery_id and message.status == "delivered"
    await changes.disable(conn, A, ep.id)
    with pytest.raises(changes.Conflict, match="disabled"):
        await changes.send_test(conn, A, ep.id)


async def test_a_failed_message_is_replayed(conn: asyncpg.Connection) -> None:
    ep = await changes.create(conn, A, LOCAL, url=URL)
    message = await failed_message(conn, ep.id, "a")
    done = await replays.replay_message(conn, A, message)
    assert done.replayed == 1
    row = await conn.fetchrow("SELECT status, replay FROM outbox_deliveries WHERE id = $1", message)
    assert row["status"] == "pending" and row["replay"]


async def test_a_window_is_counted_then_sent_exactly_as_counted(conn: asyncpg.Connection) -> None:
    e1 = await changes.create(conn, A, LOCAL, url=URL)
    e2 = await changes.create(conn, A, LOCAL, url=URL)
    theirs = await changes.create(conn, B, LOCAL, url=URL)
    for ep in (e1, e1, e2):
        await failed_message(conn, ep.id, "a")
    await failed_message(conn, theirs.id, "b")
    window = replays.Window(3600, failed_only=True)
    counted = await replays.count(conn, A, window)
    assert counted.total == 3 and set(counted.selections) == {e1.id, e2.id}
    late = await failed_message(conn, e2.id, "a")  # failed since the count: not counted
    done = await replays.replay(conn, A, window, counted.selections)
    assert sum(r.replayed for r in done) == 3
    assert await conn.fetchval("SELECT status FROM outbox_deliveries WHERE id = $1", late) == (
        "failed"
    )
    counted = await replays.count(conn, A, window)
    assert counted.total == 1
    # Another session sends it meanwhile: what was counted is no longer what matches.
    await conn.execute("UPDATE outbox_deliveries SET status = 'delivered' WHERE id = $1", late)
    with pytest.raises(SelectionChanged):
        await replays.replay(conn, A, window, counted.selections)
    theirs_left = await conn.fetchval(
        "SELECT status FROM outbox_deliveries WHERE endpoint_id = $1", theirs.id
    )
    assert theirs_left == "failed"
    with pytest.raises(ValueError, match="window"):
        replays.Window(0)


async def test_an_endpoint_handed_over_replays_nothing_from_before(
    conn: asyncpg.Connection,
) -> None:
    ep = await changes.create(conn, B, LOCAL, url=URL)
    before = await failed_message(conn, ep.id, "b")
    await conn.execute("UPDATE outbox_endpoints SET tenant = 'a' WHERE id = $1", ep.id)
    await conn.execute("DELETE FROM outbox")  # the events gone: only tenant_since tells
    # A window starts a few milliseconds after the handover (replays._seconds): a message
    # made within them is left out (never one made before).
    await asyncio.sleep(0.2)
    after = await failed_message(conn, ep.id, "a")
    with pytest.raises(reads.NotFound):
        await replays.replay_message(conn, A, before)
    counted = await replays.count(conn, A, replays.Window(3600))
    [per] = counted.per_endpoint
    assert per.replayed == 1 and per.skipped_event_gone == 0 and per.skipped_not_taken == 0
    await replays.replay(conn, A, replays.Window(3600), counted.selections)
    statuses = dict(await conn.fetch("SELECT id, status FROM outbox_deliveries"))
    assert statuses == {before: "failed", after: "pending"}
