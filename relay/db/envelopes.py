"""The rows a claim took, as the envelopes the sinks are given (every claim reads its rows in
the same columns: see queries.CLAIM)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import asyncpg

from outbox.errors import describe
from relay.model import Envelope, Lease, UnreadableHeaders, epoch


def envelopes(rows: Sequence[asyncpg.Record], until: float) -> list[Envelope]:
    """The claimed rows as envelopes. Nothing here may raise for a row's content: the
    rows are committed as running, and a row Python cannot read must fail alone (its
    headers and times come as text and a number, read defensively)."""
    lease = Lease(until)
    # Positional: the same fields as Envelope's, in its order (a third cheaper than by
    # keyword, for every claimed row).
    return [
        Envelope(
            r[0],  # id
            r[1],  # destination
            r[2],  # key
            r[3],  # payload
            r[4],  # content_type
            {} if r[5] == "{}" else read_headers(r[5]),
            r[6],  # attempts
            epoch(r[7]),  # created
            r[8],  # token
            lease,
            r[9],  # event_type
        )
        for r in rows
    ]


def read_headers(text: str) -> Any:
    """A row's headers (as text): the object, or UnreadableHeaders saying why it is not one."""
    try:
        return json.loads(text)
    except (RecursionError, ValueError) as exc:
        return UnreadableHeaders(describe(exc))
