"""W3C trace context for events, when OpenTelemetry is installed (``outbox-relay[otel]``).

At enqueue time the current span's context is stored in the row's headers (``traceparent``,
``tracestate``); the relay forwards those headers with the message and links its delivery
span to them. Without OpenTelemetry, or without a current span, nothing is added.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

try:
    from opentelemetry import trace as _trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _propagator: Any = TraceContextTextMapPropagator()
    AVAILABLE = True
except ImportError:  # the base install: tracing is off
    _trace = None  # type: ignore[assignment]
    _propagator = None
    AVAILABLE = False


def current_trace_headers() -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) of the current span; empty when there is none."""
    if not AVAILABLE:
        return {}
    if not _trace.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier


def with_trace_headers(
    headers: Mapping[str, str] | None, trace: Mapping[str, str]
) -> Mapping[str, str] | None:
    """``headers`` plus ``trace``; a trace header the caller set explicitly wins."""
    if not trace:
        return headers
    if not headers:
        return dict(trace)
    return {**trace, **headers}


def extract_context(headers: Mapping[str, str]) -> Any:
    """The span context stored in ``headers``, or None (also when OpenTelemetry is absent)."""
    if not AVAILABLE or TRACEPARENT not in headers:
        return None
    ctx = _propagator.extract(headers)
    span_context = _trace.get_current_span(ctx).get_span_context()
    return span_context if span_context.is_valid else None
