"""The portal API against its own OpenAPI document (schemathesis): every operation, with
inputs generated from the document (valid and not), over real HTTP to a portal on a real
database. No 500, and every answer (status, content type, body) is one the document allows."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from relay.catalog.view import CatalogView, load_view
from relay.portal.openapi import document
from tests.support import catalogs
from tests.support.portal import served_portal

schema = schemathesis.openapi.from_dict(document())
# What the issue asks (no 500; every answer, its status, content type, headers and body, one
# the document allows), that invalid input is refused and that a token is needed. Not
# positive_data_acceptance: a value the document allows may still be refused (a cursor this
# list never gave, a URL that does not resolve), with a 400 the document describes.
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
    checks.ignored_auth,
]


class Background:
    """The portal served from a thread of its own (schemathesis calls it synchronously), with
    an event catalog: its types listed, the others refused."""

    def __init__(self, db_url: str, catalog: CatalogView | None) -> None:
        self.catalog = catalog
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.url = ""
        self.token = ""
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(db_url,), daemon=True)

    def _run(self, db_url: str) -> None:
        try:
            asyncio.run(self._serve(db_url))
        except BaseException as exc:  # said by the test, not lost in the thread
            self.failed = exc
            self.ready.set()

    async def _serve(self, db_url: str) -> None:
        async with served_portal(db_url, catalog=self.catalog) as p:
            from relay.portal.limits import Limits, Rate

            p.state.limits = p.state.write_limits = Limits(Rate(10_000, 10_000))
            async with p.client("acme") as c:  # one endpoint, one message: ids to find
                ep = (await c.post("/endpoints", json={"url": "http://127.0.0.1:9/in"})).json()
                await c.post(f"/endpoints/{ep['id']}/test", json={})
            self.url, self.token = f"{p.url}/api", p.token("acme")
            self.ready.set()
            while not self.stop.is_set():
                await asyncio.sleep(0.05)


@pytest.fixture
def portal(db_url: str, tmp_path: Path) -> Iterator[Background]:
    bg = Background(db_url, load_view(catalogs.write_export(tmp_path), None))
    bg.thread.start()
    assert bg.ready.wait(30), "the portal did not start"
    if bg.failed is not None:
        raise bg.failed
    try:
        yield bg
    finally:
        bg.stop.set()
        bg.thread.join(30)


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_the_api_keeps_to_its_document(case: Any, portal: Background) -> None:
    case.call_and_validate(
        base_url=portal.url, headers={"Authorization": f"Bearer {portal.token}"}, checks=CHECKS
    )
