"""The console's pages and actions against a real server and database (issue #26, item 9):
the endpoints page past its first page."""

from __future__ import annotations

from collections.abc import AsyncIterator
from html.parser import HTMLParser

import httpx
import pytest

from relay.ui.app import build_console
from tests.support.asgi import serve
from tests.test_console import TOKEN, csrf_of, sql
from tests.webhook_helpers import SECRET


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
