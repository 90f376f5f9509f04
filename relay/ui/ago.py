"""Times as people read them: "3 min ago", "in 12 s", "yesterday", with the exact time kept
in a ``<time>`` element's ``datetime`` and ``title`` (shown on hover). Rendered on the server,
so the pages read the same without JavaScript; relay/ui/static/console.js rewrites the text
from ``datetime`` on a page left open, by the same rules (keep the two in step).

Pure: the clock is a parameter, and a time without a zone is taken as UTC (the database's
``timestamptz`` values always carry one; a naive one came from code that meant UTC)."""

from __future__ import annotations

from datetime import UTC, datetime

from markupsafe import Markup, escape

MINUTE = 60
HOUR = 60 * MINUTE
DAY = 24 * HOUR
YEAR = 365 * DAY
# A moment ago reads as one: "just now" rather than "3 s ago".
JUST_NOW_S = 5


def parse(when: datetime | str | None) -> datetime | None:
    """``when`` as an aware datetime in UTC (naive ones taken as UTC); None for None, a text
    that is no ISO 8601 time, anything else that is no datetime, and a time that UTC cannot
    hold (year 9999 behind it, year 1 ahead of it)."""
    if isinstance(when, str):
        try:
            when = datetime.fromisoformat(when)
        except ValueError:
            return None
    if not isinstance(when, datetime):  # None, or a date or a number a template was given
        return None
    try:
        # In UTC now, as exact() writes it: a time near year 1 or 9999 in another zone may not be.
        return (when if when.tzinfo is not None else when.replace(tzinfo=UTC)).astimezone(UTC)
    except OverflowError:
        return None


def exact(when: datetime) -> str:
    """The exact time in UTC, ISO 8601 with its zone: 2025-03-01T12:34:56.789012Z."""
    text = when.astimezone(UTC).isoformat()
    return text.removesuffix("+00:00") + "Z"


def relative(when: datetime | str | None, now: datetime | None = None) -> str:
    """How long before or after ``now`` (the current time if None) ``when`` is, in its largest
    whole unit: "just now", "42 s ago", "3 min ago", "2 h ago", "yesterday", "3 days ago",
    "2 years ago"; ahead of ``now``: "in 12 s", "in 5 min", "tomorrow", "in 3 days". Units are
    counted down (59.9 s ago is "59 s ago"). "-" when ``when`` is None or no time."""
    moment = parse(when)
    if moment is None:
        return "-"
    now = parse(now) or datetime.now(UTC)
    seconds = (now - moment).total_seconds()
    future = seconds < 0
    span = int(abs(seconds))
    if span < (1 if future else JUST_NOW_S):
        return "just now"
    if span < DAY or span >= 2 * DAY:
        words = _span(span)
        return f"in {words}" if future else f"{words} ago"
    return "tomorrow" if future else "yesterday"


def _span(seconds: int) -> str:
    if seconds < MINUTE:
        return f"{seconds} s"
    if seconds < HOUR:
        return f"{seconds // MINUTE} min"
    if seconds < DAY:
        return f"{seconds // HOUR} h"
    if seconds < YEAR:
        return f"{seconds // DAY} days"
    years = seconds // YEAR
    return f"{years} year" if years == 1 else f"{years} years"


def now_exact() -> str:
    """The current time as :func:`exact` writes it: the pages carry the server's clock, so
    console.js counts from it rather than from a browser's clock that may be off."""
    return exact(datetime.now(UTC))


def time_tag(
    when: datetime | str | None, missing: str = "-", now: datetime | None = None
) -> Markup:
    """``when`` as ``<time datetime=… title=…>3 min ago</time>`` (the Jinja filter ``when``);
    ``missing`` when it is None; a text that is no time, as it is (escaped)."""
    if when is None or when == "":
        return escape(missing)
    moment = parse(when)
    if moment is None:
        return escape(str(when))
    # Markup.format escapes what it fills in.
    tag = Markup('<time class="ago" datetime="{0}" title="{0}">{1}</time>')
    return tag.format(exact(moment), relative(moment, now))
