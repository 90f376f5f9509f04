"""The headers of a message as the sinks send them, as a JSON Schema per destination kind and
envelope: Kafka (relay/sinks/kafka/sink.py), webhook and endpoints requests
(relay/sinks/webhook/requests.py, docs/webhooks.md), the CloudEvents attributes of binary mode
(relay/cloudevents.py) and the trace context (outbox/tracing.py).

Names only, and constants the relay itself sets (the CloudEvents source and type, the spec
version): never the value of a header the operator configured, which may be a credential.
"""

from __future__ import annotations

from typing import Any

from outbox.tracing import TRACEPARENT, TRACESTATE
from relay.cloudevents import (
    SPECVERSION,
    STRUCTURED_CONTENT_TYPE,
    CloudEvents,
    http_header_value,
)

Schema = dict[str, Any]

# relay.sinks.kafka.sink's names (a test holds them equal): that module loads the Kafka
# client, which documenting a configuration must not need.
OUTBOX_ID = "outbox-id"
CONTENT_TYPE = "content-type"

DECIMAL = "^[0-9]+$"
# Standard Webhooks: one "v1,<base64>" per signing secret, space-separated while rotating.
SIGNATURE = "^v1,[A-Za-z0-9+/=]+( v1,[A-Za-z0-9+/=]+)*$"
# W3C trace context, version 00 (version-traceid-parentid-flags).
TRACEPARENT_PATTERN = "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
# The characters an ECMA-262 pattern (what AsyncAPI tools compile, with the u flag) takes only
# escaped; escaping any other is an error under that flag, so re.escape will not do.
_REGEX_SYNTAX = frozenset("^$\\.*+?()[]{}|/")


def _string(description: str, **keywords: Any) -> Schema:
    return {"type": "string", "description": description, **keywords}


def _object(required: dict[str, Schema], optional: dict[str, Schema]) -> Schema:
    # Rows carry headers of their own (enqueue's headers=), sent beside the relay's: any other
    # header name may appear, with a string value.
    return {
        "type": "object",
        "properties": {**optional, **required},
        "required": sorted(required),
        "additionalProperties": {"type": "string"},
    }


def _trace() -> dict[str, Schema]:
    return {
        TRACEPARENT: _string(
            "W3C trace context of the span that enqueued the event (with outbox-relay[otel])",
            pattern=TRACEPARENT_PATTERN,
        ),
        TRACESTATE: _string("W3C trace state that goes with traceparent"),
    }


def _content_type(content_type: str, ce: CloudEvents | None) -> Schema:
    if ce is not None and ce.structured:
        return _string("the structured CloudEvents format", const=STRUCTURED_CONTENT_TYPE)
    return _string(
        f"the event's content type ({content_type} for this type)", examples=[content_type]
    )


def _attributes(prefix: str, ce: CloudEvents, event_type: str, http: bool) -> dict[str, Schema]:
    """The CloudEvents attributes of binary mode, as headers named ``prefix`` + attribute.
    Over HTTP their values are percent-encoded (the binding's rule); on Kafka they are not."""

    def text(value: str) -> str:
        return http_header_value(value) if http else value

    return {
        f"{prefix}id": _string("the CloudEvent's id: the outbox row id", pattern=DECIMAL),
        f"{prefix}source": _string("the destination's source", const=text(ce.source)),
        f"{prefix}type": _string("the event type", const=text(event_type)),
        f"{prefix}specversion": _string("CloudEvents version", const=SPECVERSION),
        f"{prefix}time": _string("when the event was enqueued (RFC 3339, UTC)", format="date-time"),
    }


def kafka_headers(event_type: str, content_type: str, ce: CloudEvents | None) -> Schema:
    """The headers of a Kafka message of ``event_type`` on a destination whose envelope is
    ``ce`` (None: the payload as it is)."""
    required = {
        OUTBOX_ID: _string(
            "the outbox row id, the same on every redelivery: deduplicate on it (with the "
            "topic, since every outbox counts from 1)",
            pattern=DECIMAL,
        ),
        CONTENT_TYPE: _content_type(content_type, ce),
    }
    if ce is not None and not ce.structured:
        required |= _attributes("ce_", ce, event_type, http=False)
    return _object(required, _trace())


def webhook_id(id_prefix: str | None) -> Schema:
    """``webhook-id``: the row id, after ``[webhooks] id_prefix`` when one is set."""
    if not id_prefix:
        return _string(
            "the outbox row id, the same on every retry: deduplicate on it", pattern=DECIMAL
        )
    escaped = "".join("\\" + c if c in _REGEX_SYNTAX else c for c in id_prefix)
    return _string(
        f"{id_prefix!r} and the outbox row id, the same on every retry: deduplicate on the "
        "whole value, as text",
        pattern=f"^{escaped}[0-9]+$",
    )


def http_headers(
    event_type: str,
    content_type: str,
    ce: CloudEvents | None,
    *,
    id_prefix: str | None,
    configured: list[str],
) -> Schema:
    """The headers of a webhook or endpoints request of ``event_type``; ``configured``: the
    names of the destination's ``headers`` (their values are the operator's, never shown)."""
    required = {
        "webhook-id": webhook_id(id_prefix),
        "webhook-timestamp": _string("unix seconds of this attempt", pattern=DECIMAL),
        "webhook-signature": _string(
            "Standard Webhooks signature of id.timestamp.body (see the security scheme)",
            pattern=SIGNATURE,
        ),
        "content-type": _content_type(content_type, ce),
        "user-agent": _string("the relay's ([webhooks] user_agent, outbox-relay/<version>)"),
        "accept-encoding": _string("identity: the relay reads answers uncompressed"),
    }
    for name in configured:
        required[name.lower()] = _string("set by the operator")
    if ce is not None and not ce.structured:
        required |= _attributes("ce-", ce, event_type, http=True)
    return _object(required, _trace())
