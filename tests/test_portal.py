"""The tenant portal's pages in a browser (Debian's Chromium through Playwright, as the
console's), with a running relay and a real receiver: a tenant opened by ``portal_url`` adds
an endpoint, sends a test event and sees the attempt with the receiver's answer, replays a
failed message and sees it delivered."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
from playwright.async_api import Browser, Page

from outbox.endpoints import portal_tokens as pt
from tests.support.portal import Served, served_portal
from tests.support.receiver import Receiver
from tests.support.relays import running
from tests.test_console import (
    browser,  # noqa: F401  (the fixture)
    chromium_path,  # noqa: F401  (fixture)
)
from tests.test_endpoint_delivery import endpoints_settings


@pytest.fixture
async def portal(db_url: str) -> AsyncIterator[Served]:
    async with served_portal(db_url) as p:
        yield p


async def opened(
    browser: Browser,  # noqa: F811
    portal: Served,
    tenant: str,
) -> tuple[Page, list[str]]:
    """A page opened by the tenant's link; and the browser's errors (CSP ones too)."""
    page = await browser.new_page()
    errors: list[str] = []
    page.on(
        "console", lambda m: errors.append(f"{m.text} {m.location}") if m.type == "error" else None
    )
    page.on("pageerror", lambda e: errors.append(str(e)))
    link = pt.portal_url(portal.url, tenant=tenant, key=portal.keys)
    await page.goto(link)
    await page.wait_for_selector("h1:text-is('Endpoints')")
    assert "#token" not in page.url  # taken out of the address bar
    return page, errors


async def reload_until(page: Page, selector: str, text: str, timeout: float = 30) -> None:
    """Reload the page until ``selector`` shows ``text`` (the relay works meanwhile)."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while True:
        found = await page.locator(selector).all_inner_texts()
        if any(text in t for t in found):
            return
        assert time.monotonic() < deadline, (selector, text, found)
        await asyncio.sleep(0.3)
        await page.reload()


async def test_a_tenant_adds_an_endpoint_tests_it_and_replays_a_failure(
    db_url: str,
    browser: Browser,  # noqa: F811
    portal: Served,
    make_receiver: Callable[..., Receiver],
) -> None:
    receiver = make_receiver()
    receiver.respond(200, body=b"thanks from the receiver")
    settings = endpoints_settings(db_url, max_attempts=2)
    async with running(settings):
        page, errors = await opened(browser, portal, "acme")
        await page.fill("#add input[name=url]", receiver.url)
        await page.click("#add button")
        secret = await page.inner_text("#secret")
        assert secret.startswith("whsec_")
        await page.click("#continue")
        await page.click("#send-test button")
        await page.wait_for_selector("h1:has-text('Message #')")
        await reload_until(page, "#attempts pre", "thanks from the receiver")
        await reload_until(page, "#status", "delivered")
        # The receiver fails the next one: after its attempts the message is failed.
        receiver.respond(500, body=b"receiver down")
        await page.click("a:has-text('#')")  # back to the endpoint
        await page.click("#send-test button")
        await reload_until(page, "#status", "failed")
        assert "receiver down" in " ".join(await page.locator("#attempts pre").all_inner_texts())
        receiver.respond(200, body=b"back again")
        await page.click("#replay button")
        await reload_until(page, "#status", "delivered")
        await reload_until(page, "#attempts pre", "back again")
        # A window's replay: counted first, then sent exactly as counted.
        receiver.respond(500, body=b"down again")
        await page.click("a:has-text('#')")
        await page.click("#send-test button")
        await reload_until(page, "#status", "failed")
        failed_at = page.url
        receiver.respond(200, body=b"the window")
        await page.click("nav >> text=Send again")
        await page.select_option("#replay-window select[name=since]", "1h")
        await page.check("#replay-window input[name=failed_only]")
        await page.click("#replay-window button")
        await page.wait_for_selector("h1:has-text('Send 1 message(s) again?')")
        await page.click("#confirm button")
        await page.wait_for_selector("#notice:has-text('1 message(s) will be sent again')")
        await page.goto(failed_at)
        await reload_until(page, "#status", "delivered")
    assert errors == []


async def test_another_tenants_pages_and_a_bad_link(
    browser: Browser,  # noqa: F811
    portal: Served,
) -> None:
    async with portal.client("other") as c:
        theirs = (await c.post("/endpoints", json={"url": "http://127.0.0.1:9/x"})).json()["id"]
    page, errors = await opened(browser, portal, "acme")
    response = await page.goto(f"{portal.url}/endpoints/{theirs}")
    assert response is not None and response.status == 404
    assert "127.0.0.1:9/x" not in await page.content()
    stale = pt.portal_token(tenant="acme", key=pt.PortalKeys.parse(pt.new_portal_key()))
    fresh = await browser.new_page()
    await fresh.goto(f"{portal.url}/#token={stale}")
    await fresh.wait_for_selector("#refused")
    response = await fresh.goto(f"{portal.url}/endpoints")
    assert response is not None and "Access token" in await fresh.content()  # signed out
    # The one error: the 404 asked for.
    assert len(errors) == 1 and f"/endpoints/{theirs}" in errors[0], errors


@pytest.mark.parametrize("allowed", [True, False], ids=["embed-origin", "no-embed-origin"])
async def test_the_portal_is_framed_by_the_embed_origins_only(
    db_url: str,
    browser: Browser,  # noqa: F811
    allowed: bool,
) -> None:
    """A page of another origin (another port) frames the portal's link: shown when that
    origin is an embed origin, refused by the browser otherwise."""
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    from tests.support.asgi import serve

    frame_src: list[str] = []

    async def host(request: object) -> HTMLResponse:
        return HTMLResponse(
            f'<link rel="icon" href="data:,"><iframe id="portal" src="{frame_src[0]}"></iframe>'
        )

    async with serve(Starlette(routes=[Route("/", host)])) as host_url:
        embed = (host_url,) if allowed else ()
        async with served_portal(db_url, embed_origins=embed) as portal:
            frame_src.append(f"{portal.url}/")
            page = await browser.new_page()
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            await page.goto(host_url + "/")
            frame = page.frame_locator("#portal")
            if allowed:
                await frame.locator("text=Access token").wait_for(timeout=15_000)
                assert errors == []
            else:
                await page.wait_for_timeout(1500)
                assert await frame.locator("text=Access token").count() == 0
                assert any("frame-ancestors" in e for e in errors), errors
