"""Durations and points in time as people write them: pure parsing and formatting."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from relay.durations import FORMS, format_duration, parse_duration, parse_since

NOW = datetime(2026, 11, 29, 8, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (90, 90.0),
        (2.5, 2.5),
        (0, 0.0),
        ("90", 90.0),
        ("2.5", 2.5),
        (" 0 ", 0.0),
        ("1e3", 1000.0),
        ("500ms", 0.5),
        ("90s", 90.0),
        ("15m", 900.0),
        ("2h", 7200.0),
        ("7d", 604800.0),
        ("1w", 604800.0),
        ("1.5h", 5400.0),
        ("1h30m", 5400.0),
        ("1w2d3h4m5s6ms", 604800.0 + 2 * 86400 + 3 * 3600 + 4 * 60 + 5 + 0.006),
        ("1H 30M", 5400.0),  # any case, spaces ignored
        ("0s", 0.0),
    ],
)
def test_parse_duration(value: str | float, seconds: float) -> None:
    parsed = parse_duration(value)
    assert parsed == pytest.approx(seconds, abs=1e-9) and type(parsed) is float


@pytest.mark.parametrize(
    "value",
    ["", "   ", "forever", "15 minutes", "15mx", "1hx2m", "x1h", "m", "1h30", "1h-30m", "-1h"],
)
def test_parse_duration_refuses_other_text_naming_the_forms(value: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration(value)
    assert str(info.value) == f"not a duration: {value!r}; use {FORMS}"


def test_a_boolean_is_not_a_duration() -> None:
    with pytest.raises(ValueError) as info:
        parse_duration(True)
    assert str(info.value) == f"not a duration: True; use {FORMS}"


@pytest.mark.parametrize("value", [-1, -0.5, "-1", float("nan"), "nan", float("inf"), "inf"])
def test_parse_duration_refuses_negative_and_unbounded_seconds(value: str | float) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration(value)
    assert str(info.value) == f"not a duration: {value!r}; it must be zero or more seconds"


def test_parse_since_a_duration_is_that_long_ago() -> None:
    assert parse_since("2h", NOW) == datetime(2026, 11, 29, 6, 0, tzinfo=UTC)
    assert parse_since("90", NOW) == NOW - timedelta(seconds=90)
    assert parse_since("0s", NOW) == NOW


def test_parse_since_defaults_to_now_in_utc() -> None:
    before = datetime.now(UTC)
    since = parse_since("1h")
    after = datetime.now(UTC)
    assert since.tzinfo is not None
    assert before - timedelta(hours=1) <= since <= after - timedelta(hours=1)


def test_parse_since_takes_iso_timestamps_naive_ones_in_utc() -> None:
    assert parse_since("2026-11-29T08:00:00+00:00", NOW) == NOW
    cet = parse_since(" 2026-11-29T09:00:00+01:00 ", NOW)
    assert cet == NOW and cet.utcoffset() == timedelta(hours=1)  # its own offset kept
    naive = parse_since("2026-11-29T08:00:00", NOW)
    assert naive == NOW and naive.tzinfo is UTC
    assert parse_since("2026-11-29", NOW) == datetime(2026, 11, 29, tzinfo=UTC)
    tz = timezone(timedelta(hours=-5))
    assert parse_since("2026-11-29T03:00:00-05:00") == datetime(2026, 11, 29, 3, tzinfo=tz)


@pytest.mark.parametrize("value", ["yesterday", "", "-1h", "2026-13-01"])
def test_parse_since_names_both_forms(value: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_since(value, NOW)
    assert str(info.value) == (
        f"not a time: {value!r}; use a duration ago (30m, 2h, 7d) or an ISO-8601 "
        "timestamp (2026-11-29T08:00:00+00:00)"
    )


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0, "0s"),
        (0.25, "0.2s"),
        (0.5, "0.5s"),
        (1, "1s"),
        (1.5, "2s"),
        (42, "42s"),
        (59, "59s"),
        (60, "1m"),
        (61, "1m1s"),
        (120, "2m"),
        (192, "3m12s"),
        (3599, "59m59s"),
        (3600, "1h"),
        (3660, "1h1m"),
        (5 * 3600 + 4 * 60 + 59, "5h4m"),  # seconds dropped past an hour
        (86399, "23h59m"),
        (86400, "1d"),
        (86400 + 59 * 60, "1d"),  # minutes dropped past a day
        (2 * 86400 + 3 * 3600, "2d3h"),
        (400 * 86400, "400d"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
