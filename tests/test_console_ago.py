"""Times as the console shows them (relay/ui/ago.py): relative text, the exact time beside it."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta, timezone

import pytest
from jinja2 import Environment

from relay.ui import ago

NOW = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)


def before(**delta: float) -> datetime:
    return NOW - timedelta(**delta)


def after(**delta: float) -> datetime:
    return NOW + timedelta(**delta)


@pytest.mark.parametrize(
    ("when", "text"),
    [
        (NOW, "just now"),
        (before(seconds=4.999), "just now"),
        (before(seconds=5), "5 s ago"),
        (before(seconds=42), "42 s ago"),
        (before(seconds=59.999), "59 s ago"),
        (before(seconds=60), "1 min ago"),
        (before(seconds=119), "1 min ago"),
        (before(minutes=3), "3 min ago"),
        (before(minutes=59, seconds=59), "59 min ago"),
        (before(minutes=60), "1 h ago"),
        (before(hours=23, minutes=59, seconds=59), "23 h ago"),
        (before(hours=24), "yesterday"),
        (before(hours=47, minutes=59), "yesterday"),
        (before(hours=48), "2 days ago"),
        (before(days=3, hours=5), "3 days ago"),
        (before(days=364), "364 days ago"),
        (before(days=365), "1 year ago"),
        (before(days=800), "2 years ago"),
    ],
)
def test_past_times_read_in_their_largest_whole_unit(when: datetime, text: str) -> None:
    assert ago.relative(when, NOW) == text


@pytest.mark.parametrize(
    ("when", "text"),
    [
        (after(seconds=0.5), "just now"),
        (after(seconds=1), "in 1 s"),
        (after(seconds=12.7), "in 12 s"),
        (after(seconds=59.999), "in 59 s"),
        (after(seconds=60), "in 1 min"),
        (after(minutes=59, seconds=59), "in 59 min"),
        (after(minutes=60), "in 1 h"),
        (after(hours=24), "tomorrow"),
        (after(hours=48), "in 2 days"),
        (after(days=366), "in 1 year"),
    ],
)
def test_future_times_read_as_in(when: datetime, text: str) -> None:
    assert ago.relative(when, NOW) == text


def test_a_naive_datetime_is_taken_as_utc() -> None:
    naive = datetime(2025, 3, 1, 11, 57, 0)
    assert ago.relative(naive, NOW) == "3 min ago"
    assert ago.exact(ago.parse(naive) or NOW) == "2025-03-01T11:57:00Z"
    # And the clock too: a naive "now" is UTC, not the machine's zone.
    assert ago.relative(before(minutes=3), NOW.replace(tzinfo=None)) == "3 min ago"


def test_another_zone_is_the_same_moment() -> None:
    berlin = timezone(timedelta(hours=1))
    same = datetime(2025, 3, 1, 12, 57, 0, tzinfo=berlin)  # 11:57 UTC
    assert ago.relative(same, NOW) == "3 min ago"
    assert ago.exact(same) == "2025-03-01T11:57:00Z"


def test_iso_text_as_the_operations_return_it_is_read() -> None:
    text = before(minutes=3, microseconds=250).isoformat()  # ...T11:56:59.999750+00:00
    assert ago.relative(text, NOW) == "3 min ago"
    assert ago.exact(ago.parse(text) or NOW) == "2025-03-01T11:56:59.999750Z"


def test_none_and_what_is_no_time() -> None:
    assert ago.relative(None, NOW) == "-"
    assert ago.relative("not a time", NOW) == "-"
    assert ago.parse(None) is None and ago.parse("2025-13-01") is None
    assert ago.time_tag(None) == "-"
    assert ago.time_tag(None, "never") == "never"
    assert ago.time_tag("") == "-"
    # What is no time is shown as it is, escaped, never dropped.
    assert ago.time_tag("<b>soon</b>") == "&lt;b&gt;soon&lt;/b&gt;"


def test_without_a_clock_it_counts_from_the_current_time() -> None:
    assert ago.relative(datetime.now(UTC) - timedelta(minutes=3)) == "3 min ago"
    assert ago.parse(ago.now_exact()) is not None and ago.now_exact().endswith("Z")


def test_the_tag_holds_the_exact_time_for_hover_and_the_script() -> None:
    tag = ago.time_tag(before(seconds=42, microseconds=123456), now=NOW)
    stamp = "2025-03-01T11:59:17.876544Z"
    assert tag == f'<time class="ago" datetime="{stamp}" title="{stamp}">42 s ago</time>'


def test_the_filter_is_not_escaped_again_in_an_autoescaping_template() -> None:
    env = Environment(autoescape=True)
    env.filters["when"] = ago.time_tag
    html = env.from_string("{{ t | when }} / {{ none | when('never') }}").render(
        t=datetime.now(UTC) - timedelta(hours=2), none=None
    )
    assert html.startswith('<time class="ago" datetime="') and ">2 h ago</time> / never" in html


# --- after a hostile review (#32) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("when", "shown"),
    [
        # Past what a datetime holds once moved to UTC: shown as it is, not a 500.
        ("9999-12-31T23:59:59-01:00", "9999-12-31T23:59:59-01:00"),
        ("0001-01-01T00:30:00+01:00", "0001-01-01T00:30:00+01:00"),
        (
            datetime(9999, 12, 31, 23, 0, tzinfo=timezone(timedelta(hours=-2))),
            "9999-12-31 23:00:00-02:00",
        ),
        # What is no datetime at all (a date, a number) is no time either.
        (date(2025, 3, 1), "2025-03-01"),
        (1740830400, "1740830400"),
    ],
)
def test_what_cannot_be_a_time_in_utc_is_shown_as_it_is(when: object, shown: str) -> None:
    assert ago.time_tag(when, now=NOW) == shown  # type: ignore[arg-type]
    assert ago.relative(when, NOW) == "-"  # type: ignore[arg-type]


def test_the_largest_times_postgresql_sends_are_read() -> None:
    # asyncpg's 'infinity' is datetime.max in UTC: far ahead, not an error.
    assert re.fullmatch(r"in 79\d\d years", ago.relative(datetime.max.replace(tzinfo=UTC), NOW))
    assert ago.exact(datetime.min.replace(tzinfo=UTC)) == "0001-01-01T00:00:00Z"
