"""What an endpoint's answer means: the row's outcome and the endpoint's health.

Pure functions of the answer (status, headers, the first bytes of the body) and the
destination's settings, apart from the sending itself (sink.py).
"""

from __future__ import annotations

import enum
import re
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

from relay.model import Envelope, Outcome, truncate_error
from relay.sinks.webhook.config import WebhookRequestSettings
from relay.sinks.webhook.http1 import Response

BODY_IN_ERROR = 512  # response bytes kept in last_error
RETRY_AFTER_STATUSES = frozenset({429, 503})
TRANSIENT_STATUSES = frozenset({408, 425, 429})
MIN_RETRY_AFTER = 1.0  # "Retry-After: 0" must not become a hot loop


class Health(enum.Enum):
    """What an attempt says about the endpoint, for its circuit breaker."""

    UP = "up"
    DOWN = "down"
    UNKNOWN = "unknown"  # e.g. a 400 about one message: the endpoint answers, but not well


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds from ``now`` that a ``Retry-After`` value asks for (delta-seconds or HTTP date)."""
    if value is None:
        return None
    value = value.strip()
    if re.fullmatch(r"\d+(\.\d+)?", value):
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT by definition
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def snippet(body: bytes) -> str:
    text = body[:BODY_IN_ERROR].decode("utf-8", "replace")
    return " ".join(text.split())


def classify(
    env: Envelope,
    response: Response,
    body: bytes,
    latency_ms: float,
    origin: str,
    config: WebhookRequestSettings,
) -> tuple[Outcome, Health]:
    """What an endpoint's answer means for the row, and for the endpoint's circuit."""
    status = response.status
    if 200 <= status < 300:
        return Outcome.delivered(env.id, status_class=class_of(status)), Health.UP
    error = f"HTTP {status} in {latency_ms:.0f} ms from {origin}"
    if status in (301, 302, 303, 307, 308) and "location" in response.headers:
        error += " (redirects are not followed; point the destination at the final URL)"
    text = snippet(body)
    if text:
        error += f": {text}"
    error = truncate_error(error)

    if status == 410:
        return Outcome.failed(env.id, error, status_class=class_of(status)), Health.UNKNOWN
    if status in TRANSIENT_STATUSES or status >= 500:
        retry_in = None
        if status in RETRY_AFTER_STATUSES:
            asked = parse_retry_after(response.headers.get("retry-after"))
            if asked is not None:
                retry_in = min(max(asked, MIN_RETRY_AFTER), config.retry_after_max)
        health = Health.UNKNOWN if status == 425 else Health.DOWN
        return Outcome.retry(env.id, error, retry_in, status_class=class_of(status)), health
    # Other 4xx, 3xx, and odd codes: retried by default, as Svix and Hook0 do, since
    # such answers are often a deployment mistake that gets fixed.
    if config.retry_client_errors:
        return Outcome.retry(env.id, error, status_class=class_of(status)), Health.UNKNOWN
    return Outcome.failed(env.id, error, status_class=class_of(status)), Health.UNKNOWN


def class_of(status: int) -> str:
    """An HTTP status as its class, the label of the attempts metric: 503 -> "5xx"."""
    return f"{status // 100}xx"
