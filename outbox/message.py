"""Turning what an application passes to ``enqueue`` into the row that is stored.

Validation happens here, before any SQL, so a bad event fails in the caller's code path with
an error naming the field, and never as a constraint violation that aborts their transaction.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from outbox.errors import OutboxValidationError

JSON = "application/json"
OCTET_STREAM = "application/octet-stream"
TEXT = "text/plain; charset=utf-8"

# Kafka's default max.message.bytes is about 1 MB; a larger payload would only fail later,
# in the relay, far from the code that produced it.
DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024

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


def _is_json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == JSON or media.endswith("+json")


def encode_payload(payload: Payload, content_type: str | None) -> tuple[bytes, str]:
    """Return the stored bytes and content type for a payload."""
    if isinstance(payload, Mapping | list):
        try:
            body = json.dumps(
                payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False
            ).encode()
        except (TypeError, ValueError) as exc:
            raise OutboxValidationError(
                "payload",
                f"cannot be encoded as JSON ({exc}); pass JSON-compatible values "
                "or encode it yourself and pass bytes",
            ) from exc
        return body, content_type or JSON
    if isinstance(payload, str):
        return payload.encode(), content_type or TEXT
    if isinstance(payload, bytes | bytearray | memoryview):
        body = bytes(payload)
        ctype = content_type or OCTET_STREAM
        if _is_json_type(ctype):
            try:
                json.loads(body.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise OutboxValidationError(
                    "payload", f"is declared {ctype} but is not valid UTF-8 ({exc})"
                ) from exc
            except ValueError as exc:
                raise OutboxValidationError(
                    "payload", f"is declared {ctype} but is not valid JSON ({exc})"
                ) from exc
        return body, ctype
    raise OutboxValidationError(
        "payload",
        f"unsupported type {type(payload).__name__}; use bytes, str, dict or list",
    )


def _validate_headers(headers: Mapping[str, str] | None) -> str:
    if headers is None:
        return "{}"
    if not isinstance(headers, Mapping):
        raise OutboxValidationError("headers", "must be a mapping of str to str")
    for name, value in headers.items():
        if not isinstance(name, str) or not name:
            raise OutboxValidationError("headers", f"header name {name!r} must be a non-empty str")
        if not isinstance(value, str):
            raise OutboxValidationError(
                "headers",
                f"value of header {name!r} must be a str, got {type(value).__name__}",
            )
        if "\x00" in name or "\x00" in value:
            raise OutboxValidationError("headers", f"header {name!r} contains a NUL character")
    return json.dumps(dict(headers), separators=(",", ":"), ensure_ascii=False)


def build_message(
    *,
    destination: str,
    payload: Payload,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    run_after: datetime | None = None,
    content_type: str | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> NewMessage:
    if not isinstance(destination, str) or not destination.strip():
        raise OutboxValidationError("destination", "must be a non-empty str")
    if key is not None and not isinstance(key, str):
        raise OutboxValidationError("key", f"must be a str or None, got {type(key).__name__}")
    if content_type is not None and (not isinstance(content_type, str) or not content_type):
        raise OutboxValidationError("content_type", "must be a non-empty str or None")
    if run_after is not None:
        if not isinstance(run_after, datetime):
            raise OutboxValidationError("run_after", "must be a datetime or None")
        if run_after.tzinfo is None:
            raise OutboxValidationError(
                "run_after", "must be timezone-aware (a naive datetime is ambiguous)"
            )
    body, ctype = encode_payload(payload, content_type)
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
        headers_json=_validate_headers(headers),
        run_after=run_after,
    )
