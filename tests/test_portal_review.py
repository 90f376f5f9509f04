"""Found by a hostile review of the tenant portal (#30): each test failed on the code as
reviewed (2715954) and passes with its fix."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest

from outbox.dburl import to_asyncpg_dsn
from outbox.endpoints import portal_tokens as pt
from relay.portal import reads, sessions
from relay.portal.limits import Limits, Rate
from relay.portal.scope import Scope
from tests.support.portal import Served, served_portal

A = Scope("a", "tok-a", True, "public")


@pytest.fixture
async def portal(db_url: str) -> AsyncIterator[Served]:
    async with served_portal(db_url) as p:
        p.state.write_limits = p.state.limits = Limits(Rate(per_second=1000, burst=1000))
        yield p


async def _session(portal: Served, tenant: str) -> tuple[str, str]:
    async with portal.client() as c:
        r = await c.post(
            f"{portal.url}/session",
            data={"token": portal.token(tenant)},
            headers={"sec-fetch-site": "same-origin"},
        )
    assert r.status_code == 303
    value = r.headers["set-cookie"].split(";")[0].split("=", 1)[1]
    access = pt.verify_portal_token(value, key=portal.keys, aud=pt.session_audience("public"))
    return value, sessions.csrf(portal.keys, Scope.of(access, "public"))


# 1. /session is in the gate's OPEN list: no 16 KiB cap, for anyone, without a token.
async def test_sign_in_body_is_capped_like_every_other(portal: Served) -> None:
    big = b"token=" + b"x" * (1024 * 1024)  # 1 MiB, no session, no token
    async with portal.client() as c:
        r = await c.post(
            f"{portal.url}/session",
            content=big,
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
    assert r.status_code == 413, (r.status_code, r.text[:200])


# 2. A chunked form over the cap: _capped raises api.Problem from receive(), which only the
#    API's handlers catch; an action's read_form is outside any handler: a 500.
async def test_a_chunked_form_over_the_cap_is_a_413_not_a_500(portal: Served) -> None:
    cookie, csrf = await _session(portal, "a")

    async def chunks() -> AsyncIterator[bytes]:
        yield f"csrf={csrf}&url=http://127.0.0.1:9/in&description=".encode()
        for _ in range(8):
            yield b"d" * 4096

    async with portal.client() as c:
        try:
            r = await c.post(
                f"{portal.url}/actions/add",
                content=chunks(),  # no content-length: transfer-encoding chunked
                headers={
                    "cookie": f"outbox_portal={cookie}",
                    "sec-fetch-site": "same-origin",
                    "content-type": "application/x-www-form-urlencoded",
                },
            )
            status = r.status_code
        except httpx.TransportError as exc:  # uvicorn: "Exception in ASGI application"
            status = repr(exc)
    assert status == 413, status


# 3. The highest id the document allows: reads.endpoint asks for the page below id + 1, which
#    overflows bigint: 400 (DataError) where every absent id answers 404.
async def test_the_highest_id_answers_like_any_absent_id(portal: Served) -> None:
    top = 2**63 - 1
    async with portal.client("a") as c:
        absent = await c.get("/endpoints/999999")
        r = await c.get(f"/endpoints/{top}")
    assert absent.status_code == 404
    assert (r.status_code, r.json()["detail"]) == (404, absent.json()["detail"]), r.text


# 4. A handover (B -> A) while a fan-out is in flight: the fan-out's transaction began after
#    the trigger's clock_timestamp() but before the handover committed, so it still saw the
#    endpoint as B's and wrote B's delivery with created_at >= tenant_since. While B's event is
#    kept, `o.tenant = :tenant` hides it; once retention deletes the event, `o.id IS NULL`
#    lets A read B's message, its error and B's receiver's answers.
async def test_a_fan_out_in_flight_at_a_handover_is_never_shown_to_the_new_tenant(
    db_url: str,
) -> None:
    dsn = to_asyncpg_dsn(db_url)
    c0, c1, c2 = [await asyncpg.connect(dsn) for _ in range(3)]
    try:
        ep = await c0.fetchval(
            "INSERT INTO outbox_endpoints (destination, url, tenant, secret)"
            " VALUES ('d', 'http://127.0.0.1:9/b', 'b', 'whsec_x') RETURNING id"
        )
        event = await c0.fetchval(
            "INSERT INTO outbox (destination, payload, content_type, tenant, event_type, status)"
            " VALUES ('d', '{\"card\": \"b-secret\"}', 'application/json', 'b', 'invoice.paid',"
            " 'delivered') RETURNING id"
        )
        handover = c1.transaction()
        await handover.start()
        await c1.execute("UPDATE outbox_endpoints SET tenant = 'a' WHERE id = $1", ep)
        # The fan-out: began after the trigger's clock, sees the endpoint still as B's.
        fan_out = c2.transaction()
        await fan_out.start()
        assert await c2.fetchval("SELECT tenant FROM outbox_endpoints WHERE id = $1", ep) == "b"
        delivery = await c2.fetchval(
            "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, status,"
            " attempts, last_error) VALUES ($1, $2, 'd', 'failed', 1, 'b: HTTP 500') RETURNING id",
            event,
            ep,
        )
        await c2.execute(
            "INSERT INTO outbox_attempts (delivery_id, event_id, endpoint_id, http_status,"
            " response) VALUES ($1, $2, $3, 500, 'answer of b''s receiver')",
            delivery,
            event,
            ep,
        )
        await fan_out.commit()
        await handover.commit()
        assert (await reads.messages(c0, A)).items == []  # hidden while the event is kept
        await c0.execute("DELETE FROM outbox WHERE id = $1", event)  # retention
        shown = [m.id for m in (await reads.messages(c0, A)).items]
        counts = (await reads.endpoint(c0, A, ep)).counts
        try:
            answers = [a.response for a in (await reads.attempts(c0, A, delivery)).items]
        except reads.NotFound:
            answers = []
        assert (shown, answers) == ([], []) and counts is not None and counts["failed"] == 0, (
            shown,
            answers,
            counts,
        )
    finally:
        for c in (c0, c1, c2):
            await c.close()


# 5. Login CSRF through the link: a page of another site navigates the browser to the portal
#    with ITS OWN tenant's token in the fragment; portal.js posts it from the portal's page
#    (Sec-Fetch-Site: same-origin) and replaces the victim's session, although docs/portal.md
#    says "a page elsewhere cannot sign a browser in as another tenant".
@pytest.mark.parametrize("victim_signed_in", [True])
async def test_a_page_elsewhere_cannot_swap_the_browsers_tenant(
    portal: Served, victim_signed_in: bool
) -> None:
    from playwright.async_api import async_playwright

    from tests.support.browser import chromium

    async with portal.client("attacker") as c:
        theirs = (await c.post("/endpoints", json={"url": "http://127.0.0.1:9/attacker"})).json()
    attacker_link = pt.portal_url(portal.url, tenant="attacker", key=portal.keys)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            context = await browser.new_context()
            page = await context.new_page()
            await page.goto(pt.portal_url(portal.url, tenant="victim", key=portal.keys))
            await page.wait_for_selector("h1:text-is('Endpoints')")
            evil = f"<script>location = {attacker_link!r}</script>"
            await context.route(
                "http://evil.example/**",
                lambda route: route.fulfill(status=200, content_type="text/html", body=evil),
            )
            await page.goto("http://evil.example/")
            await page.wait_for_url(f"{portal.url}/**")
            await page.wait_for_load_state("networkidle")
            r = await page.goto(f"{portal.url}/endpoints")
            assert r is not None
            html = await page.content()
        finally:
            await browser.close()
    assert f"/endpoints/{theirs['id']}" not in html and "127.0.0.1:9/attacker" not in html


# 6. Plans: a status filter, and an endpoint's counts (every GET /endpoints/{id} and endpoint
#    page), read whole tables: every tenant's deliveries and events, for one tenant's page.
async def test_a_head_is_a_read_for_the_limits(portal: Served) -> None:
    portal.state.write_limits = Limits(Rate(per_second=0.001, burst=1))
    async with portal.client("a") as c:
        assert (
            await c.post("/endpoints", json={"url": "http://127.0.0.1:9/in"})
        ).status_code == 201
        assert (await c.get("/endpoints")).status_code == 200
        r = await c.head("/endpoints")
    assert r.status_code == 200, r.status_code


# 8. The URL checks' refusals go to the tenant verbatim: the portal's own DNS view of any
#    name (internal ones too) and the operator's settings, an oracle for the operator's network.
async def test_a_refused_url_does_not_tell_the_tenant_what_it_resolves_to(db_url: str) -> None:
    from relay.portal.changes import Policy
    from tests.support.portal import DEST

    async with served_portal(db_url, Policy((DEST,))) as p, p.client("a") as c:
        r = await c.post("/endpoints", json={"url": "http://localhost:9/in"})
    detail = r.json()["detail"]
    assert r.status_code == 400
    assert "127.0.0.1" not in detail and "allow_private_networks" not in detail, detail
