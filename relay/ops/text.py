"""How the operations' results read to people, wherever they are shown: ages, and the start
of a payload. The commands' text (relay/cli/render.py) and the console's pages both use these;
they live below both, as the console may not import the commands."""

from __future__ import annotations

from relay.durations import format_duration


def age(seconds: float | None, *, coarse: bool = False) -> str:
    """How old something is, "-" if not known: 3m12s, 5h4m, 2d3h (format_duration); or
    ``coarse``, one unit rounded to the nearest (12s, 8m, 3h, 2d), for a column read at a
    glance (the console's)."""
    if seconds is None:
        return "-"
    if not coarse:
        return format_duration(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def preview(payload: bytes, content_type: str, total: int) -> str:
    """Readable start of a payload: text as text, anything else as hex."""
    media = content_type.split(";", 1)[0].strip().lower()
    texty = media.startswith("text/") or media.endswith(("json", "xml")) or "+json" in media
    if texty:
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            text = payload.decode("utf-8", errors="replace")
    else:
        text = payload.hex(" ")
    return text + (f"… ({total} bytes)" if total > len(payload) else "")
