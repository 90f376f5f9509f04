"""The portal's page cursors: where the next page of a list starts, bound to the filters of the
list it came from. ``v1:<last id>:<8 hex of a hash of the filters>`` in base64url. A cursor
carries no scope (the tenant is in every statement), so a forged one can only move the page's
start; one taken to a list with other filters is refused rather than silently wrong."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping

FIRST = 2**63 - 1  # "below" this: from the newest
_FORM = re.compile(r"v1:([1-9][0-9]{0,18}):([0-9a-f]{8})")
MAX_CURSOR = 64


class CursorRefused(ValueError):
    """Not a cursor of this list: say which."""


def _digest(filters: Mapping[str, object]) -> str:
    text = json.dumps(
        {k: str(v) for k, v in filters.items() if v is not None}, sort_keys=True, default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def encode(last_id: int, filters: Mapping[str, object]) -> str:
    """The cursor of the page after the one that ended at ``last_id``."""
    raw = f"v1:{last_id}:{_digest(filters)}".encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode(cursor: str | None, filters: Mapping[str, object]) -> int:
    """The id a page starts below: FIRST without a cursor."""
    if cursor is None:
        return FIRST
    if len(cursor) > MAX_CURSOR or not re.fullmatch(r"[A-Za-z0-9_-]+", cursor):
        raise CursorRefused("not a cursor of this list")
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("ascii")
    except (ValueError, UnicodeDecodeError):
        raise CursorRefused("not a cursor of this list") from None
    match = _FORM.fullmatch(text)
    if match is None or int(match.group(1)) >= FIRST:
        raise CursorRefused("not a cursor of this list")
    if match.group(2) != _digest(filters):
        raise CursorRefused("the cursor is of a list with other filters: start from the first page")
    return int(match.group(1))
