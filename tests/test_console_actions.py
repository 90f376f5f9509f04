"""The console's actions against a real server and database (issue #26, item 9): what asks
for confirmation, previews whose confirmation acts on exactly the rows they showed, the
endpoints page past its first page, sessions that end on sign-out, and operators with tokens
of their own named in the log of what they do."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
import structlog
from playwright.async_api import Browser, async_playwright

from relay.tools.localbroker import free_port
from relay.ui.app import build_console
from tests.support.asgi import serve
from tests.support.browser import chromium
from tests.support.relays import running, settings, wait_until
from tests.test_console import TOKEN, bearer, csrf_of, seed, sql
from tests.webhook_helpers import SECRET

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdefgh"


@pytest.fixture
async def console_url(db_url: str) -> AsyncIterator[str]:
    async with serve(build_console(db_url, TOKEN)) as url:
        yield url


class _Forms(HTMLParser):
    """The forms of a page: their action and their fields' values (hidden or not)."""

    def __init__(self) -> None:
        super().__init__()
        self.forms: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "form":
            self.forms.append((a.get("action", ""), {}))
        elif tag == "input" and self.forms and a.get("name") and self._sent(a):
            self.forms[-1][1][a["name"]] = a.get("value", "")

    @staticmethod
    def _sent(a: dict[str, str]) -> bool:
        return a.get("type") != "checkbox" or "checked" in a


def forms(html: str) -> list[tuple[str, dict[str, str]]]:
    parser = _Forms()
    parser.feed(html)
    return parser.forms


def confirm_form(html: str) -> dict[str, str]:
    """The fields of the page's confirmation form (the one that says confirm=yes)."""
    found = [f for _, f in forms(html) if f.get("confirm") == "yes"]
    assert len(found) == 1, html[:2000]
    return found[0]


class Operator:
    """A browser-like client signed in through the form: its cookie and CSRF value."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.csrf = ""
        self.cookie = ""

    async def sign_in(self, token: str = TOKEN) -> Operator:
        r = await self.client.post("/login", data={"token": token, "next": "/"})
        assert r.status_code == 303, r.text[:500]
        name = "__Host-outbox_console"
        self.cookie = r.cookies[name]
        self.client.cookies.set(name, self.cookie)
        self.csrf = csrf_of((await self.client.get("/rows")).text)
        return self

    async def act(self, name: str, **fields: str) -> httpx.Response:
        return await self.client.post(f"/actions/{name}", data={**fields, "csrf": self.csrf})

    async def confirm(self, name: str, preview: httpx.Response) -> httpx.Response:
        assert preview.status_code in (200, 409), preview.text[:1000]  # 409: a new preview
        return await self.client.post(f"/actions/{name}", data=confirm_form(preview.text))


@pytest.fixture
async def operator(console_url: str) -> AsyncIterator[Operator]:
    async with httpx.AsyncClient(base_url=console_url) as client:
        yield await Operator(client).sign_in()


# --- the endpoints page pages past its first 500 ----------------------------------------------


async def test_the_endpoints_page_pages_past_its_first_500(db_url: str, operator: Operator) -> None:
    await sql(
        db_url,
        "INSERT INTO outbox_endpoints (destination, url, secret) "
        "SELECT CASE WHEN i % 2 = 0 THEN 'even' ELSE 'odd' END, "
        "'http://127.0.0.1:9/h' || i, $1 FROM generate_series(1, 2201) AS i",
        SECRET,
    )

    async def walk(path: str) -> list[list[int]]:
        pages = []
        while path:
            html = (await operator.client.get(path)).text
            ids = [int(x.split('"')[0]) for x in html.split('<tr data-endpoint="')[1:]]
            pages.append(ids)
            nxt = html.split('<a rel="next" href="', 1)
            path = nxt[1].split('"', 1)[0].replace("&amp;", "&") if len(nxt) > 1 else ""
            assert len(pages) < 10, "the pages never end"
        return pages

    everything = await walk("/endpoints")
    assert [len(p) for p in everything] == [500, 500, 500, 500, 201]
    ids = [i for p in everything for i in p]
    assert ids == sorted(ids) and len(set(ids)) == 2201
    odd = await walk("/endpoints?destination=odd")  # the filter is kept from page to page
    assert [len(p) for p in odd] == [500, 500, 101]
    [count] = await sql(
        db_url, "SELECT count(*) AS n FROM outbox_endpoints WHERE destination = 'odd'"
    )
    assert len({i for p in odd for i in p}) == count["n"]


# --- sign-out ends the session on the server ----------------------------------------------


async def test_a_signed_out_session_no_longer_works(console_url: str) -> None:
    async with (
        httpx.AsyncClient(base_url=console_url) as first,
        httpx.AsyncClient(base_url=console_url) as second,
    ):
        one = await Operator(first).sign_in()
        await Operator(second).sign_in()
        cookie = one.cookie
        assert (await first.get("/api/status")).status_code == 200
        out = await first.post("/logout")
        assert out.status_code == 303 and out.headers["location"] == "/login"
        # The old cookie, sent again as it was (a copy kept elsewhere): refused.
        replayed = await first.get(
            "/api/status", headers={"cookie": f"__Host-outbox_console={cookie}"}
        )
        assert replayed.status_code == 401
        refused = await first.post(
            "/actions/pause",
            data={"destination": "orders", "csrf": one.csrf, "confirm": "yes"},
            headers={"cookie": f"__Host-outbox_console={cookie}"},
        )
        assert refused.status_code == 401
        # Only that session: another sign-in keeps working.
        assert (await second.get("/api/status")).status_code == 200


# --- operators with tokens of their own -----------------------------------------------------


@pytest.fixture
async def operators_url(db_url: str) -> AsyncIterator[str]:
    app = build_console(db_url, None, operators={"alice": ALICE, "bob": BOB})
    async with serve(app) as url:
        yield url


async def test_each_operator_signs_in_with_their_token_and_is_named_in_the_audit_log(
    db_url: str, operators_url: str
) -> None:
    await seed(db_url)
    [failed] = await sql(
        db_url, "SELECT id FROM outbox WHERE destination = 'orders' AND status = 'failed'"
    )
    async with (
        httpx.AsyncClient(base_url=operators_url) as a,
        httpx.AsyncClient(base_url=operators_url) as b,
    ):
        # With operators, the shared token is no token at all.
        shared = await a.post("/login", data={"token": TOKEN, "next": "/"})
        assert shared.status_code == 401
        assert (await a.get("/api/status", headers=bearer())).status_code == 401
        with structlog.testing.capture_logs() as logs:
            alice = await Operator(a).sign_in(ALICE)
            asked = await alice.act("pause", destination="orders", next="/")
            assert (await alice.confirm("pause", asked)).status_code == 303
            # Bob, as a script: his token in the header.
            b.headers["authorization"] = f"Bearer {BOB}"
            preview = await b.post("/actions/skip", data={"ids": str(failed["id"])})
            assert (
                await b.post("/actions/skip", data=confirm_form(preview.text))
            ).status_code == 303
            await a.post("/logout")
    [paused] = await sql(db_url, "SELECT paused_by FROM outbox_paused")
    assert paused["paused_by"] == "alice (console)"
    [skipped] = await sql(db_url, "SELECT last_error FROM outbox WHERE id = $1", failed["id"])
    assert "skipped by bob (console)" in skipped["last_error"]
    acted = [(e["event"], e.get("operator"), e.get("action")) for e in logs]
    assert ("relay.console.signed_in", "alice", None) in acted
    assert ("relay.console.action", "alice", "pause") in acted
    assert ("relay.console.action", "bob", "skip") in acted
    assert ("relay.console.signed_out", "alice", None) in acted
    # Previews act on nothing and are not logged as actions.
    assert [x for x in acted if x[0] == "relay.console.action"] == [
        ("relay.console.action", "alice", "pause"),
        ("relay.console.action", "bob", "skip"),
    ]
    assert not any(ALICE in json.dumps(e, default=str) for e in logs)


async def test_the_shared_token_is_named_as_such_in_the_audit_log(
    db_url: str, operator: Operator
) -> None:
    await seed(db_url)
    with structlog.testing.capture_logs() as logs:
        asked = await operator.act("pause", destination="orders", next="/")
        assert (await operator.confirm("pause", asked)).status_code == 303
    [line] = [e for e in logs if e["event"] == "relay.console.action"]
    assert line["operator"] is None and line["action"] == "pause"
    assert line["destination"] == "orders"
    [paused] = await sql(db_url, "SELECT paused_by FROM outbox_paused")
    assert paused["paused_by"] == "console"


def test_operator_settings_are_validated(
    db_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from relay.config import ConfigError

    monkeypatch.delenv("OUTBOX_UI_TOKEN", raising=False)
    monkeypatch.delenv("OUTBOX_UI_OPERATORS", raising=False)

    def ui(**fields: Any) -> Any:
        return settings(db_url, "127.0.0.1:9", destinations={}, ui={"enabled": True, **fields})

    for operators, says in (
        ({"alice": "short"}, r"ui\.operators: the token of alice has 5 characters"),
        ({"alice": ALICE, "bob": ALICE}, "alice and bob have the same token"),
        ({"al ice": ALICE}, "'al ice' is not a usable operator name"),
        ({}, "names no operator"),
    ):
        with pytest.raises(ConfigError, match=says):
            ui(operators=operators)
    with pytest.raises(ConfigError, match=r"both a shared token .* and operators"):
        ui(token=TOKEN, operators={"alice": ALICE})
    assert ui(operators={"alice": ALICE}).ui.credentials() == (None, {"alice": ALICE})
    # From the environment, as a JSON object; or from a file of name = "token" lines.
    monkeypatch.setenv("OUTBOX_UI_OPERATORS", json.dumps({"bob": BOB}))
    assert settings(
        db_url, "127.0.0.1:9", destinations={}, ui={"enabled": True}
    ).ui.credentials() == (
        None,
        {"bob": BOB},
    )
    monkeypatch.delenv("OUTBOX_UI_OPERATORS")
    listed = tmp_path / "operators.toml"
    listed.write_text(f'alice = "{ALICE}"\nbob = "{BOB}"\n')
    assert ui(operators_file=str(listed)).ui.credentials() == (None, {"alice": ALICE, "bob": BOB})
    listed.write_text('alice = "short"\n')
    with pytest.raises(ConfigError, match=f"{listed}.*alice"):
        ui(operators_file=str(listed))
    # Without operators, the shared token as before.
    monkeypatch.setenv("OUTBOX_UI_TOKEN", TOKEN)
    assert ui().ui.credentials() == (TOKEN, None)


async def test_the_relay_console_takes_operators(db_url: str) -> None:
    hook = {"kind": "webhook", "url": "http://127.0.0.1:9/", "secrets": [SECRET]}
    s = settings(
        db_url,
        "127.0.0.1:9",
        destinations={"hooks": hook},
        ui={"enabled": True, "operators": {"alice": ALICE}},
    )
    async with running(s) as relay:
        assert relay.http is not None
        base = f"http://127.0.0.1:{relay.http.port}/ui"
        async with httpx.AsyncClient() as client:
            ok = await client.get(
                base + "/api/status", headers={"authorization": f"Bearer {ALICE}"}
            )
            assert ok.status_code == 200
            assert (await client.get(base + "/api/status", headers=bearer())).status_code == 401


@pytest.fixture
def ui_process(db_url: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_UI_OPERATORS"] = json.dumps({"alice": ALICE})
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay.cli", "ui", "--database-url", db_url, "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def test_outbox_relay_ui_takes_operators_and_logs_their_actions_as_json(
    db_url: str, ui_process: tuple[str, subprocess.Popen[str]]
) -> None:
    url, proc = ui_process

    async def up() -> bool:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            async with httpx.AsyncClient() as c:
                await c.get(url + "/login")
            return True
        except httpx.TransportError:
            return False

    await wait_until(up, timeout=20, interval=0.1, what="outbox-relay ui serving")
    await seed(db_url)
    async with httpx.AsyncClient(base_url=url) as client:
        client.headers["authorization"] = f"Bearer {ALICE}"
        r = await client.post("/actions/pause", data={"destination": "orders", "confirm": "yes"})
        assert r.status_code == 303, r.text[:500]
    proc.terminate()
    out, _ = await asyncio.to_thread(proc.communicate, None, 10)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    [action] = [x for x in lines if x["event"] == "relay.console.action"]
    assert action["operator"] == "alice" and action["action"] == "pause"
    assert action["destination"] == "orders" and action["level"] == "info"
    assert ALICE not in out


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


# --- confirmation before disable, rotate-secret, pause and a single event's replay ---------


async def an_endpoint_with_a_delivered_event(db_url: str) -> tuple[int, int]:
    [ep] = await sql(
        db_url,
        "INSERT INTO outbox_endpoints (destination, url, secret) "
        "VALUES ('customer-events', 'http://127.0.0.1:9/hook', $1) RETURNING id",
        SECRET,
    )
    [event] = await sql(
        db_url,
        "INSERT INTO outbox (destination, payload, status, delivered_at, finished_at) "
        "VALUES ('customer-events', '\\x00', 'delivered', now(), now()) RETURNING id",
    )
    await sql(
        db_url,
        "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, status, attempts, "
        "finished_at) VALUES ($1, $2, 'customer-events', 'delivered', 1, now())",
        event["id"],
        ep["id"],
    )
    return int(ep["id"]), int(event["id"])


async def state(db_url: str) -> dict[str, Any]:
    """What the four actions change: pauses, the endpoint's state and secret, its delivery."""
    [ep] = await sql(db_url, "SELECT enabled, secret FROM outbox_endpoints")
    [d] = await sql(db_url, "SELECT status, replay FROM outbox_deliveries")
    paused = await sql(db_url, "SELECT destination FROM outbox_paused")
    return {
        "paused": [p["destination"] for p in paused],
        "enabled": ep["enabled"],
        "secret": ep["secret"],
        "delivery": (d["status"], d["replay"]),
    }


@pytest.mark.parametrize("action", ["pause", "endpoint-disable", "endpoint-rotate", "replay"])
async def test_a_one_click_action_asks_for_confirmation_first(
    db_url: str, operator: Operator, action: str
) -> None:
    await seed(db_url)
    endpoint, event = await an_endpoint_with_a_delivered_event(db_url)
    fields = {
        "pause": {"destination": "orders", "reason": "vendor outage"},
        "endpoint-disable": {"endpoint": str(endpoint)},
        "endpoint-rotate": {"endpoint": str(endpoint)},
        "replay": {"event": str(event), "endpoint": str(endpoint)},
    }[action]
    before = await state(db_url)
    asked = await operator.act(action, **fields, next="/")
    # A confirmation page, and nothing done yet.
    assert asked.status_code == 200, asked.text[:500]
    assert await state(db_url) == before
    confirm = confirm_form(asked.text)
    assert {k: confirm[k] for k in fields} == fields
    done = await operator.confirm(action, asked)
    assert done.status_code == 303, done.text[:500]
    after = await state(db_url)
    changed = {k for k in after if after[k] != before[k]}
    expected = {
        "pause": {"paused"},
        "endpoint-disable": {"enabled"},
        "endpoint-rotate": {"secret"},
        "replay": {"delivery"},
    }[action]
    assert changed == expected, (before, after)


async def test_confirmations_work_without_javascript(
    db_url: str, console_url: str, browser: Browser
) -> None:
    """The console's forms are plain HTML: with scripts off, pausing and rotating a secret
    go through their confirmation pages."""
    await seed(db_url)
    endpoint, _ = await an_endpoint_with_a_delivered_event(db_url)
    context = await browser.new_context(java_script_enabled=False)
    page = await context.new_page()
    await page.goto(console_url + "/")
    await page.fill("input[name=token]", TOKEN)
    await page.click("button:text-is('Sign in')")
    await page.goto(console_url + "/destinations/orders")
    await page.fill("input[name=reason]", "vendor outage")
    await page.click("button:text-is('Pause…')")
    await page.wait_for_selector("h1:has-text('Pause destination orders')")
    assert await sql(db_url, "SELECT * FROM outbox_paused") == []
    await page.click("button:has-text('Yes')")
    await page.wait_for_selector(".flash")
    [paused] = await sql(db_url, "SELECT reason FROM outbox_paused")
    assert paused["reason"] == "vendor outage"
    [before] = await sql(db_url, "SELECT secret FROM outbox_endpoints")
    await page.goto(console_url + "/endpoints")
    await page.click(f"tr[data-endpoint='{endpoint}'] button:text-is('Rotate secret…')")
    await page.wait_for_selector(f"h1:has-text('Rotate the secret of endpoint {endpoint}')")
    assert await sql(db_url, "SELECT secret FROM outbox_endpoints") == [before]
    await page.click("button:has-text('Yes')")
    await page.wait_for_selector(".flash")
    [after] = await sql(db_url, "SELECT secret FROM outbox_endpoints")
    assert after["secret"] != before["secret"]
    await context.close()


# --- a preview's confirmation acts on exactly the rows it showed ------------------------------


async def failed_rows(db_url: str, destination: str, n: int, error: str = "boom") -> list[int]:
    rows = await sql(
        db_url,
        "INSERT INTO outbox (destination, payload, status, attempts, last_error, finished_at) "
        "SELECT $1, '\\x00', 'failed', 3, $2, now() FROM generate_series(1, $3) RETURNING id",
        destination,
        error,
        n,
    )
    return [r["id"] for r in rows]


async def statuses(db_url: str, ids: list[int]) -> dict[str, int]:
    rows = await sql(
        db_url,
        "SELECT status, count(*) AS n FROM outbox WHERE id = ANY($1) GROUP BY status",
        ids,
    )
    return {r["status"]: r["n"] for r in rows}


async def test_a_retry_confirmed_leaves_out_rows_that_failed_after_its_preview(
    db_url: str, operator: Operator
) -> None:
    """Thousands of rows: the form carries their digest and highest id, not the ids."""
    shown = await failed_rows(db_url, "orders", 3000)
    preview = await operator.act("retry", destination="orders", next="/")
    assert "<strong>3000</strong>" in preview.text
    assert len(preview.text) < 20_000  # the selection, not 3,000 ids
    later = await failed_rows(db_url, "orders", 7)  # failed while the operator read
    done = await operator.confirm("retry", preview)
    assert done.status_code == 303, done.text[:500]
    assert "3000 row(s) back to pending" in unquote(done.headers["location"])
    assert await statuses(db_url, shown) == {"pending": 3000}
    assert await statuses(db_url, later) == {"failed": 7}


async def test_a_retry_confirmed_is_refused_when_its_rows_changed(
    db_url: str, operator: Operator
) -> None:
    shown = await failed_rows(db_url, "orders", 3)
    preview = await operator.act("retry", destination="orders", next="/")
    # Another operator retries one of them meanwhile.
    await sql(db_url, "UPDATE outbox SET status = 'pending' WHERE id = $1", shown[0])
    refused = await operator.confirm("retry", preview)
    assert refused.status_code == 409, refused.text[:500]
    assert "changed since the preview" in refused.text
    assert await statuses(db_url, shown[1:]) == {"failed": 2}  # nothing done
    # The answer is the new preview, to confirm as it is now.
    assert "<strong>2</strong>" in refused.text
    again = await operator.confirm("retry", refused)
    assert again.status_code == 303
    assert await statuses(db_url, shown) == {"pending": 3}


async def test_a_tampered_selection_is_refused(db_url: str, operator: Operator) -> None:
    shown = await failed_rows(db_url, "orders", 2)
    later = await failed_rows(db_url, "orders", 1)
    preview = await operator.act("retry", destination="orders", next="/")
    form = confirm_form(preview.text)
    for field, value in (
        ("selection", form["selection"].replace(".", ".9", 1)),  # another count
        ("destination", "hooks"),  # the selection of another filter
        ("selection", ""),
    ):
        r = await operator.client.post("/actions/retry", data={**form, field: value})
        assert r.status_code == 400, (field, r.status_code, r.text[:500])
        assert "preview" in r.text
    assert await statuses(db_url, shown + later) == {"failed": 3}


async def delivered_rows(db_url: str, n: int, age: str) -> list[int]:
    rows = await sql(
        db_url,
        "INSERT INTO outbox (destination, payload, status, attempts, delivered_at, finished_at) "
        "SELECT 'orders', '\\x00', 'delivered', 1, now() - $1::text::interval, "
        "now() - $1::text::interval FROM generate_series(1, $2) RETURNING id",
        age,
        n,
    )
    return [r["id"] for r in rows]


async def present(db_url: str, ids: list[int]) -> list[int]:
    return [r["id"] for r in await sql(db_url, "SELECT id FROM outbox WHERE id = ANY($1)", ids)]


async def test_a_purge_confirmed_deletes_only_the_rows_its_preview_counted(
    db_url: str, operator: Operator
) -> None:
    shown = await delivered_rows(db_url, 4, "10 days")
    # Delivered 7 days ago less 2 seconds: not older than 7d at the preview, but in a few
    # seconds, when the operator confirms.
    ageing = await delivered_rows(db_url, 1, "7 days -2 seconds")
    preview = await operator.act("purge", older_than="7d", destination="orders", next="/")
    assert "<strong>4</strong>" in preview.text
    arrived = await delivered_rows(db_url, 2, "10 days")  # e.g. a restored backup's rows
    await _wait_aged(db_url, ageing[0], "7 days")
    done = await operator.confirm("purge", preview)
    assert done.status_code == 303, done.text[:500]
    assert await present(db_url, shown) == []
    assert sorted(await present(db_url, ageing + arrived)) == sorted(ageing + arrived)


async def _wait_aged(db_url: str, row: int, age: str) -> None:
    async def aged() -> bool:
        found = await sql(
            db_url,
            "SELECT 1 FROM outbox WHERE id = $1 AND delivered_at < now() - $2::text::interval",
            row,
            age,
        )
        return bool(found)

    await wait_until(aged, timeout=10, interval=0.2, what=f"row {row} older than {age}")


async def test_a_replay_window_confirmed_replays_only_the_previewed_deliveries(
    db_url: str, operator: Operator
) -> None:
    endpoint, _ = await an_endpoint_with_a_delivered_event(db_url)

    async def failed_deliveries(n: int) -> list[int]:
        events = await sql(
            db_url,
            "INSERT INTO outbox (destination, payload, status, delivered_at, finished_at) "
            "SELECT 'customer-events', '\\x00', 'delivered', now(), now() "
            "FROM generate_series(1, $1) RETURNING id",
            n,
        )
        rows = await sql(
            db_url,
            "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, status, "
            "attempts, last_error, finished_at) "
            "SELECT e, $2, 'customer-events', 'failed', 5, 'HTTP 500', now() "
            "FROM unnest($1::bigint[]) AS e RETURNING id",
            [e["id"] for e in events],
            endpoint,
        )
        return [r["id"] for r in rows]

    shown = await failed_deliveries(3)
    preview = await operator.act(
        "replay", endpoint=str(endpoint), since="1h", failed_only="on", next="/endpoints"
    )
    assert "<strong>3</strong>" in preview.text, preview.text[:2000]
    later = await failed_deliveries(2)
    done = await operator.confirm("replay", preview)
    assert done.status_code == 303, done.text[:500]
    rows = await sql(db_url, "SELECT id, status FROM outbox_deliveries WHERE status = 'failed'")
    assert sorted(r["id"] for r in rows) == sorted(later)
    replayed = await sql(db_url, "SELECT id FROM outbox_deliveries WHERE replay")
    assert sorted(r["id"] for r in replayed) == sorted(shown)


async def test_a_replay_window_confirmed_twice_replays_once(
    db_url: str, operator: Operator
) -> None:
    """A replay leaves its deliveries in the window (pending, due; then delivered again once
    the relay sends them): the same form posted again must be refused, not send them twice."""
    endpoint, _ = await an_endpoint_with_a_delivered_event(db_url)
    preview = await operator.act("replay", endpoint=str(endpoint), since="1h", next="/endpoints")
    assert "<strong>1</strong>" in preview.text, preview.text[:2000]
    done = await operator.confirm("replay", preview)
    assert done.status_code == 303, done.text[:500]
    # The relay sends it again and records it, before the form is posted a second time.
    await sql(
        db_url,
        "UPDATE outbox_deliveries SET status = 'delivered', finished_at = now(), replay = false",
    )
    again = await operator.confirm("replay", preview)
    assert again.status_code == 409, again.text[:500]
    [d] = await sql(db_url, "SELECT status, replay FROM outbox_deliveries")
    assert (d["status"], d["replay"]) == ("delivered", False)  # not replayed a second time


# --- endpoints: the console runs the operations of `outbox-relay endpoints` -------------------


async def test_the_console_adds_disables_and_enables_endpoints(
    db_url: str, operator: Operator
) -> None:
    await seed(db_url)
    bad = await operator.act("endpoint-add", destination="customer-events", url="ftp://x/")
    assert bad.status_code == 400 and "ftp" in bad.text, bad.text[:500]
    added = await operator.act(
        "endpoint-add",
        destination="customer-events",
        url="http://127.0.0.1:9/hook",
        tenant="acme",
        event_types="order.created, order.paid",
        rate_limit="5",
        allow_private_networks="on",
        next="/endpoints",
    )
    assert added.status_code == 303, added.text[:500]
    [ep] = await sql(
        db_url, "SELECT id, tenant, event_types, rate_limit, enabled, secret FROM outbox_endpoints"
    )
    assert (ep["tenant"], ep["event_types"], ep["rate_limit"], ep["enabled"]) == (
        "acme",
        ["order.created", "order.paid"],
        5,
        True,
    )
    assert ep["secret"]
    asked = await operator.act("endpoint-disable", endpoint=str(ep["id"]), next="/")
    done = await operator.confirm("endpoint-disable", asked)
    assert done.status_code == 303, done.text[:500]
    [row] = await sql(db_url, "SELECT enabled, disabled_reason FROM outbox_endpoints")
    assert (row["enabled"], row["disabled_reason"]) == (False, "disabled in console")
    enabled = await operator.act("endpoint-enable", endpoint=str(ep["id"]), next="/")
    assert enabled.status_code == 303, enabled.text[:500]
    [row] = await sql(db_url, "SELECT enabled FROM outbox_endpoints")
    assert row["enabled"] is True
    unknown = await operator.act("endpoint-enable", endpoint="999999", next="/")
    assert unknown.status_code == 400 and "999999" in unknown.text, unknown.text[:500]


async def test_the_console_refuses_an_endpoint_action_in_the_librarys_words(
    db_url: str, operator: Operator
) -> None:
    # As every refusal of the library the console shows: its type, then its message (a review
    # found the type lost when the actions moved onto relay.ops.endpoints).
    await seed(db_url)
    unknown = await operator.act("endpoint-enable", endpoint="999999", next="/")
    assert unknown.status_code == 400, unknown.text[:500]
    assert "EndpointNotFound: no endpoint 999999" in unknown.text, unknown.text[:2000]
    bad = await operator.act("endpoint-add", destination="customer-events", url="ftp://x/")
    assert bad.status_code == 400, bad.text[:500]
    assert "OutboxValidationError: url" in bad.text, bad.text[:2000]
