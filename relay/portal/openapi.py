"""The portal API's OpenAPI 3.1 document, served at ``/portal/api/openapi.json``: the bodies'
schemas from relay/portal/schemas.py, the operations from the table below (what the handlers
of relay/portal/api.py serve). schemathesis holds the API to it in the test suite."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from relay.portal import schemas as s
from relay.portal.reads import MAX_LIMIT, STATUSES

MAX_ID = 2**63 - 1
# Every answer but the operation's own is a problem (RFC 9457) of one of these.
PROBLEMS = {
    "400": "The request is refused: a value the API does not take (the detail says which).",
    "401": "No valid token: absent, malformed, forged, expired, or for another outbox.",
    "403": "The token may read, not change.",
    "404": "No such object of this tenant.",
    "409": "The object's state refuses it now (the detail says why).",
    "413": "The body is over 16 KiB.",
    "415": "The body is not application/json.",
    "429": "Too many requests of this tenant: Retry-After says when to try again.",
    "503": "The database cannot answer now: try again shortly.",
}


@dataclass(frozen=True)
class Op:
    method: str
    path: str
    id: str
    summary: str
    answer: tuple[int, type[BaseModel]]
    body: type[BaseModel] | None = None
    query: tuple[str, ...] = ()
    path_id: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


OPS = (
    Op("get", "/endpoints", "listEndpoints", "The tenant's endpoints, newest first.",
       (200, s.EndpointList), query=("limit", "cursor")),
    Op("post", "/endpoints", "createEndpoint", "Add an endpoint; its secret is shown once.",
       (201, s.EndpointWithSecret), body=s.EndpointIn),
    Op("get", "/endpoints/{id}", "getEndpoint", "An endpoint with its deliveries by status.",
       (200, s.Endpoint), path_id=True),
    Op("patch", "/endpoints/{id}", "updateEndpoint",
       "Change its url, event types, description or rate limit.",
       (200, s.Endpoint), body=s.EndpointPatch, path_id=True),
    Op("delete", "/endpoints/{id}", "deleteEndpoint",
       "Delete it; its unfinished deliveries are cancelled.", (200, s.Deleted), path_id=True),
    Op("post", "/endpoints/{id}/disable", "disableEndpoint",
       "Stop sending to it; its queue is kept.", (200, s.Endpoint), body=s.DisableIn,
       path_id=True),
    Op("post", "/endpoints/{id}/enable", "enableEndpoint", "Send to it again, its queue first.",
       (200, s.Endpoint), path_id=True),
    Op("post", "/endpoints/{id}/rotate-secret", "rotateSecret",
       "A new secret, shown once; the previous one still signs for a while.",
       (200, s.EndpointWithSecret), body=s.RotateIn, path_id=True),
    Op("post", "/endpoints/{id}/test", "sendTest", "Send it a test event.",
       (202, s.SentTest), body=s.SendTestIn, path_id=True),
    Op("get", "/messages", "listMessages", "The tenant's messages (a delivery each), newest first.",
       (200, s.MessageList),
       query=("limit", "cursor", "endpoint_id", "status", "event_type", "since", "until")),
    Op("get", "/messages/{id}", "getMessage", "A message, with its event's payload while kept.",
       (200, s.MessageDetail), path_id=True),
    Op("get", "/messages/{id}/attempts", "listAttempts", "A message's attempts, newest first.",
       (200, s.AttemptList), query=("limit", "cursor"), path_id=True),
    Op("post", "/messages/{id}/replay", "replayMessage", "Send a message again.",
       (202, s.Replayed), path_id=True),
    Op("post", "/replays", "replayRange",
       "Count the messages of a window (no selection), or send exactly those counted.",
       (200, s.RangeReplay), body=s.ReplayIn),
    Op("get", "/event-types", "listEventTypes",
       "The event types an endpoint may subscribe to, with their schemas (the operator's "
       "event catalog; empty without one).", (200, s.EventTypeList)),
)  # fmt: skip

QUERY: dict[str, dict[str, Any]] = {
    "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": 50},
    "cursor": {"type": "string", "maxLength": 64},
    "endpoint_id": {"type": "integer", "minimum": 1, "maximum": MAX_ID},
    "status": {"type": "string", "enum": list(STATUSES)},
    "event_type": {"type": "string", "minLength": 1, "maxLength": 255},
    "since": {"type": "string", "format": "date-time"},
    "until": {"type": "string", "format": "date-time"},
}
REF = "#/components/schemas/{model}"


QUERIES = {op.id: frozenset(op.query) for op in OPS}


@functools.cache
def document() -> dict[str, Any]:
    """The OpenAPI document (built once)."""
    models: list[tuple[type[BaseModel], Any]] = [(s.Problem, "serialization")]
    for op in OPS:
        models.append((op.answer[1], "serialization"))
        if op.body is not None:
            models.append((op.body, "validation"))
    keys, defs = models_json_schema(list(dict.fromkeys(models)), ref_template=REF)
    paths: dict[str, dict[str, Any]] = {}
    for op in OPS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, keys)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "outbox-relay tenant portal API",
            "version": "1",
            "description": "A tenant's endpoints, messages and replays. Every call sees and "
            "changes only the tenant of its token (docs/portal.md).",
        },
        "servers": [{"url": "/portal/api"}],
        "security": [{"portalToken": []}],
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {
                "portalToken": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}
            },
        },
    }


def _operation(op: Op, keys: Mapping[tuple[Any, Any], Any]) -> dict[str, Any]:
    status, model = op.answer
    responses: dict[str, Any] = {
        str(status): {
            "description": op.summary,
            "content": {"application/json": {"schema": keys[(model, "serialization")]}},
        }
    }
    problem = {"application/problem+json": {"schema": keys[(s.Problem, "serialization")]}}
    for code, text in PROBLEMS.items():
        answer: dict[str, Any] = {"description": text, "content": problem}
        if code == "429":
            answer["headers"] = {"Retry-After": {"schema": {"type": "integer", "minimum": 1}}}
        responses[code] = answer
    params = [
        {"name": name, "in": "query", "required": False, "schema": QUERY[name]} for name in op.query
    ]
    if op.path_id:
        schema = {"type": "integer", "minimum": 1, "maximum": MAX_ID}
        params.insert(0, {"name": "id", "in": "path", "required": True, "schema": schema})
    out: dict[str, Any] = {"operationId": op.id, "summary": op.summary, "responses": responses}
    if params:
        out["parameters"] = params
    if op.body is not None:
        # Required where the body has a required field; else an empty body takes the defaults.
        required = any(f.is_required() for f in op.body.model_fields.values())
        out["requestBody"] = {
            "required": required,
            "content": {"application/json": {"schema": keys[(op.body, "validation")]}},
        }
    return out
