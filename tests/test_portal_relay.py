"""[portal] in the relay's configuration: served at /portal by the relay's listener beside
the console's /ui, and refused, with the reason, when it cannot work."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from outbox.endpoints import portal_tokens as pt
from tests.support.relays import running, settings

ENDPOINTS = {"kind": "endpoints", "allow_private_networks": True}


def portal_settings(db_url: str, **portal: Any) -> Any:
    return settings(
        db_url,
        "127.0.0.1:9",
        destinations={"customer-events": ENDPOINTS, "hooks": {
            "kind": "webhook", "url": "http://127.0.0.1:9/", "secrets": ["whsec_" + "A" * 32]}},
        portal={"enabled": True, **portal},
    )  # fmt: skip


async def test_the_relay_serves_the_portal_when_enabled(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = pt.new_portal_key()
    monkeypatch.setenv(pt.KEY_VARIABLE, key)
    s = portal_settings(db_url, allow_private_networks=True)
    async with running(s) as relay:
        assert relay.http is not None
        base = f"http://127.0.0.1:{relay.http.port}"
        token = pt.portal_token(tenant="acme", key=key)
        auth = {"authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=base) as c:
            assert (await c.get("/portal/api/openapi.json")).status_code == 200
            assert (await c.get("/portal/api/endpoints")).status_code == 401
            made = await c.post("/portal/api/endpoints", json={"url": "http://127.0.0.1:9/x"},
                                headers=auth)  # fmt: skip
            assert made.status_code == 201 and made.json()["destination"] == "customer-events"
            assert (await c.get("/portal")).headers["location"] == "/portal/"
            assert (await c.get("/metrics")).status_code == 200  # unchanged


@pytest.mark.parametrize(
    ("portal", "http", "says"),
    [
        ({}, {}, "OUTBOX_PORTAL_KEY"),
        ({"key": "opk_short"}, {}, "portal.key"),
        ({"destinations": ["hooks"]}, {}, "not a destination of kind"),
        ({"embed_origins": ["https://x.example/path"]}, {}, "scheme, host and port"),
        ({}, {"enabled": False}, "[http] listener"),
    ],
)
def test_a_portal_that_cannot_work_is_refused_naming_why(
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    portal: dict[str, Any],
    http: dict[str, Any],
    says: str,
) -> None:
    from relay.config import ConfigError

    # OUTBOX_PORTAL_KEY is portal.key (the environment overrides the file): set only where
    # the key is not what is wrong.
    if (portal or http) and "key" not in portal:
        monkeypatch.setenv(pt.KEY_VARIABLE, pt.new_portal_key())
    else:
        monkeypatch.delenv(pt.KEY_VARIABLE, raising=False)
    with pytest.raises((ConfigError, ValueError), match=says.replace("[", r"\[")):
        s = portal_settings(db_url, **portal)
        if http:
            settings(
                db_url, "127.0.0.1:9", destinations={"customer-events": ENDPOINTS},
                portal={"enabled": True}, http=http,
            )  # fmt: skip
        assert s is None
