"""The portal's pages without a browser: sign-in, the session cookie's attributes, the
checks on every form (CSRF, Sec-Fetch-Site), and that a session and a link's token are not
each other."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from outbox.endpoints import portal_tokens as pt
from relay.catalog.view import load_view
from relay.portal import sessions
from tests.support import catalogs
from tests.support.portal import Served, served_portal


@pytest.fixture
async def portal(db_url: str) -> AsyncIterator[Served]:
    async with served_portal(db_url) as p:
        yield p


async def signed_in(portal: Served, tenant: str = "acme") -> tuple[str, str]:
    """The session cookie's value and the pages' CSRF value, signed in by a link's token."""
    async with portal.client() as c:
        r = await c.post(
            f"{portal.url}/session",
            data={"token": portal.token(tenant)},
            headers={"sec-fetch-site": "same-origin"},
        )
    assert r.status_code == 303 and r.headers["location"].endswith("/portal/endpoints")
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "Secure" in cookie and "SameSite=strict" in cookie
    assert "Path=/portal/" in cookie
    value = cookie.split(";")[0].split("=", 1)[1]
    access = pt.verify_portal_token(value, key=portal.keys, aud=pt.session_audience("public"))
    scope = sessions.Scope.of(access, "public")
    return value, sessions.csrf(portal.keys, scope)


async def test_a_page_needs_a_session_and_carries_the_headers(portal: Served) -> None:
    async with portal.client() as c:
        r = await c.get(f"{portal.url}/endpoints")
        assert r.status_code == 303 and r.headers["location"].endswith("/portal/")
        landing = await c.get(f"{portal.url}/")
        assert "Access token" in landing.text
        assert "frame-ancestors 'none'" in landing.headers["content-security-policy"]
        assert landing.headers["x-frame-options"] == "DENY"
    value, _ = await signed_in(portal)
    async with portal.client() as c:
        r = await c.get(f"{portal.url}/endpoints", headers={"cookie": f"outbox_portal={value}"})
        assert r.status_code == 200 and "Add an endpoint" in r.text


async def test_sign_in_from_another_site_is_refused(portal: Served) -> None:
    async with portal.client() as c:
        for headers in ({"sec-fetch-site": "cross-site"}, {"origin": "https://evil.example"}):
            r = await c.post(
                f"{portal.url}/session", data={"token": portal.token("acme")}, headers=headers
            )
            assert r.status_code == 403 and "set-cookie" not in r.headers


async def test_a_form_without_its_csrf_value_or_from_elsewhere_is_refused(portal: Served) -> None:
    value, csrf = await signed_in(portal)
    cookie = {"cookie": f"outbox_portal={value}"}
    form = {"url": "http://127.0.0.1:9/in"}
    same, cross = {**cookie, "sec-fetch-site": "same-origin"}, {**cookie, "sec-fetch-site": "x"}
    with_csrf = {**form, "csrf": csrf}
    async with portal.client() as c:
        add = f"{portal.url}/actions/add"
        r = await c.post(add, data=form, headers=same)
        assert r.status_code == 403 and "CSRF" in r.text
        r = await c.post(add, data=with_csrf, headers=cross)
        assert r.status_code == 403
        r = await c.post(add, data=with_csrf, headers=same)
        assert r.status_code == 200 and "whsec_" in r.text  # the secret, once, on this answer
        other, _ = await signed_in(portal, "other")
        theirs = {"cookie": f"outbox_portal={other}", "sec-fetch-site": "same-origin"}
        r = await c.post(add, data=with_csrf, headers=theirs)
        assert r.status_code == 403  # another session's CSRF value


async def test_a_session_is_no_bearer_token_and_a_link_token_no_session(portal: Served) -> None:
    value, _ = await signed_in(portal)
    async with portal.client() as c:
        r = await c.get("/endpoints", headers={"authorization": f"Bearer {value}"})
        assert r.status_code == 401
        r = await c.get(
            f"{portal.url}/endpoints", headers={"cookie": f"outbox_portal={portal.token('acme')}"}
        )
        assert r.status_code == 303  # back to sign-in


async def test_embedding_opens_the_frame_to_the_embed_origins_and_the_cookie_to_frames(
    db_url: str,
) -> None:
    import pytest as _pytest

    from relay.config.portal import check_origins

    origin = "https://app.example.com"
    async with served_portal(db_url, embed_origins=(origin,)) as p, p.client() as c:
        r = await c.get(f"{p.url}/")
        assert f"frame-ancestors 'self' {origin}" in r.headers["content-security-policy"]
        assert "x-frame-options" not in r.headers
        r = await c.post(
            f"{p.url}/session",
            data={"token": p.token("acme")},
            headers={"sec-fetch-site": "same-origin"},
        )
        assert r.status_code == 303, r.text
        cookie = r.headers["set-cookie"]
        assert "SameSite=none" in cookie and "Partitioned" in cookie and "Secure" in cookie
    for bad in ("https://app.example.com/path", "*", "https://a.example https://b.example", "x"):
        with _pytest.raises(ValueError, match="scheme, host and port"):
            check_origins((bad,))


async def test_an_answer_shows_its_hidden_characters_and_no_markup(
    db_url: str, portal: Served
) -> None:
    """A receiver's answer is shown as text: a bidi override or an escape sequence written out
    (it could reorder or hide what the page says), markup escaped."""
    import asyncpg

    from outbox.dburl import to_asyncpg_dsn

    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        ep = await conn.fetchval(
            "INSERT INTO outbox_endpoints (destination, url, tenant, secret)"
            " VALUES ('d', 'http://127.0.0.1:9/', 'acme', 'whsec_x') RETURNING id"
        )
        event = await conn.fetchval(
            "INSERT INTO outbox (destination, payload, content_type, tenant, status)"
            " VALUES ('d', '{}', 'application/json', 'acme', 'delivered') RETURNING id"
        )
        delivery = await conn.fetchval(
            "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination)"
            " VALUES ($1, $2, 'd') RETURNING id",
            event,
            ep,
        )
        await conn.execute(
            "INSERT INTO outbox_attempts (delivery_id, event_id, endpoint_id, http_status,"
            " response) VALUES ($1, $2, $3, 500, $4)",
            delivery,
            event,
            ep,
            "paid\u202e<script>alert(1)</script>\x1b[31m",
        )
    finally:
        await conn.close()
    value, _ = await signed_in(portal)
    async with portal.client() as c:
        r = await c.get(
            f"{portal.url}/messages/{delivery}", headers={"cookie": f"outbox_portal={value}"}
        )
    assert r.status_code == 200
    assert "\\u202e" in r.text and "\\x1b" in r.text
    assert "\u202e" not in r.text and "\x1b" not in r.text and "<script>alert" not in r.text


async def test_the_event_types_page_and_the_add_forms_choices(db_url: str, tmp_path: Path) -> None:
    view = load_view(catalogs.write_export(tmp_path), None)
    async with served_portal(db_url, catalog=view) as portal:
        value, csrf = await signed_in(portal)
        same = {"cookie": f"outbox_portal={value}", "sec-fetch-site": "same-origin"}
        async with portal.client() as c:
            r = await c.get(f"{portal.url}/event-types", headers=same)
            assert r.status_code == 200
            page = r.text
            assert 'data-type="order.created"' in page and 'data-type="invoice.paid"' in page
            assert "stock.moved" not in page  # carried by Kafka only
            # The descriptions through visible(): escaped, the bidi override written out.
            assert "<script>alert" not in page and "&lt;script&gt;alert(" in page
            assert "\u202e" not in page and "\\u202e" in page
            assert "&lt;/pre&gt;&lt;b&gt;bold" in page  # an example, as text
            assert 'href="/portal/event-types">Event types</a>' in page  # in the navigation
            form = (await c.get(f"{portal.url}/endpoints", headers=same)).text
            boxes = form[form.index('id="event-type-choices"') : form.index("</fieldset>")]
            assert boxes.count('type="checkbox" name="event_type"') == 2
            assert "<legend>" in boxes and 'value="invoice.paid"' in boxes
            add = f"{portal.url}/actions/add"
            url = "http://127.0.0.1:9/in"
            chosen = {"url": url, "csrf": csrf, "event_type": ["order.created", "invoice.paid"]}
            r = await c.post(add, data=chosen, headers=same)
            assert r.status_code == 200 and "whsec_" in r.text
            typo = {"url": url, "csrf": csrf, "event_type": "nope"}
            r = await c.post(add, data=typo, headers=same)
            assert r.status_code == 400 and "&#39;nope&#39;" in r.text
        async with portal.client("acme") as api:
            [made] = (await api.get("/endpoints")).json()["items"]
            assert made["event_types"] == ["order.created", "invoice.paid"]
            held = await api.post("/endpoints", json={"url": "http://127.0.0.1:9/in"})
        # An endpoint naming a type the catalog lacks (made before it, or by the operator).
        async with portal.state.connection() as conn:
            await conn.execute(
                "UPDATE outbox_endpoints SET event_types = '{order.created,invoice.payed}'"
                " WHERE id = $1",
                held.json()["id"],
            )
        async with portal.client() as c:
            r = await c.get(f"{portal.url}/endpoints/{held.json()['id']}", headers=same)
            assert 'id="unknown-types"' in r.text and "not listed: invoice.payed<" in r.text
            r = await c.get(f"{portal.url}/endpoints/{made['id']}", headers=same)
            assert 'id="unknown-types"' not in r.text
