"""A span per delivery of a traced event, linked to the span that enqueued it.

Only rows that carry a ``traceparent`` header get a span, so untraced traffic costs one dict
lookup per row; without OpenTelemetry installed, nothing at all. The row's own
``traceparent``/``tracestate`` headers travel with the message unchanged (the creation
context, as OpenTelemetry's messaging conventions have it), so consumers continue the trace
of the code that enqueued the event.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from outbox import tracing
from relay.model import Envelope, Outcome, Result

TRACEPARENT = tracing.TRACEPARENT


def start_delivery_spans(envs: Sequence[Envelope], system: str) -> list[tuple[int, Any]]:
    """Start one span per traced envelope; returns (row id, span) pairs (often empty)."""
    if not tracing.AVAILABLE:
        return []
    traced = [e for e in envs if TRACEPARENT in e.headers]
    if not traced:
        return []
    from opentelemetry import trace
    from opentelemetry.trace import Link, SpanKind

    tracer = trace.get_tracer("outbox-relay")
    spans = []
    for env in traced:
        ctx = tracing.extract_context(env.headers)
        spans.append(
            (
                env.id,
                tracer.start_span(
                    f"{env.destination} publish",
                    kind=SpanKind.PRODUCER,
                    links=[Link(ctx)] if ctx is not None else None,
                    attributes={
                        "messaging.system": system,
                        "messaging.operation.type": "send",
                        "messaging.destination.name": env.destination,
                        "messaging.message.id": str(env.id),
                        "outbox.attempt": env.attempts + 1,
                    },
                ),
            )
        )
    return spans


def end_delivery_spans(spans: list[tuple[int, Any]], outcomes: Mapping[int, Outcome]) -> None:
    if not spans:
        return
    from opentelemetry.trace import Status, StatusCode

    for row_id, span in spans:
        outcome = outcomes.get(row_id)
        result = outcome.result if outcome is not None else Result.RETRY
        span.set_attribute("outbox.outcome", str(result))
        if result is not Result.DELIVERED:
            error = outcome.error if outcome is not None else None
            span.set_status(Status(StatusCode.ERROR, error or str(result)))
        span.end()
