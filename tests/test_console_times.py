"""The console reads like a person's tool (issue #32), in Chromium against a real database:
times as "3 min ago" with the exact time on hover, kept true on a page left open and across
the overview's refreshes; a chart with nothing to draw says so, and draws once there is."""

from __future__ import annotations

import re

from playwright.async_api import Browser, Page

from relay.ui import ago

# The console and the browser of tests/test_console.py, its fixtures.
from tests.test_console import browser, chromium_path, console_url, signed_in, sql  # noqa: F401


async def shown(page: Page, selector: str) -> tuple[str, str | None, str | None]:
    """The text of the time element in ``selector``, its title and its datetime."""
    time = page.locator(f"{selector} time.ago")
    return (
        await time.inner_text(),
        await time.get_attribute("title"),
        await time.get_attribute("datetime"),
    )


async def test_times_read_as_ago_with_the_exact_time_on_hover(
    db_url: str,
    console_url: str,  # noqa: F811
    browser: Browser,  # noqa: F811
) -> None:
    [row] = await sql(
        db_url,
        "INSERT INTO outbox (destination, payload, status, attempts, last_error, created_at,"
        " run_after, finished_at) VALUES ('orders', '\\x00', 'failed', 3, 'boom',"
        " now() - interval '3 min 10 s', now() + interval '1 hour', now())"
        " RETURNING id, created_at",
    )
    [delivered] = await sql(
        db_url,
        "INSERT INTO outbox (destination, payload, status, created_at, delivered_at, finished_at)"
        " VALUES ('orders', '\\x00', 'delivered', now() - interval '3 h',"
        " now() - interval '2 h 5 min', now()) RETURNING delivered_at",
    )
    exact = ago.exact(row["created_at"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", exact)
    page, errors = await signed_in(browser, console_url)
    cell = "tr[data-destination='orders'] [data-field=last_delivered]"
    text, title, stamp = await shown(page, cell)
    assert (text, title, stamp) == ("2 h ago", ago.exact(delivered["delivered_at"]), title)
    await page.goto(f"{console_url}/rows")
    text, title, stamp = await shown(page, f"#rows tr[data-id='{row['id']}']")
    assert (text, title, stamp) == ("3 min ago", exact, exact)
    await page.goto(f"{console_url}/rows/{row['id']}")
    facts = page.locator("dl.facts")
    assert await facts.locator("dt:text-is('created') + dd").inner_text() == "3 min ago"
    # Ahead: when it is due again.
    assert await facts.locator("dt:text-is('run after') + dd").inner_text() == "in 59 min"
    assert await facts.locator("dt:text-is('delivered') + dd").inner_text() == "-"
    # Hovering shows the exact time (the title), as the browser reads it.
    await facts.locator("dt:text-is('created') + dd time").hover()
    assert await facts.locator("dt:text-is('created') + dd time").get_attribute("title") == exact
    assert not [e for e in errors if "Content Security Policy" in e], errors


async def test_times_stay_true_on_a_page_left_open_and_across_refreshes(
    db_url: str,
    console_url: str,  # noqa: F811
    browser: Browser,  # noqa: F811
) -> None:
    [row] = await sql(
        db_url,
        "INSERT INTO outbox (destination, payload, status, created_at, delivered_at, finished_at)"
        " VALUES ('orders', '\\x00', 'delivered', now() - interval '50 s',"
        " now() - interval '40 s', now()) RETURNING id, delivered_at",
    )
    page, errors = await signed_in(browser, console_url)
    await page.clock.install()  # the page's timers on a clock the test moves
    await page.reload()
    cell = "tr[data-destination='orders'] [data-field=last_delivered]"
    text, title, _ = await shown(page, cell)
    assert re.fullmatch(r"4\d s ago", text) and title == ago.exact(row["delivered_at"])
    # The overview's live part is swapped in every 5 s: its times come back as times.
    await page.evaluate("window.__sameDocument = true")
    await sql(db_url, "INSERT INTO outbox (destination, payload) VALUES ('orders', '\\x00')")
    await page.clock.fast_forward(6_000)
    pending = page.locator("tr[data-destination='orders'] [data-field=pending]")
    await pending.filter(has_text="1").wait_for(timeout=10_000)
    assert await page.evaluate("window.__sameDocument") is True
    text, title, _ = await shown(page, cell)
    assert re.fullmatch(r"4\d s ago", text) and title == ago.exact(row["delivered_at"])
    # Left open on the rows page, without a refresh: "50 s ago" becomes "1 min ago".
    await page.goto(f"{console_url}/rows")
    created = page.locator(f"#rows tr[data-id='{row['id']}'] time.ago")
    assert re.fullmatch(r"5\d s ago", await created.inner_text())
    await page.clock.fast_forward(31_000)
    await created.filter(has_text="1 min ago").wait_for(timeout=5_000)
    await page.clock.fast_forward(30 * 60_000)
    await created.filter(has_text="31 min ago").wait_for(timeout=5_000)
    assert not [e for e in errors if "Content Security Policy" in e], errors


async def test_an_empty_hour_says_so_and_the_chart_comes_with_deliveries(
    db_url: str,
    console_url: str,  # noqa: F811
    browser: Browser,  # noqa: F811
) -> None:
    page, errors = await signed_in(browser, console_url)
    await page.clock.install()  # the charts' refresh on a clock the test moves
    await page.reload()
    charts = page.locator(".chart")
    assert await charts.count() == 2
    for i in range(2):
        note = charts.nth(i).locator(".chart-note")
        await note.wait_for(timeout=10_000)
        assert (await note.inner_text()).startswith("No deliveries in the last hour")
        assert await note.is_visible()
    assert await page.locator(".chart canvas").count() == 0  # no empty frame drawn
    assert await charts.first.get_attribute("data-delivered") == "0"
    # Deliveries arrive: the next refresh of the charts (every 10 s) draws them.
    await sql(
        db_url,
        "INSERT INTO outbox (destination, payload, status, created_at, delivered_at, finished_at)"
        " SELECT 'orders', '\\x00', 'delivered', now() - interval '3 min',"
        " now() - interval '2 min', now() FROM generate_series(1, 4)",
    )
    await page.clock.fast_forward(10_500)
    await page.locator(".chart[data-delivered='4'] canvas").nth(1).wait_for(timeout=15_000)
    assert await page.locator(".chart-note").count() == 0
    # A destination's page says whose hour was quiet.
    await page.goto(f"{console_url}/destinations/orders")
    await page.locator(".chart canvas").nth(1).wait_for(timeout=10_000)
    await sql(db_url, "INSERT INTO outbox (destination, payload) VALUES ('emails', '\\x00')")
    await page.goto(f"{console_url}/destinations/emails")
    note = page.locator(".chart .chart-note").first
    await note.wait_for(timeout=10_000)
    assert await note.inner_text() == "No deliveries to emails in the last hour"
    assert not [e for e in errors if "Content Security Policy" in e or "Refused" in e], errors


async def test_deliveries_without_the_chart_script_are_said_not_left_blank(
    db_url: str,
    console_url: str,  # noqa: F811
    browser: Browser,  # noqa: F811
) -> None:
    await sql(
        db_url,
        "INSERT INTO outbox (destination, payload, status, created_at, delivered_at, finished_at)"
        " SELECT 'orders', '\\x00', 'delivered', now() - interval '3 min',"
        " now() - interval '2 min', now() FROM generate_series(1, 3)",
    )
    page, _ = await signed_in(browser, console_url)
    # A proxy or a blocker that drops the vendored script: the rest of the page still works.
    await page.route("**/static/uPlot.iife.min.js", lambda route: route.abort())
    await page.reload()
    note = page.locator(".chart").first.locator(".chart-note")
    await note.wait_for(timeout=10_000)
    assert (await note.inner_text()).startswith("3 delivered in the last hour; the chart could not")
