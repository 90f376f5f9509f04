"""The tenant portal's API over real HTTP (uvicorn on loopback) and a real database: tokens,
rights, limits, the problems it answers, the audit log, and a tenant's whole round of use."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from openapi_spec_validator import validate
from structlog.testing import capture_logs

from outbox.endpoints import portal_tokens as pt
from relay.portal.limits import Limits, Rate
from tests.support.portal import Served, served_portal

URL = "http://127.0.0.1:9/in"


@pytest.fixture
async def portal(db_url: str) -> AsyncIterator[Served]:
    async with served_portal(db_url) as p:
        # The limits have a test of their own; here they would only slow the others.
        p.state.write_limits = p.state.limits = Limits(Rate(per_second=1000, burst=1000))
        yield p


async def test_the_document_is_valid_openapi_and_served_without_a_token(portal: Served) -> None:
    async with portal.client() as c:
        r = await c.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    validate(doc)
    assert doc["openapi"] == "3.1.0" and len(doc["paths"]) == 11
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
