"""Durations as people write them: ``90``, ``90s``, ``15m``, ``2h``, ``7d``, ``1w``, ``1h30m``."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
FORMS = "seconds (90, 2.5) or a number with a unit ms/s/m/h/d/w, combinable (15m, 7d, 1h30m)"


def parse_duration(value: str | float) -> float:
    """Seconds in ``value``; raises ValueError naming the accepted forms."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}; use {FORMS}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip().lower().replace(" ", "")
        try:
            seconds = float(text)
        except ValueError:
            pos, seconds = 0, 0.0
            for m in _PART.finditer(text):
                if m.start() != pos:
                    break
                seconds += float(m.group(1)) * UNITS[m.group(2)]
                pos = m.end()
            if pos != len(text) or not text:
                raise ValueError(f"not a duration: {value!r}; use {FORMS}") from None
    if seconds < 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"not a duration: {value!r}; it must be zero or more seconds")
    return seconds


def parse_since(value: str, now: datetime | None = None) -> datetime:
    """A point in time: an ISO-8601 timestamp, or a duration meaning "that long ago"."""
    now = now or datetime.now(UTC)
    try:
        return now - timedelta(seconds=parse_duration(value))
    except ValueError:
        pass
    try:
        ts = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(
            f"not a time: {value!r}; use a duration ago (30m, 2h, 7d) or an ISO-8601 "
            "timestamp (2026-11-29T08:00:00+00:00)"
        ) from None
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


def format_duration(seconds: float) -> str:
    """A short human form: 0s, 42s, 3m12s, 5h4m, 2d3h."""
    s = int(seconds)
    if s < 60:
        return f"{seconds:.0f}s" if seconds >= 1 or seconds == 0 else f"{seconds:.1f}s"
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h}h" if h else f"{d}d"
    if h:
        return f"{h}h{m}m" if m else f"{h}h"
    return f"{m}m{s}s" if s else f"{m}m"
