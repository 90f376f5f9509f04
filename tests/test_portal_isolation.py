"""Isolation of tenants in the portal's API, as a property: for random tenants, endpoints (of a
tenant, of every tenant, handed from one tenant to another), events of matching and other
tenants, deliveries in every state and their attempts, no call with tenant A's token returns,
counts or changes anything that is not A's, whatever id it names (every id in the database,
and ids never used), and an id of another tenant is answered as one never used, byte for
byte."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.routing import Mount

from outbox.dburl import to_asyncpg_dsn
from outbox.endpoints import portal_tokens as pt
from relay.portal.app import build_portal
from relay.portal.changes import Policy
from relay.portal.limits import Limits, Rate

TENANTS = ("a", "b", "c")
STATUSES = ("pending", "running", "delivered", "failed", "cancelled")
DEST = "d"
UNUSED = 9_000_000


@dataclass
class World:
    endpoints: dict[int, str | None]  # id: tenant now
    deliveries: dict[int, tuple[int, str, bool, bool]]  # id: endpoint, event tenant, before, kept
    marks: dict[int, int]  # delivery id: its number in the payload and answer ("payload-3x")
    urls: dict[int, int]  # endpoint id: its number in its url and description ("url-1x")
    handed: set[int]  # endpoints whose tenant was changed

    def foreign(self, tenant: str, mine: set[int]) -> list[str]:
        """The texts of what is not ``tenant``'s to see: endpoints not its own now, the
        payloads and answers of messages it may not see."""
        out = [f"url-{n}x" for e, n in self.urls.items() if self.endpoints[e] != tenant]
        out += [f"description-{n}x" for e, n in self.urls.items() if self.endpoints[e] != tenant]
        for did, n in self.marks.items():
            if did not in mine:
                out += [f"payload-{n}x", f"answer-{n}x"]
        return out


# A's endpoints and messages come up more often than the others' (half of the endpoints):
# what A must not see is found among them, and a rule that fails shows in fewer examples.
endpoint_specs = st.lists(
    st.tuples(st.sampled_from(("a", "a", "a", "b", "c", None)), st.sampled_from((None, *TENANTS))),
    min_size=1,
    max_size=5,
)  # (tenant at creation, tenant handed over to, if any)
delivery_specs = st.lists(
    st.tuples(
        st.integers(0, 4),  # endpoint (modulo)
        st.sampled_from(TENANTS),  # the event's tenant
        st.sampled_from(STATUSES),
        st.booleans(),  # made before the handover, if any
        st.booleans(),  # its event deleted since (retention)
    ),
    max_size=12,
)


async def build(conn: asyncpg.Connection, eps: list[Any], dels: list[Any]) -> World:
    await conn.execute("TRUNCATE outbox, outbox_endpoints, outbox_deliveries, outbox_attempts")
    ids, handed = [], []
    for n, (tenant, to) in enumerate(eps):
        url = f"http://127.0.0.1:9/url-{n}x"
        eid = await conn.fetchval(
            "INSERT INTO outbox_endpoints (destination, url, tenant, secret, description)"
            " VALUES ($1, $2, $3, 'whsec_x', $4) RETURNING id",
            DEST, url, tenant, f"description-{n}x",
        )  # fmt: skip
        ids.append(eid)
        handed.append(to if to != tenant else None)
    world = World({}, {}, {}, {eid: n for n, eid in enumerate(ids)}, set())
    for before in (True, False):
        for n, (ep, event_tenant, status, made_before, gone) in enumerate(dels):
            if made_before != before:
                continue
            eid = ids[ep % len(ids)]
            event = await conn.fetchval(
                "INSERT INTO outbox (destination, payload, content_type, tenant, event_type,"
                " status) VALUES ($1, $2, 'application/json', $3, $4, 'delivered') RETURNING id",
                DEST, f'"payload-{n}x"'.encode(), event_tenant,
                f"type-of-{event_tenant}",
            )  # fmt: skip
            did = await conn.fetchval(
                "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, status,"
                " attempts) VALUES ($1, $2, $3, $4, 1) RETURNING id",
                event, eid, DEST, status,
            )  # fmt: skip
            await conn.execute(
                "INSERT INTO outbox_attempts (delivery_id, event_id, endpoint_id, http_status,"
                " response) VALUES ($1, $2, $3, 500, $4)",
                did, event, eid, f"answer-{n}x",
            )  # fmt: skip
            if gone:
                await conn.execute("DELETE FROM outbox WHERE id = $1", event)
            world.deliveries[did] = (eid, event_tenant, before, not gone)
            world.marks[did] = n
        if before:  # the handovers, between the deliveries made before and after
            for eid, to in zip(ids, handed, strict=True):
                if to is not None:
                    await conn.execute(
                        "UPDATE outbox_endpoints SET tenant = $2 WHERE id = $1", eid, to
                    )
                    world.handed.add(eid)
    for eid, (tenant, to) in zip(ids, eps, strict=True):
        world.endpoints[eid] = to if to is not None and to != tenant else tenant
    # The before-deliveries of endpoints never handed over are theirs as any other.
    for did, (eid, et, before, kept) in list(world.deliveries.items()):
        n = ids.index(eid)
        if before and handed[n] is None:
            world.deliveries[did] = (eid, et, False, kept)
    return world


def visible(world: World, tenant: str) -> set[int]:
    """The model: the messages ``tenant`` may see: to its endpoints, made since each became
    its own, of its own events; of events retention deleted, only on an endpoint never handed
    over (only the event would say whose the message was)."""
    return {
        did
        for did, (eid, event_tenant, before, kept) in world.deliveries.items()
        if world.endpoints[eid] == tenant
        and not before
        and ((kept and event_tenant == tenant) or (not kept and eid not in world.handed))
    }


SNAPSHOT = (
    "SELECT (SELECT coalesce(json_agg(e ORDER BY id), '[]') FROM outbox_endpoints e"
    "  WHERE tenant IS DISTINCT FROM $1),"
    " (SELECT coalesce(json_agg(d ORDER BY id), '[]') FROM outbox_deliveries d"
    "  WHERE NOT (d.id = ANY($2::bigint[]))),"
    " (SELECT count(*) FROM outbox_attempts)"
)


@pytest.fixture
async def setup(db_url: str) -> AsyncIterator[tuple[asyncpg.Connection, httpx.AsyncClient]]:
    keys = pt.PortalKeys.parse(pt.new_portal_key())
    inner = build_portal(db_url, keys, Policy((DEST,), allow_private_networks=True))
    inner.state.portal.limits = inner.state.portal.write_limits = Limits(Rate(1e6, 1e6))
    app = Starlette(routes=[Mount("/portal", app=inner)])
    token = pt.portal_token(tenant="a", key=keys)
    access = pt.verify_portal_token(token, key=keys)
    session = pt.session_token(access, key=keys)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    transport = httpx.ASGITransport(app=app)
    # The API with the bearer token; the pages (http://portal/portal/...) with the session.
    client = httpx.AsyncClient(
        transport=transport,
        base_url="http://portal/portal/api",
        headers={"authorization": f"Bearer {token}", "cookie": f"outbox_portal={session}"},
    )
    try:
        yield conn, client
    finally:
        await client.aclose()
        await inner.state.portal.close()
        await conn.close()


async def walk(
    client: httpx.AsyncClient, foreign: list[str], path: str, **params: Any
) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        asked = {**params, "limit": 2, **({"cursor": cursor} if cursor else {})}
        r = await client.get(path, params=asked)
        assert r.status_code == 200, r.text
        assert not any(f in r.text for f in foreign), r.text
        items += r.json()["items"]
        cursor = r.json()["next_cursor"]
        if cursor is None:
            return items


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(eps=endpoint_specs, dels=delivery_specs, data=st.data())
async def test_tenant_a_sees_and_changes_only_its_own(
    setup: tuple[asyncpg.Connection, httpx.AsyncClient],
    eps: list[Any],
    dels: list[Any],
    data: st.DataObject,
) -> None:
    conn, client = setup
    world = await build(conn, eps, dels)
    mine_eps = {e for e, t in world.endpoints.items() if t == "a"}
    mine = visible(world, "a")
    foreign = world.foreign("a", mine)
    assert {e["id"] for e in await walk(client, foreign, "/endpoints")} == mine_eps
    assert {m["id"] for m in await walk(client, foreign, "/messages")} == mine
    for status in STATUSES:
        got = {m["id"] for m in await walk(client, foreign, "/messages", status=status)}
        assert got <= mine
    absent_endpoint = (await client.get(f"/endpoints/{UNUSED}")).text
    absent_message = (await client.get(f"/messages/{UNUSED}")).text
    for eid in world.endpoints:
        r = await client.get(f"/endpoints/{eid}")
        if eid in mine_eps:
            counts = r.json()["deliveries"]
            ours = [d for d in mine if world.deliveries[d][0] == eid]
            assert sum(counts.values()) == len(ours)
        else:
            assert r.text == absent_endpoint
        got = {m["id"] for m in await walk(client, foreign, "/messages", endpoint_id=eid)}
        assert got == {d for d in mine if world.deliveries[d][0] == eid}
    for did in world.deliveries:
        for path in (f"/messages/{did}", f"/messages/{did}/attempts"):
            r = await client.get(path)
            assert not any(f in r.text for f in foreign), r.text
            if did not in mine:
                assert r.text == absent_message
    # The pages, signed in as A, for every id: nothing of another tenant's either.
    pages = ["/endpoints", "/messages", "/replay"]
    pages += [f"/endpoints/{e}" for e in world.endpoints]
    pages += [f"/messages/{d}" for d in world.deliveries]
    for path in pages:
        r = await client.get(f"http://portal/portal{path}")
        assert r.status_code in (200, 404), (path, r.status_code)
        assert not any(f in r.text for f in foreign), (path, r.text)
    # Changes with A's token, on every id: nothing but A's changes.
    before = await conn.fetchrow(SNAPSHOT, "a", list(mine))
    for eid in world.endpoints:
        if eid in mine_eps:
            continue
        for method, path, body in (
            ("PATCH", f"/endpoints/{eid}", {"description": "taken"}),
            ("POST", f"/endpoints/{eid}/disable", {}),
            ("POST", f"/endpoints/{eid}/enable", None),
            ("POST", f"/endpoints/{eid}/rotate-secret", {}),
            ("POST", f"/endpoints/{eid}/test", {}),
            ("DELETE", f"/endpoints/{eid}", None),
        ):
            r = await client.request(method, path, json=body)
            assert r.status_code == 404, (method, path, r.text)
    for did in world.deliveries:
        r = await client.post(f"/messages/{did}/replay")
        assert r.status_code in ((202, 404) if did in mine else (404,)), r.text
    window = data.draw(st.sampled_from((60.0, 86400.0)))
    counted = await client.post("/replays", json={"since_seconds": window})
    assert counted.status_code == 200, counted.text
    assert {e["endpoint_id"] for e in counted.json()["endpoints"]} == mine_eps
    done = await client.post(
        "/replays", json={"since_seconds": window, "selection": counted.json()["selection"]}
    )
    assert done.status_code in (200, 409), done.text
    after = await conn.fetchrow(SNAPSHOT, "a", list(mine))
    assert json.loads(after[0]) == json.loads(before[0])
    assert json.loads(after[1]) == json.loads(before[1])
    assert after[2] == before[2]
