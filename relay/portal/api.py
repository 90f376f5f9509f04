"""The portal API's handlers: JSON in and out (relay/portal/schemas.py), each one call of the
portal's reads, changes or replays with the request's :class:`Scope` (the gate in
relay/portal/app.py verified its token), every failure a problem (RFC 9457) that names only
the tenant's own input."""

from __future__ import annotations

import base64
import functools
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any, TypeVar

import asyncpg
import structlog
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from outbox.endpoints import Endpoint as Registered
from outbox.errors import describe
from relay.db.store import UNAVAILABLE
from relay.ops.common import AdminError
from relay.ops.selection import SelectionChanged
from relay.portal import changes, reads, replays
from relay.portal import schemas as s
from relay.portal.openapi import MAX_ID, QUERIES, document
from relay.portal.scope import Scope
from relay.portal.state import Portal

log = structlog.get_logger("relay.portal")

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[Request, Portal, Scope, asyncpg.Connection], Awaitable[Response]]


class Problem(Exception):
    def __init__(self, status: int, title: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.title, self.detail = status, title, detail


def problem(status: int, title: str, detail: str, **headers: str) -> Response:
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail}
    return JSONResponse(
        body, status_code=status, media_type="application/problem+json", headers=headers
    )


def _answer(model: BaseModel, status: int = 200) -> Response:
    return JSONResponse(model.model_dump(mode="json", by_alias=True), status_code=status)


def _refusal(exc: Exception) -> Response | None:
    """The problem an exception of a handler is, or None (a bug: 500, logged)."""
    if isinstance(exc, Problem):
        return problem(exc.status, exc.title, exc.detail)
    if isinstance(exc, reads.NotFound):
        return problem(404, "Not found", "no such object of this tenant")
    if isinstance(exc, PermissionError):
        return problem(403, "Forbidden", "this token may read, not change")
    if isinstance(exc, changes.Conflict | SelectionChanged):
        return problem(409, "Conflict", str(exc))
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        return problem(400, "Refused", f"{where}: {first['msg']}")
    if isinstance(exc, UNAVAILABLE):
        return problem(503, "Unavailable", "the database cannot answer now: try again shortly")
    if isinstance(exc, asyncpg.QueryCanceledError):
        return problem(503, "Too slow", "the query took too long: narrow the filters")
    if isinstance(exc, AdminError | ValueError | OverflowError | asyncpg.DataError):
        return problem(400, "Refused", describe(exc))
    return None


def operation(name: str) -> Callable[[Handler], Callable[[Request], Awaitable[Response]]]:
    """A handler of operation ``name``: its scope and a connection, its failures as problems,
    and its change logged for the audit (tenant, token id, never the token)."""

    def wrap(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        @functools.wraps(handler)
        async def run(request: Request) -> Response:
            portal: Portal = request.app.state.portal
            scope: Scope = request.scope["state"]["portal_scope"]
            unknown = set(request.query_params) - QUERIES[name]
            if unknown:
                # A misspelt filter would otherwise be ignored: the list unfiltered.
                return problem(400, "Refused", f"unknown parameter: {sorted(unknown)[0]!r}")
            try:
                async with portal.connection() as conn:
                    response = await handler(request, portal, scope, conn)
            except Exception as exc:
                refused = _refusal(exc)
                if refused is None:
                    log.exception("relay.portal.error", tenant=scope.tenant, action=name)
                    return problem(500, "Error", "the portal failed; its log has the details")
                log.info(
                    "relay.portal.refused",
                    tenant=scope.tenant,
                    token_id=scope.token_id,
                    action=name,
                    status=refused.status_code,
                )
                return refused
            if request.method not in ("GET", "HEAD"):
                log.info(
                    "relay.portal.action",
                    tenant=scope.tenant,
                    token_id=scope.token_id,
                    action=name,
                    endpoint=request.path_params.get("id"),
                    status=response.status_code,
                )
            return response

        return run

    return wrap


async def _body(request: Request, model: type[M]) -> M:
    raw = await request.body()
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if not raw and not model.model_fields.keys() & _required(model):
        return model()
    if kind != "application/json":
        raise Problem(415, "Unsupported", "send the body as application/json")
    return model.model_validate_json(raw)


def _required(model: type[BaseModel]) -> set[str]:
    return {n for n, f in model.model_fields.items() if f.is_required()}


def _id(request: Request) -> int:
    value = request.path_params["id"]
    if not 1 <= value <= MAX_ID:
        raise reads.NotFound(value)
    return int(value)


def _query(request: Request, name: str, kind: Callable[[str], Any]) -> Any:
    text = request.query_params.get(name)
    if text is None:
        return None
    try:
        return kind(text)
    except (ValueError, OverflowError):
        raise Problem(400, "Refused", f"{name}: not a valid value") from None


def _int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_ID:
        raise ValueError(text)
    return int(text)


def _event_type(text: str) -> str:
    if not 1 <= len(text) <= 255:
        raise ValueError(text)
    return text


def _time(text: str) -> datetime:
    at = datetime.fromisoformat(text)
    if at.tzinfo is None:
        raise ValueError(text)
    return at


def _page(request: Request) -> tuple[int, str | None]:
    limit = _query(request, "limit", _int) or 50
    if limit > reads.MAX_LIMIT:
        raise Problem(400, "Refused", f"limit: at most {reads.MAX_LIMIT}")
    return limit, request.query_params.get("cursor")


# --- endpoints --------------------------------------------------------------------------------


def _endpoint(view: reads.EndpointView) -> s.Endpoint:
    fields = asdict(view)
    counts = fields.pop("counts")
    return s.Endpoint(**fields, deliveries=s.Counts(**counts) if counts else None)


def _with_secret(ep: Registered) -> s.EndpointWithSecret:
    assert ep.secret is not None
    return s.EndpointWithSecret(
        id=ep.id,
        destination=ep.destination,
        url=ep.url,
        event_types=list(ep.event_types),
        description=ep.description,
        rate_limit=ep.rate_limit,
        enabled=ep.enabled,
        secret=ep.secret,
        previous_secret_until=ep.previous_secret_until,
    )


@operation("listEndpoints")
async def list_endpoints(r: Request, p: Portal, sc: Scope, c: asyncpg.Connection) -> Response:
    limit, cursor = _page(r)
    page = await reads.endpoints(c, sc, limit=limit, cursor=cursor)
    items = [_endpoint(e) for e in page.items]
    return _answer(s.EndpointList(items=items, next_cursor=page.next_cursor))


@operation("createEndpoint")
async def create_endpoint(r: Request, p: Portal, sc: Scope, c: asyncpg.Connection) -> Response:
    sc.require_write()
    new = await _body(r, s.EndpointIn)
    made = await changes.create(c, sc, p.policy, **new.model_dump())
    return _answer(_with_secret(made), 201)


@operation("getEndpoint")
async def get_endpoint(r: Request, p: Portal, sc: Scope, c: asyncpg.Connection) -> Response:
    return _answer(_endpoint(await reads.endpoint(c, sc, _id(r))))


@operation("updateEndpoint")
async def update_endpoint(r: Request, p: Portal, sc: Scope, c: asyncpg.Connection) -> Response:
    sc.require_write()
    patch = await _body(r, s.EndpointPatch)
    asked = patch.model_dump(exclude_unset=True)
    if asked.pop("no_rate_limit", False):
        asked["rate_limit"] = None
    asked = {k: v for k, v in asked.items() if v is not None or k == "rate_limit"}
    endpoint_id = _id(r)
    if asked:
        await changes.update(c, sc, p.policy, endpoint_id, asked)
    return _answer(_endpoint(await reads.endpoint(c, sc, endpoint_id)))


@operation("deleteEndpoint")
async def delete_endpoint(r: Request, p: Portal, sc: Scope, c: asyncpg.Connection) -> Response:
    endpoint_id = _id(r)
    cancelled = await changes.delete(c, sc, endpoint_id)
    return _answer(s.Deleted(id=endpoint_id, cancelled=cancelled))


@operation("disableEndpoint")
async def disable_endpoint(r: Request, p: Portal, sc: Scope, c: asyncpg.Connection) -> Response:
    sc.require_write()
    asked = await _body(r, s.DisableIn)
    await changes.disable(c, sc, _id(r), asked.reason)
    return _answer(_endpoint(await reads.endpoint(c, sc, _id(r))))


@operation("enableEndpoint")
async def enable_endpoint(r: Request, p: Portal, sc: Scope, c: asyncpg.Connection) -> Response:
    await changes.enable(c, sc, _id(r))
    return _answer(_endpoint(await reads.endpoint(c, sc, _id(r))))


@operation("rotateSecret")
async def rotate_secret(r: Request, p: Portal, sc: Scope, c: asyncpg.Connection) -> Response:
    sc.require_write()
    asked = await _body(r, s.RotateIn)
    keep = timedelta(hours=asked.keep_previous_hours)
    return _answer(_with_secret(await changes.rotate_secret(c, sc, _id(r), keep)))


@operation("sendTest")
async def send_test(r: Request, p: Portal, sc: Scope, c: asyncpg.Connection) -> Response:
    sc.require_write()
    asked = await _body(r, s.SendTestIn)
    sent = await changes.send_test(c, sc, _id(r), asked.event_type)
    return _answer(s.SentTest(message_id=sent.delivery_id, event_id=sent.event_id), 202)


# --- messages ---------------------------------------------------------------------------------


def _message(m: reads.Message) -> dict[str, Any]:
    return {**asdict(m), "webhook_id": m.webhook_id}


@operation("listMessages")
async def list_messages(r: Request, p: Portal, sc: Scope, c: asyncpg.Connection) -> Response:
    limit, cursor = _page(r)
    filters = reads.MessageFilters(
        endpoint_id=_query(r, "endpoint_id", _int),
        status=r.query_params.get("status"),
        event_type=_query(r, "event_type", _event_type),
        since=_query(r, "since", _time),
        until=_query(r, "until", _time),
    )
    page = await reads.messages(c, sc, filters, limit=limit, cursor=cursor)
    items = [s.Message(**_message(m)) for m in page.items]
    return _answer(s.MessageList(items=items, next_cursor=page.next_cursor))


@operation("getMessage")
async def get_message(r: Request, p: Portal, sc: Scope, c: asyncpg.Connection) -> Response:
    found = await reads.message(c, sc, _id(r))
    text, encoding = None, None
    if found.payload is not None:
        try:
            text, encoding = found.payload.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            text, encoding = base64.b64encode(found.payload).decode(), "base64"
    return _answer(
        s.MessageDetail(
            **_message(found.message),
            event_kept=found.event_kept,
            content_type=found.content_type,
            payload=text,
            payload_encoding=encoding,
            payload_truncated=found.payload_truncated,
        )
    )


@operation("listAttempts")
async def list_attempts(r: Request, p: Portal, sc: Scope, c: asyncpg.Connection) -> Response:
    limit, cursor = _page(r)
    page = await reads.attempts(c, sc, _id(r), limit=limit, cursor=cursor)
    items = [s.Attempt(**asdict(a)) for a in page.items]
    return _answer(s.AttemptList(items=items, next_cursor=page.next_cursor))


@operation("replayMessage")
async def replay_message(r: Request, p: Portal, sc: Scope, c: asyncpg.Connection) -> Response:
    done = await replays.replay_message(c, sc, _id(r))
    return _answer(
        s.Replayed(replayed=done.replayed, running=done.running, not_taken=done.mismatched), 202
    )


@operation("replayRange")
async def replay_range(r: Request, p: Portal, sc: Scope, c: asyncpg.Connection) -> Response:
    asked = await _body(r, s.ReplayIn)
    window = replays.Window(asked.since_seconds, asked.endpoint_id, asked.failed_only)
    if asked.selection is None:
        counted = await replays.count(c, sc, window)
        per = [_replayed(e) for e in counted.per_endpoint]
        sealed = replays.seal(p.keys, sc, window, counted.selections)
        return _answer(
            s.RangeReplay(done=False, total=counted.total, endpoints=per, selection=sealed)
        )
    selections = replays.unseal(p.keys, sc, window, asked.selection)
    if selections is None:
        raise Problem(400, "Refused", "selection: not the count of this window: count again")
    done = await replays.replay(c, sc, window, selections)
    per = [_replayed(e) for e in done]
    total = sum(e.replayed for e in done)
    return _answer(s.RangeReplay(done=True, total=total, endpoints=per, selection=None))


def _replayed(e: Any) -> s.EndpointReplay:
    return s.EndpointReplay(
        endpoint_id=e.endpoint_id,
        replayed=e.replayed,
        by_status=e.by_status,
        skipped_event_gone=e.skipped_event_gone,
        skipped_not_taken=e.skipped_not_taken,
    )


# --- event types ------------------------------------------------------------------------------


@operation("listEventTypes")
async def list_event_types(r: Request, p: Portal, sc: Scope, c: asyncpg.Connection) -> Response:
    """The catalog's types on the portal's destinations: the same for every tenant."""
    items = [
        s.EventTypeOut.model_validate(
            {k: t.get(k) for k in ("name", "version", "description", "deprecated", "schema")}
            | {"examples": list(t.get("examples") or [])}
        )
        for t in p.event_types()
    ]
    return _answer(s.EventTypeList(items=items))


async def openapi_json(request: Request) -> Response:
    return JSONResponse(document())
