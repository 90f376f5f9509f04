"""The tenant portal's API over real HTTP (uvicorn on loopback) and a real database: tokens,
rights, limits, the problems it answers, the audit log, and a tenant's whole round of use."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from openapi_spec_validator import validate
from structlog.testing import capture_logs

from outbox.endpoints import portal_tokens as pt
from relay.catalog.view import load_view
from relay.portal.limits import Limits, Rate
from tests.support import catalogs
from tests.support.portal import Served, served_portal

URL = "http://127.0.0.1:9/in"


@pytest.fixture
async def portal(db_url: str) -> AsyncIterator[Served]:
    async with served_portal(db_url) as p:
        # The limits have a test of their own; here they would only slow the others.
        p.state.write_limits = p.state.limits = Limits(Rate(per_second=1000, burst=1000))
        yield p


@pytest.fixture
async def with_catalog(db_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    """The portal on the catalog's endpoints destination, with the catalog."""
    view = load_view(catalogs.write_export(tmp_path), None)
    async with served_portal(db_url, catalog=view) as p:
        p.state.write_limits = p.state.limits = Limits(Rate(per_second=1000, burst=1000))
        yield p


async def test_the_document_is_valid_openapi_and_served_without_a_token(portal: Served) -> None:
    async with portal.client() as c:
        r = await c.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    validate(doc)
    assert doc["openapi"] == "3.1.0" and len(doc["paths"]) == 12
    assert (
        r.headers["x-frame-options"] == "DENY"
        and "default-src 'none'" in r.headers["content-security-policy"]
    )


async def test_every_bad_token_gets_one_answer_and_the_log_says_which(portal: Served) -> None:
    other = pt.PortalKeys.parse(pt.new_portal_key())
    past = datetime.now(UTC) - timedelta(hours=2)
    tokens = {
        "none": None,
        "malformed": "Bearer abc",
        "unknown_key": "Bearer " + pt.portal_token(tenant="a", key=other),
        "expired": "Bearer " + pt.portal_token(tenant="a", key=portal.keys, ttl=60, now=past),
        "audience": "Bearer " + pt.portal_token(tenant="a", key=portal.keys, schema="billing"),
        "basic": "Basic YTpi",
    }
    answers = set()
    with capture_logs() as logs:
        async with portal.client() as c:
            for header in tokens.values():
                headers = {"authorization": header} if header else {}
                r = await c.get("/endpoints", headers=headers)
                assert r.status_code == 401
                assert r.headers["www-authenticate"] == 'Bearer error="invalid_token"'
                assert r.headers["content-type"] == "application/problem+json"
                answers.add(r.text)
    assert len(answers) == 1
    reasons = [e["reason"] for e in logs if e["event"] == "relay.portal.token_refused"]
    assert reasons == ["none", "malformed", "unknown_key", "expired", "audience", "none"]
    for header in tokens.values():
        if header:
            assert not any(header.split(" ")[1] in str(e) for e in logs)


async def test_a_read_only_token_reads_and_may_not_write(portal: Served) -> None:
    async with portal.client("a", read_only=True) as c:
        assert (await c.get("/endpoints")).status_code == 200
        r = await c.post("/endpoints", json={"url": URL})
        assert r.status_code == 403 and r.json()["title"] == "Forbidden"
        assert (await c.post("/replays", json={"since_seconds": 60})).status_code == 403


async def test_bodies_too_large_or_not_json_and_unknown_fields_are_refused(
    portal: Served,
) -> None:
    async with portal.client("a") as c:
        r = await c.post("/endpoints", content=b"{" + b" " * 17_000 + b"}",
                         headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 413
        r = await c.post("/endpoints", content=b"url=x", headers={"content-type": "text/plain"})
        assert r.status_code == 415
        for body in ({"url": URL, "tenant": "b"}, {"url": URL, "allow_private_networks": True}):
            r = await c.post("/endpoints", json=body)
            assert r.status_code == 400 and "extra" in r.json()["detail"].lower()
        r = await c.get("/messages", params={"limit": "0"})
        assert r.status_code == 400
        r = await c.get("/messages", params={"since": "yesterday"})
        assert r.status_code == 400 and "since" in r.json()["detail"]


async def test_a_tenants_requests_are_limited_with_retry_after(portal: Served) -> None:
    portal.state.limits = Limits(Rate(per_second=0.5, burst=3))
    portal.state.write_limits = Limits(Rate(per_second=0.5, burst=1))
    async with portal.client("a") as a, portal.client("b") as b:
        codes = [(await a.get("/endpoints")).status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429]
        r = await a.get("/endpoints")
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert (await b.get("/endpoints")).status_code == 200  # another tenant's own bucket
        # Writes have a bucket of their own besides.
        assert (await b.post("/endpoints", json={"url": URL})).status_code == 201
        assert (await b.post("/endpoints", json={"url": URL})).status_code == 429


async def test_another_tenants_ids_answer_as_absent_ones(portal: Served) -> None:
    async with portal.client("b") as b:
        theirs = (await b.post("/endpoints", json={"url": URL})).json()["id"]
    async with portal.client("a") as a:
        for path in (f"/endpoints/{theirs}", f"/endpoints/{theirs + 1000}"):
            answers = {
                (await a.get(path)).text,
                (await a.patch(path, json={"description": "x"})).text,
                (await a.delete(path)).text,
                (await a.post(path + "/disable")).text,
                (await a.post(path + "/rotate-secret")).text,
                (await a.post(path + "/test")).text,
            }
            assert len(answers) == 1 and '"status":404' in answers.pop()
        assert (await a.get("/endpoints/9223372036854775808")).status_code == 404


async def test_a_tenants_round_endpoint_test_message_attempts_replay(portal: Served) -> None:
    with capture_logs() as logs:
        async with portal.client("a") as c:
            r = await c.post("/endpoints", json={"url": URL, "description": "first"})
            assert r.status_code == 201 and r.json()["secret"].startswith("whsec_")
            ep = r.json()["id"]
            r = await c.patch(f"/endpoints/{ep}", json={"description": "ours", "rate_limit": 9})
            assert r.json()["description"] == "ours" and r.json()["rate_limit"] == 9
            r = await c.patch(f"/endpoints/{ep}", json={"no_rate_limit": True})
            assert r.json()["rate_limit"] is None
            r = await c.post(f"/endpoints/{ep}/test", json={})
            assert r.status_code == 202
            message = r.json()["message_id"]
            [m] = (await c.get("/messages", params={"endpoint_id": ep})).json()["items"]
            assert m["id"] == message and m["event_type"] == "outbox.test"
            detail = (await c.get(f"/messages/{message}")).json()
            assert detail["payload_encoding"] == "utf-8" and '"test": true' in detail["payload"]
            assert (await c.get(f"/messages/{message}/attempts")).json()["items"] == []
            counted = (await c.post("/replays", json={"since_seconds": 3600})).json()
            assert counted["done"] is False and counted["selection"]
            r = await c.post("/replays", json={"since_seconds": 3600, "selection": "x.y"})
            assert r.status_code == 400
            r = await c.post(
                "/replays", json={"since_seconds": 60, "selection": counted["selection"]}
            )
            assert r.status_code == 400  # the count of another window
            r = await c.post(
                "/replays", json={"since_seconds": 3600, "selection": counted["selection"]}
            )
            assert r.status_code == 200 and r.json()["done"] is True
            assert (await c.post(f"/endpoints/{ep}/disable", json={"reason": "x"})).json()[
                "enabled"
            ] is False
            assert (await c.post(f"/endpoints/{ep}/enable")).json()["enabled"] is True
            r = await c.post(f"/endpoints/{ep}/rotate-secret", json={"keep_previous_hours": 1})
            assert r.json()["previous_secret_until"] is not None
            r = await c.delete(f"/endpoints/{ep}")
            assert r.json().get("id") == ep, r.text
    actions = [e["action"] for e in logs if e["event"] == "relay.portal.action"]
    assert "createEndpoint" in actions and "deleteEndpoint" in actions
    assert all(e.get("tenant") == "a" for e in logs if e["event"] == "relay.portal.action")
    assert not any("whsec_" in str(e) for e in logs)


async def test_an_unknown_path_or_method_is_a_problem(portal: Served) -> None:
    async with portal.client("a") as c:
        assert (await c.get("/nothing")).status_code == 404
        r = await c.put("/endpoints")
        assert r.status_code == 405


async def test_the_event_types_are_those_of_the_portals_destinations(
    with_catalog: Served,
) -> None:
    answers = []
    for tenant, read_only in (("a", False), ("b", True)):
        async with with_catalog.client(tenant, read_only=read_only) as c:
            r = await c.get("/event-types")
            assert r.status_code == 200
            answers.append(r.json())
    assert answers[0] == answers[1]  # the same for every tenant: nothing of theirs in it
    items = answers[0]["items"]
    # stock.moved is carried by Kafka only: never offered to a tenant.
    assert [t["name"] for t in items] == ["invoice.paid", "order.created"]
    declared = {t["name"]: t for t in catalogs.shop_catalog().export()["types"]}
    for t in items:
        assert set(t) == {"name", "version", "description", "deprecated", "schema", "examples"}
        assert t["schema"] == declared[t["name"]]["schema"]
        assert t["examples"] == declared[t["name"]]["examples"]
        assert t["version"] == declared[t["name"]]["version"]
    assert items[0]["deprecated"] is True and items[1]["version"] == 3
    assert items[1]["description"].startswith("An order was placed <script>")  # JSON: as is
    async with with_catalog.client() as c:
        assert (await c.get("/event-types")).status_code == 401


async def test_with_a_catalog_an_unknown_event_type_is_refused_by_name(
    with_catalog: Served,
) -> None:
    async with with_catalog.client("a") as c:
        r = await c.post("/endpoints", json={"url": URL, "event_types": ["invoice.payed"]})
        assert r.status_code == 400 and r.headers["content-type"] == "application/problem+json"
        detail = r.json()["detail"]
        assert "'invoice.payed'" in detail and "did you mean 'invoice.paid'" in detail
        r = await c.post("/endpoints", json={"url": URL, "event_types": ["stock.moved"]})
        assert r.status_code == 400 and "'stock.moved'" in r.json()["detail"]  # Kafka's only
        assert (await c.get("/endpoints")).json()["items"] == []  # nothing made
        types = ["order.created", "invoice.paid"]
        r = await c.post("/endpoints", json={"url": URL, "event_types": types})
        assert r.status_code == 201 and r.json()["event_types"] == types
        ep = r.json()["id"]
        r = await c.patch(f"/endpoints/{ep}", json={"event_types": ["order.created", "nope"]})
        assert r.status_code == 400 and "'nope'" in r.json()["detail"]
        assert (await c.get(f"/endpoints/{ep}")).json()["event_types"] == types  # unchanged
        r = await c.patch(f"/endpoints/{ep}", json={"event_types": []})  # every type
        assert r.status_code == 200 and r.json()["event_types"] == []


async def test_without_a_catalog_no_type_is_listed_and_any_is_taken(portal: Served) -> None:
    async with portal.client("a") as c:
        assert (await c.get("/event-types")).json() == {"items": []}
        r = await c.post("/endpoints", json={"url": URL, "event_types": ["anything.goes"]})
        assert r.status_code == 201 and r.json()["event_types"] == ["anything.goes"]
        r = await c.patch(f"/endpoints/{r.json()['id']}", json={"event_types": ["x.y"]})
        assert r.status_code == 200


async def test_a_catalog_that_failed_to_load_changes_nothing(db_url: str) -> None:
    view = load_view("no_such_catalog_module_31:catalog", None)
    assert view is not None and not view.available
    async with served_portal(db_url, catalog=view) as p, p.client("a") as c:
        assert (await c.get("/event-types")).json() == {"items": []}
        r = await c.post("/endpoints", json={"url": URL, "event_types": ["anything.goes"]})
        assert r.status_code == 201


def test_the_portal_is_a_command(tmp_path: object) -> None:
    from click.testing import CliRunner

    from relay.cli import main

    out = CliRunner().invoke(main, ["portal", "--help"])
    assert out.exit_code == 0 and "openapi.json" in out.output
    out = CliRunner().invoke(
        main,
        ["portal", "--database-url", "postgresql://x@127.0.0.1:9/x", "--destination", "d"],
        env={pt.KEY_VARIABLE: ""},
    )
    assert out.exit_code == 2 and "OUTBOX_PORTAL_KEY" in out.output


_ = httpx
