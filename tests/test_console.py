"""The operator console, in a real browser (Chromium via Playwright) against a real database
and a real relay; and its security from scripts (httpx)."""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from playwright.async_api import Browser, Page, async_playwright

from outbox.dburl import to_asyncpg_dsn
from relay.ops import admin
from relay.ui.app import build_console
from tests.support.asgi import serve
from tests.support.browser import chromium
from tests.support.receiver import Receiver
from tests.support.relays import running, settings, wait_until
from tests.webhook_helpers import SECRET

TOKEN = "console-test-token-0123456789"


@pytest.fixture
async def console_url(db_url: str) -> AsyncIterator[str]:
    async with serve(build_console(db_url, TOKEN)) as url:
        yield url


@pytest.fixture
async def read_only_url(db_url: str) -> AsyncIterator[str]:
    async with serve(build_console(db_url, TOKEN, read_only=True)) as url:
        yield url


@pytest.fixture(scope="module")
def chromium_path() -> str:
    return chromium()


@pytest.fixture
async def browser(chromium_path: str) -> AsyncIterator[Browser]:
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=chromium_path, args=["--no-sandbox"])
        try:
            yield b
        finally:
            await b.close()


async def signed_in(browser: Browser, url: str) -> tuple[Page, list[str]]:
    """A page signed in through the form; and the browser console's errors (CSP ones too)."""
    page = await browser.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    response = await page.goto(url + "/")
    assert response is not None and response.status == 401  # the sign-in form, with 401
    await page.fill("input[name=token]", TOKEN)
    await page.click("button:text-is('Sign in')")
    await page.wait_for_selector("h1:has-text('Overview')")
    return page, errors


async def sql(db_url: str, query: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        return list(await conn.fetch(query, *args))
    finally:
        await conn.close()


async def seed(db_url: str) -> None:
    """Rows of two destinations in every state the overview counts."""
    await sql(
        db_url,
        """
        INSERT INTO outbox (destination, payload, content_type, status, attempts, last_error,
                            delivered_at, finished_at, created_at)
        SELECT d, convert_to('{"n":' || n || '}', 'UTF8'), 'application/json', s,
               CASE WHEN s = 'failed' THEN 3 ELSE 0 END,
               CASE WHEN s = 'failed' THEN 'HTTP 500 from receiver: boom-' || n END,
               CASE WHEN s = 'delivered' THEN now() - interval '2 min' END,
               CASE WHEN s IN ('delivered', 'failed') THEN now() END,
               now() - interval '3 min'
        FROM (VALUES ('orders', 'pending', 1), ('orders', 'pending', 2),
                     ('orders', 'delivered', 3), ('orders', 'failed', 4),
                     ('hooks', 'failed', 5), ('hooks', 'delivered', 6),
                     ('hooks', 'delivered', 7)) AS v(d, s, n)
        """,
    )


async def test_unauthenticated_requests_get_401(console_url: str) -> None:
    async with httpx.AsyncClient(base_url=console_url) as client:
        paths = (
            "/",
            "/rows",
            "/rows/1",
            "/api/status",
            "/api/series",
            "/endpoints",
            "/blocked",
            "/destinations/orders",
            "/fragments/overview",
        )
        for path in paths:
            r = await client.get(path)
            assert r.status_code == 401, path
            assert "outbox" not in r.text.lower() or "sign in" in r.text.lower()
        r = await client.get("/", headers={"accept": "text/html"})
        assert r.status_code == 401 and 'name="token"' in r.text  # the sign-in form
        wrong = await client.get("/api/status", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        r = await client.post("/actions/pause", data={"destination": "orders"})
        assert r.status_code == 401
        ok = await client.get("/api/status", headers={"authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and ok.json()["schema"] == "public"
        for name in ("content-security-policy", "x-frame-options", "x-content-type-options"):
            assert name in r.headers and name in ok.headers
        assert "script-src 'self'" in ok.headers["content-security-policy"]


async def test_a_forged_cross_site_action_is_refused(db_url: str, console_url: str) -> None:
    async with httpx.AsyncClient(base_url=console_url) as client:
        login = await client.post("/login", data={"token": TOKEN, "next": "/"})
        assert login.status_code == 303 and "httponly" in login.headers["set-cookie"].lower()
        assert "samesite=strict" in login.headers["set-cookie"].lower()
        assert TOKEN not in login.headers["set-cookie"]
        assert login.headers["set-cookie"].startswith("__Host-outbox_console=")
        assert "secure" in login.headers["set-cookie"].lower()
        client.cookies.set("__Host-outbox_console", login.cookies["__Host-outbox_console"])
        # Signed in, but no CSRF value, or another site's origin: refused, nothing changed.
        for headers, data in (
            ({}, {"destination": "orders"}),
            ({"origin": "http://evil.example"}, {"destination": "orders"}),
            ({"sec-fetch-site": "cross-site"}, {"destination": "orders"}),
        ):
            r = await client.post("/actions/pause", data=data, headers=headers)
            assert r.status_code == 403, (headers, r.text)
    assert await sql(db_url, "SELECT * FROM outbox_paused") == []


async def test_the_overview_shows_what_status_reports_and_refreshes_itself(
    db_url: str, console_url: str, browser: Browser
) -> None:
    await seed(db_url)
    page, errors = await signed_in(browser, console_url)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        expected = await admin.status(conn, "public")
    finally:
        await conn.close()
    for d in expected["destinations"]:
        row = page.locator(f"tr[data-destination='{d['destination']}']")
        for field, key in (
            ("pending", "pending"),
            ("failed", "failed"),
            ("delivered", "delivered"),
        ):
            assert await row.locator(f"[data-field={field}]").inner_text() == str(d[key])
    assert await page.locator("[data-total=pending]").inner_text() == str(
        expected["totals"]["pending"]
    )
    # Live: rows added now show up without a reload.
    await page.evaluate("window.__sameDocument = true")
    await sql(
        db_url,
        "INSERT INTO outbox (destination, payload) "
        "SELECT 'orders', '\\x00' FROM generate_series(1, 3)",
    )
    pending = page.locator("tr[data-destination='orders'] [data-field=pending]")
    await pending.filter(has_text="5").wait_for(timeout=12_000)
    assert await page.evaluate("window.__sameDocument") is True
    # The charts drew the last hour's deliveries with the vendored library.
    await page.wait_for_selector(".chart[data-delivered] canvas", timeout=10_000)
    # The seeded rows were delivered two minutes ago: 3 of them in the last hour's series.
    assert await page.locator(".chart").first.get_attribute("data-delivered") == "3"
    assert not [e for e in errors if "Content Security Policy" in e or "Refused" in e], errors


async def test_a_failed_row_found_by_its_error_is_retried_and_then_delivered(
    db_url: str, console_url: str, browser: Browser, receiver: Receiver
) -> None:
    await seed(db_url)
    [target] = await sql(db_url, "SELECT id FROM outbox WHERE last_error LIKE '%boom-5'")
    page, errors = await signed_in(browser, console_url)
    await page.click("nav >> text=Rows")
    await page.fill("input[name=error_like]", "boom-5")
    await page.click("text=Filter")
    rows = page.locator("#rows tbody tr")
    await rows.first.wait_for()
    assert await rows.count() == 1
    await page.click(f"#rows a:text-is('{target['id']}')")
    await page.wait_for_selector(f"h1:has-text('Row {target['id']}')")
    await page.click("button:text-is('Retry…')")
    # The dry run's preview, then the confirmation.
    assert "1" in await page.locator("#preview-count").inner_text()
    await page.click("button:has-text('Yes')")
    await page.wait_for_selector(".flash")
    assert "1 row(s) back to pending" in await page.locator(".flash").inner_text()
    hook = {
        "kind": "webhook",
        "url": receiver.url,
        "secrets": [SECRET],
        "allow_private_networks": True,
    }
    relay_settings = settings(db_url, "127.0.0.1:9", destinations={"hooks": hook})
    async with running(relay_settings):
        await wait_until(
            lambda: sql(
                db_url, "SELECT 1 FROM outbox WHERE id = $1 AND status = 'delivered'", target["id"]
            ),
            what="delivered by the relay",
        )
    await page.reload()
    assert await page.locator("#row-status").inner_text() == "delivered"
    assert [r.headers["webhook-id"] for r in receiver.requests] == [str(target["id"])]
    assert not [e for e in errors if "Content Security Policy" in e], errors


async def test_read_only_mode_hides_and_refuses_every_action(
    db_url: str, read_only_url: str, browser: Browser
) -> None:
    await seed(db_url)
    page, _ = await signed_in(browser, read_only_url)
    assert await page.locator(".badge:text-is('read-only')").count() == 1
    await page.goto(read_only_url + "/destinations/orders")
    assert await page.locator("form[action$='/actions/pause']").count() == 0
    [failed] = await sql(
        db_url, "SELECT id FROM outbox WHERE destination = 'orders' AND status = 'failed'"
    )
    await page.goto(f"{read_only_url}/rows/{failed['id']}")
    assert await page.locator("form[action*='/actions/']").count() == 0
    async with httpx.AsyncClient(base_url=read_only_url) as client:
        auth = {"authorization": f"Bearer {TOKEN}"}
        for name, data in (
            ("pause", {"destination": "orders"}),
            ("retry", {"ids": str(failed["id"]), "confirm": "yes"}),
            ("purge", {"older_than": "0s", "confirm": "yes"}),
        ):
            r = await client.post(f"/actions/{name}", data=data, headers=auth)
            assert r.status_code == 403, name
    [row] = await sql(db_url, "SELECT status FROM outbox WHERE id = $1", failed["id"])
    assert row["status"] == "failed"
    assert await sql(db_url, "SELECT * FROM outbox_paused") == []


async def test_a_cross_site_page_cannot_act_through_the_signed_in_browser(
    db_url: str, console_url: str, browser: Browser
) -> None:
    """The browser holds the console's cookie; a page of another site posts a form to it."""
    await seed(db_url)
    page, _ = await signed_in(browser, console_url)
    attack = (
        f'<form id="f" method="post" action="{console_url}/actions/pause">'
        '<input name="destination" value="orders"></form>'
    )

    async def evil(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/html")],
            }
        )
        await send({"type": "http.response.body", "body": attack.encode()})

    async with serve(evil) as evil_url:
        # localhost is another site than 127.0.0.1 for the browser.
        await page.goto(evil_url.replace("127.0.0.1", "localhost") + "/")
        async with page.expect_navigation():
            await page.evaluate("document.getElementById('f').submit()")
        assert await page.locator("body").inner_text() != ""
    assert await sql(db_url, "SELECT * FROM outbox_paused") == []


async def test_the_relay_serves_the_console_at_ui_when_enabled(
    db_url: str, browser: Browser, monkeypatch: pytest.MonkeyPatch
) -> None:
    await seed(db_url)
    monkeypatch.setenv("OUTBOX_UI_TOKEN", TOKEN)
    hook = {"kind": "webhook", "url": "http://127.0.0.1:9/", "secrets": [SECRET]}
    s = settings(db_url, "127.0.0.1:9", destinations={"hooks": hook}, ui={"enabled": True})
    async with running(s) as relay:
        assert relay.http is not None
        base = f"http://127.0.0.1:{relay.http.port}"
        async with httpx.AsyncClient(base_url=base) as client:
            assert (await client.get("/ui/")).status_code == 401
            assert (await client.get("/metrics")).status_code == 200  # unchanged, no token
            moved = await client.get("/ui")
            assert moved.status_code == 308 and moved.headers["location"] == "/ui/"
            auth = {"authorization": f"Bearer {TOKEN}"}
            page = await client.get("/ui/", headers=auth)
            assert page.status_code == 200 and 'href="/ui/rows"' in page.text
            assert (await client.get("/ui/api/status", headers=auth)).json()["totals"][
                "failed"
            ] == 2
        page_, _ = await signed_in(browser, base + "/ui")
        await page_.click("nav >> text=Rows")
        await page_.wait_for_selector("#rows tbody tr")
        assert page_.url.startswith(base + "/ui/rows")


def test_the_relay_refuses_an_enabled_console_without_a_token(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.config import ConfigError

    monkeypatch.delenv("OUTBOX_UI_TOKEN", raising=False)
    with pytest.raises((ConfigError, ValueError), match="OUTBOX_UI_TOKEN"):
        settings(db_url, "127.0.0.1:9", destinations={}, ui={"enabled": True})


async def test_endpoints_are_added_and_disabled_without_a_secret_on_the_page(
    db_url: str, console_url: str, browser: Browser
) -> None:
    page, errors = await signed_in(browser, console_url)
    await page.click("nav >> text=Endpoints")
    await page.fill("#add-endpoint input[name=destination]", "customer-events")
    await page.fill("#add-endpoint input[name=url]", "http://127.0.0.1:9/hook?token=sekret123")
    await page.fill("#add-endpoint input[name=tenant]", "acme")
    await page.check("#add-endpoint input[name=allow_private_networks]")
    await page.click("#add-endpoint button")
    await page.wait_for_selector(".flash")
    [ep] = await sql(db_url, "SELECT * FROM outbox_endpoints")
    assert ep["tenant"] == "acme" and ep["enabled"]
    html = await page.content()
    assert ep["secret"] not in html and "sekret123" not in html and "/hook" not in html
    row = page.locator(f"tr[data-endpoint='{ep['id']}']")
    assert "closed" in await row.inner_text()
    # A relay wrote that its circuit for the endpoint is open (status shows the same).
    await sql(
        db_url,
        "UPDATE outbox_endpoints SET circuit_open_until = now() + interval '1 minute'",
    )
    await page.reload()
    circuit = await page.locator(f"tr[data-endpoint='{ep['id']}']").inner_text()
    assert re.search(r"open, tries again in 5\d s", circuit), circuit
    await page.click(f"tr[data-endpoint='{ep['id']}'] button:text-is('Disable…')")
    await page.wait_for_selector(f"h1:has-text('Disable endpoint {ep['id']}')")  # asked first
    await page.click("button:has-text('Yes')")
    await page.wait_for_selector(".flash")
    [ep] = await sql(db_url, "SELECT * FROM outbox_endpoints")
    assert not ep["enabled"] and ep["disabled_reason"] == "disabled in console"
    assert not [e for e in errors if "Content Security Policy" in e], errors


# --- from the hostile review: each failed before its fix -------------------------------


def bearer() -> dict[str, str]:
    return {"authorization": f"Bearer {TOKEN}"}


def csrf_of(html: str) -> str:
    return html.split('<meta name="csrf" content="')[1].split('"')[0]


async def sign_in(client: httpx.AsyncClient) -> None:
    login = await client.post("/login", data={"token": TOKEN, "next": "https://evil.example/"})
    assert login.status_code == 303 and login.headers["location"] == "/"  # no open redirect
    client.cookies.set("__Host-outbox_console", login.cookies["__Host-outbox_console"])


async def test_a_huge_body_is_refused_before_it_is_read(console_url: str) -> None:
    async with httpx.AsyncClient(base_url=console_url) as client:
        r = await client.post("/login", content=b"token=" + b"x" * 2_000_000)
        assert r.status_code == 413
        assert "content-security-policy" in r.headers

        async def chunks() -> Any:  # no content-length: cut off while reading
            for _ in range(40):
                yield b"y" * 65536

        r = await client.post(
            "/actions/pause",
            content=chunks(),
            headers={**bearer(), "content-type": "application/x-www-form-urlencoded"},
        )
        assert r.status_code == 413


async def test_forged_and_expired_sessions_are_not_signed_in(console_url: str) -> None:
    from relay.ui.security import Guard

    guard = Guard(TOKEN)
    expired = guard.new_session(now=0)
    assert not guard.session_ok(expired) and guard.session_ok(guard.new_session())
    async with httpx.AsyncClient(base_url=console_url) as client:
        for value in (
            "1",
            "9999999999.abc",
            expired,
            "caf\u00e9",
            Guard("another-token-0123456789").new_session(),
        ):
            cookie = f"__Host-outbox_console={value}".encode()  # raw bytes: any text at all
            r = await client.get("/api/status", headers={"cookie": cookie})  # type: ignore[dict-item]
            assert r.status_code == 401, value


async def test_bad_input_gets_a_clear_answer_not_a_500(db_url: str, console_url: str) -> None:
    await seed(db_url)
    async with httpx.AsyncClient(base_url=console_url) as client:
        await sign_in(client)
        # The rows page shows a bad filter above an empty table; the others answer 400.
        for path, status, says in (
            ("/rows?min_id=%C2%B2", 200, "min_id must be a whole number"),
            ("/rows?destination=a%00b", 200, "destination holds a NUL character"),
            ("/rows?status=nonsense", 200, "pending"),  # the valid statuses, listed
            ("/rows/99999999999999999999", 400, "no outbox row with id"),
            ("/api/series?destination=a%00b", 400, "destination holds a NUL character"),
        ):
            r = await client.get(path)
            assert r.status_code == status and says in r.text, (path, r.status_code, r.text[:300])
            assert "content-security-policy" in r.headers, path
            if status == 200:
                assert 'class="error" role="alert"' in r.text, path
        csrf = csrf_of((await client.get("/rows")).text)
        for name, data in (
            ("skip", {"ids": "99999999999999999999"}),
            ("replay", {"event": "99999999999999999999"}),
            ("purge", {"older_than": "1e20", "destination": "orders"}),
            ("purge", {"destination": "orders"}),  # no older_than: as the command, refused
            ("retry", {}),  # no filter: refused (the command needs --all)
            ("pause", {"destination": "a\x00b"}),
        ):
            r = await client.post(f"/actions/{name}", data={**data, "csrf": csrf})
            assert r.status_code in (400, 404), (name, data, r.status_code, r.text[:300])
    assert await sql(db_url, "SELECT * FROM outbox_paused") == []
    assert len(await sql(db_url, "SELECT * FROM outbox WHERE status = 'failed'")) == 2


async def test_a_database_that_is_down_gets_503_with_the_reason() -> None:
    from tests.webhook_helpers import closed_port

    app = build_console(f"postgresql://root@127.0.0.1:{closed_port()}/nowhere", TOKEN)
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:
        r = await client.get("/", headers=bearer())
        assert r.status_code == 503 and "cannot answer" in r.text
        assert "content-security-policy" in r.headers
    assert "root@" not in repr(app.state.console) and "nowhere" not in repr(app.state.console)


async def test_a_destination_with_a_slash_in_its_name_has_its_page(
    db_url: str, console_url: str
) -> None:
    await sql(db_url, "INSERT INTO outbox (destination, payload) VALUES ('pg/1', '\\x00')")
    async with httpx.AsyncClient(base_url=console_url) as client:
        r = await client.get("/destinations/pg/1", headers=bearer())
        assert r.status_code == 200 and "Destination pg/1" in r.text


async def test_same_origin_forms_work_behind_a_proxy_and_others_are_refused(
    db_url: str, console_url: str
) -> None:
    await seed(db_url)
    async with httpx.AsyncClient(base_url=console_url) as client:
        await sign_in(client)
        csrf = csrf_of((await client.get("/rows")).text)
        form = {"destination": "orders", "csrf": csrf, "confirm": "yes"}
        refused = (
            {"origin": "http://evil.example"},  # no Sec-Fetch-Site: the Origin decides
            {"sec-fetch-site": "same-site", "origin": "https://console.example"},
        )
        for headers in refused:
            assert (
                await client.post("/actions/pause", data=form, headers=headers)
            ).status_code == 403
        assert await sql(db_url, "SELECT * FROM outbox_paused") == []
        # Behind a TLS proxy the Origin is not what the console sees; the browser's own
        # Sec-Fetch-Site says it is this site.
        proxied = {"sec-fetch-site": "same-origin", "origin": "https://console.example"}
        r = await client.post("/actions/pause", data=form, headers=proxied)
        assert r.status_code == 303
    assert len(await sql(db_url, "SELECT * FROM outbox_paused")) == 1


async def test_only_the_consoles_own_messages_are_shown(console_url: str) -> None:
    from relay.ui.security import Guard

    async with httpx.AsyncClient(base_url=console_url) as client:
        await sign_in(client)
        forged = await client.get("/?msg=Token%20rotated:%20sign%20in%20at%20evil.example")
        assert "evil.example" not in forged.text
        sig = Guard(TOKEN).sign("orders paused")
        real = await client.get(f"/?msg=orders%20paused&sig={sig}")
        assert "orders paused" in real.text
    async with httpx.AsyncClient(base_url=console_url) as anonymous:
        login = await anonymous.get("/login?msg=x", headers={"accept": "text/html"})
        assert "schema public" not in login.text and "Overview" not in login.text


async def test_hostile_content_is_shown_as_text(
    db_url: str, console_url: str, browser: Browser
) -> None:
    [r] = await sql(
        db_url,
        "INSERT INTO outbox (destination, key, payload, content_type, status, last_error, "
        "finished_at) VALUES ('orders', '<b>k</b>', convert_to('<img src=x onerror=alert(1)>', "
        "'UTF8'), 'text/html', 'failed', '<script>alert(2)</script>', now()) RETURNING id",
    )
    page, _ = await signed_in(browser, console_url)
    dialogs: list[str] = []
    page.on("dialog", lambda d: dialogs.append(d.message))
    await page.goto(f"{console_url}/rows/{r['id']}")
    assert "<script>alert(2)</script>" in await page.locator("dd.err").first.inner_text()
    assert "<img src=x onerror=alert(1)>" in await page.locator("pre.payload").inner_text()
    await page.goto(f"{console_url}/rows?status=failed")
    assert "<b>k</b>" in await page.locator("#rows").inner_text()
    assert dialogs == [] and await page.locator("img").count() == 0


def test_an_enabled_console_needs_the_listener(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.config import ConfigError

    monkeypatch.setenv("OUTBOX_UI_TOKEN", TOKEN)
    with pytest.raises((ConfigError, ValueError), match=r"http\.enabled"):
        settings(
            db_url, "127.0.0.1:9", destinations={}, ui={"enabled": True}, http={"enabled": False}
        )


def test_the_console_has_one_bounded_pool_and_no_engine_of_its_own(db_url: str) -> None:
    # Endpoint actions run the operations of `outbox-relay endpoints` on the console's
    # asyncpg connections (relay.ops.endpoints), not on a SQLAlchemy engine beside them.
    console = build_console(db_url, TOKEN).state.console
    assert not hasattr(console, "sqlalchemy") and not hasattr(console, "engine")


# --- screenshots for the documentation ----------------------------------------------------

IMAGES = Path(__file__).parent.parent / "docs" / "images"


async def seed_realistic(db_url: str) -> int:
    """An outbox as an operator meets it: an hour of deliveries to three destinations with a
    lag spike, a backlog, failures grouped by error, a key blocked by a failed row, a paused
    destination, two relays. Returns the id of a failed row with a JSON payload."""
    await sql(
        db_url,
        """
        INSERT INTO outbox (destination, key, tenant, event_type, payload, content_type,
                            status, attempts, created_at, delivered_at, finished_at)
        SELECT d, 'order-' || (i % 700), 'acme', 'order.paid',
               convert_to('{"order_id":"A-' || i || '"}', 'UTF8'), 'application/json',
               'delivered', 1, at - lag, at, at
        FROM generate_series(1, 5400) AS i,
             LATERAL (SELECT (ARRAY['orders', 'orders', 'invoices', 'audit'])[1 + i % 4] AS d,
                             now() - make_interval(secs => 3500.0 * (i / 5400.0
                                                   + 0.03 * sin(i / 270.0))) AS at,
                             make_interval(secs => 0.04 + (i % 17) / 60.0
                                           + CASE WHEN i BETWEEN 2300 AND 2500
                                                  THEN 4 + (i % 5) ELSE 0 END) AS lag) AS x
        """,
    )
    await sql(
        db_url,
        """
        INSERT INTO outbox (destination, key, tenant, event_type, payload, content_type,
                            status, attempts, run_after, created_at)
        SELECT d, 'order-' || i, 'acme', 'order.created',
               convert_to('{"order_id":"B-' || i || '"}', 'UTF8'), 'application/json',
               'pending', i % 3,
               now() + make_interval(secs => CASE WHEN i % 9 = 0 THEN 40 ELSE -20 END),
               now() - make_interval(secs => 200 - i)
        FROM generate_series(1, 140) AS i,
             LATERAL (SELECT (ARRAY['orders', 'orders', 'emails', 'invoices'])[1 + i % 4] AS d) AS x
        """,
    )
    [failed] = await sql(
        db_url,
        """
        INSERT INTO outbox (destination, key, tenant, event_type, payload, content_type,
                            headers, status, attempts, last_error, created_at, finished_at)
        VALUES ('orders', 'order-1042', 'acme', 'order.paid',
                convert_to('{"order_id":"A-1042","customer":{"id":"C-77","country":"DE"},'
                           '"total":{"amount":"129.90","currency":"EUR"},'
                           '"items":[{"sku":"BK-204","qty":1},{"sku":"PN-11","qty":3}]}',
                           'UTF8'),
                'application/json',
                '{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",'
                ' "ce_type":"com.acme.order.paid"}',
                'failed', 25,
                'HTTP 503 from https://hooks.partner.example: upstream unavailable',
                now() - interval '42 min', now() - interval '12 min')
        RETURNING id
        """,
    )
    await sql(
        db_url,
        """
        INSERT INTO outbox (destination, key, payload, status, attempts, last_error, created_at,
                            finished_at)
        SELECT d, k, '\\x00', 'failed', a, e, now() - interval '30 min', now() - interval '5 min'
        FROM (VALUES
    ('orders', NULL, 25, 'HTTP 503 from https://hooks.partner.example: upstream unavailable'),
    ('orders', NULL, 25, 'HTTP 503 from https://hooks.partner.example: upstream unavailable'),
    ('orders', NULL, 1, 'MessageSizeTooLargeError: the message is 1048712 bytes'),
    ('invoices', 'invoice-7731', 12, 'HTTP 422 from https://erp.internal: unknown customer')
        ) AS v(d, k, a, e)
        """,
    )
    await sql(
        db_url,
        """
        INSERT INTO outbox (destination, key, payload, created_at)
        SELECT 'invoices', 'invoice-7731', '\\x00', now() - interval '20 min'
        FROM generate_series(1, 4)
        """,
    )
    await sql(
        db_url,
        """
        INSERT INTO outbox (destination, key, payload, status, attempts, locked_by, locked_until,
                            created_at)
        SELECT 'orders', 'order-' || (900 + i), '\\x00', 'running', 1, 'relay-7f9c-1-a3b2c1',
               now() + interval '25 s', now() - interval '2 s'
        FROM generate_series(1, 6) AS i
        """,
    )
    await sql(
        db_url,
        """
        INSERT INTO outbox_paused (destination, paused_by, reason, paused_at)
        VALUES ('emails', 'ana@ops', 'mail vendor outage', now() - interval '25 min')
        """,
    )
    await sql(
        db_url,
        """
        INSERT INTO outbox_relays (relay_id, host, pid, version, destinations, seen_at)
        VALUES ('relay-7f9c-1-a3b2c1', 'orders-7f9c', 1, '1.0', '{orders,invoices,audit}', now()),
               ('relay-2d81-1-99e0aa', 'orders-2d81', 1, '1.0', '{orders,emails}', now())
        """,
    )
    return int(failed["id"])


async def test_screenshots_of_the_overview_and_a_row(
    db_url: str, console_url: str, browser: Browser, tmp_path: Path
) -> None:
    """The overview and a row page over realistic data, as PNGs: in a temporary directory, or
    with OUTBOX_UPDATE_SCREENSHOTS=1 in docs/images/ (the documentation's images)."""
    failed_id = await seed_realistic(db_url)
    target = IMAGES if os.environ.get("OUTBOX_UPDATE_SCREENSHOTS") == "1" else tmp_path
    page, errors = await signed_in(browser, console_url)
    await page.set_viewport_size({"width": 1280, "height": 680})
    await page.reload()
    await page.wait_for_selector(".chart[data-delivered] canvas", timeout=10_000)
    # A locator, not wait_for_function: its string predicate is polled through eval, which the
    # console's CSP refuses whenever the second chart is not drawn at the first look.
    await page.locator(".chart[data-delivered] canvas").nth(1).wait_for(timeout=10_000)
    assert await page.locator("[data-total=failed]").inner_text() == "5"
    await page.screenshot(path=str(target / "console-overview.png"), full_page=True)
    await page.goto(f"{console_url}/rows/{failed_id}")
    await page.wait_for_selector(f"h1:has-text('Row {failed_id}')")
    await page.screenshot(path=str(target / "console-row.png"), full_page=True)
    for name in ("console-overview.png", "console-row.png"):
        image = (target / name).read_bytes()
        assert image.startswith(b"\x89PNG\r\n\x1a\n") and len(image) > 10_000, name
    assert not [e for e in errors if "Content Security Policy" in e], errors


async def test_an_open_circuit_shows_on_the_overview_and_in_status(
    db_url: str, console_url: str
) -> None:
    """Circuits live in each relay; the relay's registration writes those not closed, so the
    overview and `status` show them across relays."""
    from tests.webhook_helpers import closed_port

    hook = {
        "kind": "webhook",
        "url": f"http://127.0.0.1:{closed_port()}/",
        "secrets": [SECRET],
        "allow_private_networks": True,
        "circuit": {"threshold": 1, "cooldown": 60},
        "backoff": {"schedule": [0.1]},
    }
    await sql(db_url, "INSERT INTO outbox (destination, payload) VALUES ('hooks', '\\x00')")
    async with running(settings(db_url, "127.0.0.1:9", destinations={"hooks": hook})):

        async def shown() -> bool:
            conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
            try:
                data = await admin.status(conn, "public")
            finally:
                await conn.close()
            [d] = [d for d in data["destinations"] if d["destination"] == "hooks"]
            return bool(d["circuit"] == "open" and d["circuit_relays"])

        await wait_until(shown, timeout=15, what="circuit open in status")
        async with httpx.AsyncClient(base_url=console_url) as client:
            page = await client.get("/", headers=bearer())
        assert 'data-circuit="open"' in page.text
        # The relay (relay.claims "auto", none other running) claims under batch leases.
        assert "claims by batch" in page.text


async def test_a_snapshot_held_past_the_threshold_is_named_on_the_pages(db_url: str) -> None:
    """The banner names the holder (its application name escaped: another session wrote it)
    on the overview, its live part and the other pages that read status; gone once closed."""
    import asyncio

    from tests.test_snapshots import held_snapshot, oldest_is

    await sql(db_url, "INSERT INTO outbox (destination, payload) VALUES ('orders', '\\x00')")
    async with (
        serve(build_console(db_url, TOKEN, snapshot_warning=0.2)) as url,
        httpx.AsyncClient(base_url=url, headers=bearer()) as client,
    ):
        async with held_snapshot(db_url, "<b>report</b>") as holder:
            pid = holder.get_server_pid()
            conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
            try:
                await oldest_is(conn, pid)
            finally:
                await conn.close()
            await asyncio.sleep(0.3)
            for path in ("/", "/fragments/overview", "/destinations/orders", "/blocked"):
                page = await client.get(path)
                assert page.status_code == 200, path
                assert 'id="snapshot" role="alert"' in page.text, path
                assert f"by pid {pid} (&lt;b&gt;report&lt;/b&gt;, user root, idle in" in page.text
                assert f"SELECT pg_terminate_backend({pid}) if it is not needed" in page.text
                assert "<b>report</b>" not in page.text
            assert (await client.get("/api/status")).json()["snapshot"]["pid"] == pid
        page = await client.get("/")
        assert f"pid {pid}" not in page.text
