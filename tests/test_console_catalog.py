"""The console's page of the event catalog (/ui/catalog) and its AsyncAPI document, over real
HTTP against a real database: what it shows (escaped), the endpoints per type and those
waiting for types the catalog lacks, the document byte for byte `catalog asyncapi`'s, the help
without a catalog, and a catalog that does not load: logged, said on the page, and the relay
delivering all the same."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from structlog.testing import capture_logs

from relay.catalog.view import CatalogView, load_view
from relay.cli import main
from relay.settings import load_settings
from relay.ui.app import build_console
from tests.support import catalogs
from tests.support.asgi import serve
from tests.support.receiver import Receiver
from tests.support.relays import running, settings, wait_until
from tests.test_console import TOKEN, sql
from tests.webhook_helpers import SECRET

AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The relay.toml the catalog's destinations are in, its webhook secret set."""
    monkeypatch.setenv("CATALOG_VIEW_TEST_SECRET", SECRET)
    path = tmp_path / "relay.toml"
    path.write_text(catalogs.CONFIG)
    return path


@pytest.fixture
def view(tmp_path: Path, config: Path) -> CatalogView:
    found = load_view(catalogs.write_export(tmp_path), load_settings(config))
    assert found is not None and found.available
    return found


@pytest.fixture
async def console(db_url: str, view: CatalogView) -> AsyncIterator[httpx.AsyncClient]:
    # Read-only: the catalog is a page to read, shown the same to every operator.
    app = build_console(db_url, TOKEN, read_only=True, catalog=view)
    async with serve(app) as url, httpx.AsyncClient(base_url=url, headers=AUTH) as client:
        yield client


async def endpoint(db_url: str, destination: str, *types: str, enabled: bool = True) -> int:
    [row] = await sql(
        db_url,
        "INSERT INTO outbox_endpoints (destination, url, secret, event_types, enabled)"
        " VALUES ($1, 'http://127.0.0.1:9/in', 'whsec_x', $2, $3) RETURNING id",
        destination,
        list(types),
        enabled,
    )
    return int(row["id"])


async def test_the_page_shows_every_type_escaped_with_its_endpoints(
    db_url: str, console: httpx.AsyncClient
) -> None:
    naming = await endpoint(db_url, catalogs.ENDPOINTS, "order.created")
    disabled = await endpoint(db_url, catalogs.ENDPOINTS, "order.created", enabled=False)
    every = await endpoint(db_url, catalogs.ENDPOINTS)
    typo = await endpoint(db_url, catalogs.ENDPOINTS, "order.created", "invoice.payed")
    elsewhere = await endpoint(db_url, catalogs.ENDPOINTS, "stock.moved")  # Kafka's type only
    r = await console.get("/catalog")
    assert r.status_code == 200
    page = r.text
    assert "<script>alert" not in page and "&lt;script&gt;alert(" in page
    assert "</pre><b>bold" not in page and "&lt;/pre&gt;&lt;b&gt;bold" in page
    for name in ("order.created", "invoice.paid", "stock.moved"):
        assert f'data-type="{name}"' in page and f'id="type-{name}"' in page
    order = _section(page, "order.created")
    assert "v3" in order and "the order id" in order and "warn (the catalog&#39;s)" in order
    assert "Kafka topic orders-topic" in order
    assert f"3 naming it (2 enabled; ids {naming}, {disabled}, {typo})" in order
    assert "1 taking every type (1 enabled)" in order
    assert f"ids {every}" not in page  # counted, not listed under every type
    invoice = _section(page, "invoice.paid")
    assert "deprecated" in invoice and "reject" in invoice
    # The webhook by its origin: never its path or query (a token may be there).
    assert "webhook to https://hooks.example.com" in invoice and "never-shown" not in page
    waiting = page[page.index('id="waiting"') : page.index("</table>", page.index('id="waiting"'))]
    rows = waiting.split("<tr>")[2:]
    assert len(rows) == 2, waiting
    assert "invoice.payed" in rows[0] and "not in the catalog" in rows[0] and str(typo) in rows[0]
    assert "stock.moved" in rows[1] and "declared for other destinations" in rows[1]
    assert str(elsewhere) in rows[1]
    assert 'href="/catalog">Catalog</a>' in page  # the navigation's link
    assert "<form" not in page.split("</header>")[1]  # read-only: nothing to act on


async def test_the_document_is_what_catalog_asyncapi_prints(
    tmp_path: Path, config: Path, console: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CATALOG_VIEW_TEST_SECRET")  # as in CI: the command needs none
    spec = str(tmp_path / "catalog.json")
    printed = CliRunner().invoke(
        main, ["catalog", "asyncapi", "--config", str(config), "--catalog", spec]
    )
    assert printed.exit_code == 0, printed.output
    r = await console.get("/catalog/asyncapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.text == printed.output
    assert r.json()["info"]["title"] == "shop events"
    page = (await console.get("/catalog")).text
    assert 'href="/catalog/asyncapi.json"' in page


async def test_without_a_catalog_the_page_says_how_to_configure_one(db_url: str) -> None:
    async with (
        serve(build_console(db_url, TOKEN)) as url,
        httpx.AsyncClient(base_url=url, headers=AUTH) as client,
    ):
        r = await client.get("/catalog")
        assert r.status_code == 200 and 'id="catalog-help"' in r.text
        assert "--catalog" in r.text and "[catalog]" in r.text
        assert 'href="/catalog">Catalog</a>' in r.text  # in the navigation
        r = await client.get("/catalog/asyncapi.json")
        assert r.status_code == 404 and "no catalog" in r.text
        assert (await client.get("/catalog", headers={"authorization": ""})).status_code == 401


async def test_a_catalog_without_the_configuration_has_no_document(
    db_url: str, tmp_path: Path
) -> None:
    view = load_view(catalogs.write_export(tmp_path), None)
    async with (
        serve(build_console(db_url, TOKEN, catalog=view)) as url,
        httpx.AsyncClient(base_url=url, headers=AUTH) as client,
    ):
        page = (await client.get("/catalog")).text
        assert 'data-type="order.created"' in page and "--config relay.toml" in page
        r = await client.get("/catalog/asyncapi.json")
        assert r.status_code == 404 and "--config relay.toml" in r.text


async def test_a_catalog_that_fails_to_load_is_said_and_the_relay_delivers(
    db_url: str, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_UI_TOKEN", TOKEN)
    hook = {
        "kind": "webhook",
        "url": receiver.url,
        "secrets": [SECRET],
        "allow_private_networks": True,
    }
    s = settings(
        db_url,
        "127.0.0.1:9",
        destinations={"hooks": hook},
        ui={"enabled": True},
        catalog={"source": "no_such_catalog_module_31:catalog"},
    )
    with capture_logs() as logs:
        async with running(s) as relay:
            assert relay.http is not None
            await sql(db_url, "INSERT INTO outbox (destination, payload) VALUES ('hooks', '{}')")
            await wait_until(
                lambda: sql(db_url, "SELECT 1 FROM outbox WHERE status = 'delivered'"),
                what="delivered despite the catalog",
            )
            base = f"http://127.0.0.1:{relay.http.port}"
            async with httpx.AsyncClient(base_url=base, headers=AUTH) as client:
                r = await client.get("/ui/catalog")
    assert r.status_code == 200 and 'id="catalog-unavailable"' in r.text
    assert "no_such_catalog_module_31" in r.text and "relay.catalog.unavailable" in r.text
    [logged] = [e for e in logs if e["event"] == "relay.catalog.unavailable"]
    assert logged["spec"] == "no_such_catalog_module_31:catalog"
    assert "no module" in logged["error"] and logged["log_level"] == "error"
    assert len(receiver.requests) == 1


def _section(page: str, name: str) -> str:
    start = page.index(f'id="type-{name}"')
    return page[start : page.index("</section>", start)]


def test_ui_and_portal_take_the_catalog() -> None:
    for command in ("ui", "portal"):
        shown = CliRunner().invoke(main, [command, "--help"], terminal_width=200)
        assert shown.exit_code == 0 and "--catalog SPEC" in shown.output
        assert "OUTBOX_CATALOG_SOURCE" in shown.output
