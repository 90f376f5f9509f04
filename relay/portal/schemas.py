"""The portal API's bodies, in and out, as pydantic models: they validate what a tenant sends
(no field but those listed: a tenant, destination change or private-network flag cannot even be
sent) and are the source of the OpenAPI document (relay/portal/openapi.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from relay.portal.reads import STATUSES

Status = Literal["pending", "running", "delivered", "failed", "cancelled"]
assert tuple(Status.__args__) == STATUSES  # type: ignore[attr-defined]

Text = Annotated[str, Field(max_length=2048)]
EventType = Annotated[str, Field(min_length=1, max_length=255)]


class In(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- in -----------------------------------------------------------------------------------


class EndpointIn(In):
    url: Text
    event_types: Annotated[list[EventType], Field(max_length=100)] = []
    description: Annotated[str, Field(max_length=1000)] = ""
    rate_limit: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    destination: Annotated[str, Field(min_length=1, max_length=255)] | None = None


class EndpointPatch(In):
    url: Text | None = None
    event_types: Annotated[list[EventType], Field(max_length=100)] | None = None
    description: Annotated[str, Field(max_length=1000)] | None = None
    rate_limit: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    no_rate_limit: bool = False


class DisableIn(In):
    reason: Annotated[str, Field(max_length=500)] | None = None


class RotateIn(In):
    keep_previous_hours: Annotated[float, Field(ge=0, le=8784)] = 24.0


class SendTestIn(In):
    event_type: EventType | None = None


class ReplayIn(In):
    since_seconds: Annotated[float, Field(gt=0, le=90 * 86400)]
    endpoint_id: Annotated[int, Field(ge=1, le=2**63 - 1)] | None = None
    failed_only: bool = False
    # Without a selection: a count (the preview). With the preview's: the replay. (A count
    # of at most MAX_RANGE_ENDPOINTS endpoints fits; the body is at most 16 KiB.)
    selection: Annotated[str, Field(max_length=12288)] | None = None


# --- out ----------------------------------------------------------------------------------


class Counts(Out):
    pending: int
    running: int
    delivered: int
    failed: int
    cancelled: int


class Endpoint(Out):
    id: int
    destination: str
    url: str
    event_types: list[str]
    description: str
    rate_limit: int | None
    enabled: bool
    disabled_reason: str | None
    disabled_at: datetime | None
    failing_since: datetime | None
    last_success_at: datetime | None
    circuit_open_until: datetime | None
    created_at: datetime
    updated_at: datetime
    deliveries: Counts | None = None


class EndpointWithSecret(Out):
    id: int
    destination: str
    url: str
    event_types: list[str]
    description: str
    rate_limit: int | None
    enabled: bool
    secret: str  # shown once: on creation and rotation
    previous_secret_until: datetime | None


class EndpointList(Out):
    items: list[Endpoint]
    next_cursor: str | None


class Deleted(Out):
    id: int
    cancelled: int


class Message(Out):
    id: int
    event_id: int
    webhook_id: str
    endpoint_id: int
    event_type: str | None
    status: Status
    attempts: int
    last_status: int | None
    last_error: str | None
    created_at: datetime
    finished_at: datetime | None
    replay: bool


class MessageList(Out):
    items: list[Message]
    next_cursor: str | None


class MessageDetail(Message):
    event_kept: bool
    content_type: str | None
    payload: str | None
    payload_encoding: Literal["utf-8", "base64"] | None
    payload_truncated: bool


class Attempt(Out):
    id: int
    at: datetime
    http_status: int | None
    duration_ms: float | None
    response: str | None
    error: str | None
    replay: bool


class AttemptList(Out):
    items: list[Attempt]
    next_cursor: str | None


class SentTest(Out):
    message_id: int
    event_id: int


class Replayed(Out):
    replayed: int
    running: int
    not_taken: int


class EndpointReplay(Out):
    endpoint_id: int
    replayed: int
    by_status: dict[str, int]
    skipped_event_gone: int
    skipped_not_taken: int


class RangeReplay(Out):
    done: bool  # False: a count; send it back with `selection` to replay exactly that
    total: int
    endpoints: list[EndpointReplay]
    selection: str | None


class EventTypeOut(Out):
    """An event type of the catalog: what its events hold (``schema``, a JSON Schema)."""

    name: str
    version: int
    description: str | None
    deprecated: bool
    # "schema" on the wire: as a field name it would hide pydantic's BaseModel.schema.
    json_schema: dict[str, Any] = Field(alias="schema")
    examples: list[Any]


class EventTypeList(Out):
    items: list[EventTypeOut]


class Problem(Out):
    type: str
    title: str
    status: int
    detail: str
