"""The console's page of the event catalog (``outbox.catalog``; ``[catalog] source`` or
``outbox-relay ui --catalog``): the declared types with their schemas and examples, the
endpoints that subscribe to each, the endpoints waiting for types the catalog does not declare
for their destination, and the AsyncAPI document ``outbox-relay catalog asyncapi`` prints."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import asyncpg
from starlette.requests import Request
from starlette.responses import Response

from relay.db.queries import render_ops
from relay.ui import queries
from relay.ui.pages import console_of

if TYPE_CHECKING:
    from relay.catalog.view import CatalogView


@dataclass
class Subscribed:
    """Endpoints of a destination naming an event type (or, ``event_type`` None, none)."""

    destination: str
    event_type: str | None
    endpoints: int
    enabled: int
    ids: list[int]


@dataclass
class TypeView:
    """A declared type as the page shows it."""

    name: str
    version: int
    description: str
    deprecated: bool
    validate: str
    destinations: list[tuple[str, str]]  # (name, how it carries the type)
    key: str | None
    schema: str
    examples: list[str]
    subscribed: list[Subscribed] = field(default_factory=list)
    every_type: list[Subscribed] = field(default_factory=list)


async def catalog(request: Request) -> Response:
    console = console_of(request)
    view = console.catalog
    if view is None or not view.available:
        return console.render(request, "catalog.html", view=view, types=[], waiting=[])
    found = await _subscriptions(request)
    types = [_type(view, t, found) for t in view.types]
    declared = view.declared()
    waiting = [
        s
        for s in found
        if s.event_type is not None and s.event_type not in declared.get(s.destination, ())
    ]
    return console.render(
        request,
        "catalog.html",
        view=view,
        types=types,
        waiting=waiting,
        names=view.names(),
        has_document=view.settings is not None,
    )


async def asyncapi_json(request: Request) -> Response:
    """The document, byte for byte what ``outbox-relay catalog asyncapi`` prints."""
    console = console_of(request)
    view = console.catalog
    document = view.asyncapi() if view is not None else None
    if document is None:
        why = (
            "no catalog: give the console one (--catalog, or [catalog] source in --config)"
            if view is None
            else f"the catalog {view.spec!r} could not be loaded: {view.error}"
            if not view.available
            else "the console was started without the relay's configuration (--config "
            "relay.toml): its destinations are the document's channels"
        )
        return console.render(
            request, "message.html", status_code=404, title="No AsyncAPI document", text=why
        )
    return Response(document, media_type="application/json")


async def _subscriptions(request: Request) -> list[Subscribed]:
    console = console_of(request)
    async with console.connection() as conn:
        table = f"{_quoted(console.schema)}.outbox_endpoints"
        if not await conn.fetchval(queries.TABLE_EXISTS, table):
            return []
        rows: Sequence[asyncpg.Record] = await conn.fetch(
            render_ops(queries.CATALOG_ENDPOINTS, console.schema)
        )
    return [
        Subscribed(r["destination"], r["event_type"], r["endpoints"], r["enabled"], list(r["ids"]))
        for r in rows
    ]


def _type(view: CatalogView, t: dict[str, Any], found: list[Subscribed]) -> TypeView:
    destinations = list(t["destinations"])
    mine = [s for s in found if s.destination in destinations]
    return TypeView(
        name=t["name"],
        version=t["version"],
        description=t.get("description") or "",
        deprecated=bool(t.get("deprecated")),
        validate=t.get("validate") or f"{view.export.get('validate') or 'off'} (the catalog's)",
        destinations=[(d, view.channel(d)) for d in destinations],
        key=t.get("key"),
        schema=_json(t.get("schema")),
        examples=[_json(e) for e in t.get("examples") or []],
        subscribed=[s for s in mine if s.event_type == t["name"]],
        every_type=[s for s in mine if s.event_type is None],
    )


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


def _quoted(schema: str) -> str:
    return '"' + schema.replace('"', '""') + '"'
