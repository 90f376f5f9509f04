"""Turning what an application passes to ``enqueue`` into the row that is stored.

Validation happens here, before any SQL, so a bad event fails in the caller's code path with
an error naming the field, and never as a driver or constraint error that aborts their
transaction: every value is checked to be storable (no NUL, valid Unicode, within the sizes
the indexes and the brokers take) and encodable (JSON that serialises).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from outbox.errors import OutboxValidationError

JSON = "application/json"
OCTET_STREAM = "application/octet-stream"
TEXT = "text/plain; charset=utf-8"

# The sizes an event may have. Together they keep the largest event inside what Kafka takes
# by default (a producer's max_request_size and a broker's message.max.bytes are 1 MiB): a
# payload of 1,000,000 bytes, a key of 1,024, 100 headers of 16,384 bytes in all, the relay's
# own `outbox-id` and `content-type`, and the record's framing come to about 1,018,100 bytes
# by the producer's own measure, 30,000 bytes under 1,048,576 (tests/test_message_sizes.py builds
# that event and sends it). A larger event would only fail later, in the relay, far from the
# code that produced it. The key and destination limits also keep them inside what a btree
# index entry holds (about 2,700 bytes for the two together).
DEFAULT_MAX_PAYLOAD_BYTES = 1_000_000
MAX_DESTINATION_BYTES = 255
MAX_KEY_BYTES = 1024
MAX_CONTENT_TYPE_BYTES = 255
MAX_HEADERS_BYTES = 16 * 1024
MAX_HEADERS = 100  # also what HTTP servers commonly take
# An event type ("invoice.paid") and a tenant ("acme") select the endpoints of an `endpoints`
# destination; the type is sent as a header (and as CloudEvents' type), so no control characters.
MAX_EVENT_TYPE_BYTES = 255
MAX_TENANT_BYTES = 255

Payload = bytes | bytearray | memoryview | str | Mapping[str, Any] | list[Any]


@dataclass(frozen=True, slots=True)
class NewMessage:
    """One validated row, ready to insert."""

    destination: str
    key: str | None
    payload: bytes
    content_type: str
    headers_json: str
    run_after: datetime | None
    event_type: str | None = None
    tenant: str | None = None


def _is_json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == JSON or media.endswith("+json")


def _utf8(field: str, value: str, what: str = "") -> bytes:
    """``value`` as UTF-8; refused if PostgreSQL text cannot hold it (NUL, lone surrogate)."""
    subject = f"{what} " if what else ""
    if "\x00" in value:
        raise OutboxValidationError(
            field, f"{subject}contains a NUL character, which PostgreSQL text cannot hold"
        )
    try:
        return value.encode()
    except UnicodeEncodeError as exc:
        raise OutboxValidationError(
            field,
            f"{subject}is not valid Unicode: a lone surrogate at position {exc.start} "
            "(text decoded with errors='surrogateescape'?)",
        ) from None


def _text(field: str, value: object, limit: int, *, kind: str = "a non-empty str") -> str:
    """A str (non-empty unless ``kind`` says otherwise) of at most ``limit`` UTF-8 bytes."""
    if not isinstance(value, str):
        raise OutboxValidationError(field, f"must be {kind}, got {type(value).__name__}")
    if "non-empty" in kind and not value.strip():
        raise OutboxValidationError(field, f"must be {kind}")
    size = len(_utf8(field, value))
    if size > limit:
        raise OutboxValidationError(
            field, f"is {size} bytes (UTF-8), above the limit of {limit} bytes"
        )
    return value


def encode_payload(payload: Payload, content_type: str | None) -> tuple[bytes, str]:
    """Return the stored bytes and content type for a payload."""
    if isinstance(payload, Mapping | list):
        try:
            text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except RecursionError:
            raise OutboxValidationError(
                "payload", "is nested too deeply to encode as JSON; flatten it"
            ) from None
        except (TypeError, ValueError) as exc:
            raise OutboxValidationError(
                "payload",
                f"cannot be encoded as JSON ({exc}); pass JSON-compatible values "
                "or encode it yourself and pass bytes",
            ) from exc
        return _utf8("payload", text, "its JSON"), content_type or JSON
    if isinstance(payload, str):
        try:
            body = payload.encode()
        except UnicodeEncodeError as exc:
            raise OutboxValidationError(
                "payload",
                f"is not valid Unicode: a lone surrogate at position {exc.start}; pass bytes "
                "if the data is binary",
            ) from None
        ctype = content_type or TEXT
        if _is_json_type(ctype):
            _check_json_bytes(body, ctype)
        return body, ctype
    if isinstance(payload, bytes | bytearray | memoryview):
        body = bytes(payload)
        ctype = content_type or OCTET_STREAM
        if _is_json_type(ctype):
            _check_json_bytes(body, ctype)
        return body, ctype
    raise OutboxValidationError(
        "payload",
        f"unsupported type {type(payload).__name__}; use bytes, str, dict or list",
    )


def _check_json_bytes(body: bytes, ctype: str) -> None:
    try:
        json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise OutboxValidationError(
            "payload", f"is declared {ctype} but is not valid UTF-8 ({exc})"
        ) from exc
    except RecursionError:
        raise OutboxValidationError(
            "payload", f"is declared {ctype} but is nested too deeply to parse"
        ) from None
    except ValueError as exc:
        raise OutboxValidationError(
            "payload", f"is declared {ctype} but is not valid JSON ({exc})"
        ) from exc


def _validate_headers(headers: Mapping[str, str] | None) -> str:
    if headers is None:
        return "{}"
    if not isinstance(headers, Mapping):
        raise OutboxValidationError("headers", "must be a mapping of str to str")
    if len(headers) > MAX_HEADERS:
        raise OutboxValidationError(
            "headers", f"{len(headers)} headers, above the limit of {MAX_HEADERS}"
        )
    size = 0
    for name, value in headers.items():
        if not isinstance(name, str) or not name:
            raise OutboxValidationError("headers", f"header name {name!r} must be a non-empty str")
        if not isinstance(value, str):
            raise OutboxValidationError(
                "headers",
                f"value of header {name!r} must be a str, got {type(value).__name__}",
            )
        size += len(_utf8("headers", name, f"header name {name!r}"))
        size += len(_utf8("headers", value, f"the value of header {name!r}"))
    if size > MAX_HEADERS_BYTES:
        raise OutboxValidationError(
            "headers",
            f"names and values come to {size} bytes, above the limit of {MAX_HEADERS_BYTES}; "
            "headers are for routing and tracing, put data in the payload",
        )
    return json.dumps(dict(headers), separators=(",", ":"), ensure_ascii=False)


def _validate_content_type(content_type: object) -> str | None:
    if content_type is None:
        return None
    ctype = _text(
        "content_type", content_type, MAX_CONTENT_TYPE_BYTES, kind="a non-empty str or None"
    )
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in ctype):
        raise OutboxValidationError(
            "content_type", "contains a control character; it is sent as a header"
        )
    return ctype


def _label(field: str, value: object, limit: int) -> str | None:
    """An optional event type or tenant: a non-empty str without control characters."""
    if value is None:
        return None
    label = _text(field, value, limit, kind="a non-empty str or None")
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in label):
        raise OutboxValidationError(field, "contains a control character")
    return label


def build_message(
    *,
    destination: str,
    payload: Payload,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    run_after: datetime | None = None,
    content_type: str | None = None,
    event_type: str | None = None,
    tenant: str | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> NewMessage:
    _text("destination", destination, MAX_DESTINATION_BYTES)
    if key is not None:
        _text("key", key, MAX_KEY_BYTES, kind="a str or None")
    _label("event_type", event_type, MAX_EVENT_TYPE_BYTES)
    _label("tenant", tenant, MAX_TENANT_BYTES)
    ctype_given = _validate_content_type(content_type)
    if run_after is not None:
        if not isinstance(run_after, datetime):
            raise OutboxValidationError("run_after", "must be a datetime or None")
        if run_after.tzinfo is None:
            raise OutboxValidationError(
                "run_after", "must be timezone-aware (a naive datetime is ambiguous)"
            )
        try:
            run_after.astimezone(UTC)
        except (OverflowError, ValueError):
            raise OutboxValidationError(
                "run_after", "is outside the years 1 to 9999 once in UTC"
            ) from None
    headers_json = _validate_headers(headers)
    body, ctype = encode_payload(payload, ctype_given)
    if len(body) > max_payload_bytes:
        raise OutboxValidationError(
            "payload",
            f"is {len(body)} bytes, above the limit of {max_payload_bytes} bytes; store large "
            "data elsewhere and enqueue a reference, or raise max_payload_bytes (and the "
            "broker's message size limit) together",
        )
    return NewMessage(
        destination=destination,
        key=key,
        payload=body,
        content_type=ctype,
        headers_json=headers_json,
        run_after=run_after,
        event_type=event_type,
        tenant=tenant,
    )
