"""Previews confirmed later: the rows a dry run counted, so that acting on them afterwards
(a preview confirmed in the console) takes exactly those rows, or refuses."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import asyncpg

from relay.ops.common import AdminError, sql

T = TypeVar("T")


@dataclass(frozen=True)
class Selection:
    """The rows a dry run counted, so that acting on them later (a preview confirmed in the
    console) takes exactly those rows or refuses: how many, the highest id (rows that match
    only later, with higher ids, are left out), a digest of the ids (any other change shows
    in it), and the database's clock then (a window such as purge's "older than 7d" stays
    where the dry run put it). Thousands of rows cost the same few numbers."""

    rows: int
    max_id: int
    digest: int
    at: datetime


class SelectionChanged(AdminError):
    """The rows a preview counted changed before it was confirmed; nothing was done."""


async def select(conn: asyncpg.Connection, statement: str, schema: str, *args: Any) -> Selection:
    """The selection ``statement`` (one of queries.*_SELECTION) matches now."""
    r = await conn.fetchrow(sql(statement, schema), *args)
    assert r is not None
    return Selection(r["rows"], r["max_id"], int(r["digest"]), r["at"])


def same(now: Selection, shown: Selection) -> None:
    """Refuse (SelectionChanged) unless the rows matching ``now`` are those ``shown``."""
    if (now.rows, now.digest) == (shown.rows, shown.digest):
        return
    if now.rows == shown.rows:
        how = f"as many rows match ({now.rows}), but not the same ones"
    else:
        how = f"it counted {shown.rows} row(s), {now.rows} of them match now"
    raise SelectionChanged(
        f"the rows changed since the preview ({how}: another session retried, purged, "
        "replayed or changed some meanwhile). Nothing changed."
    )


async def exactly(statement: Awaitable[T]) -> T:
    """A statement of a repeatable-read transaction: a row it would change that another
    session changed since the transaction's snapshot is a changed selection."""
    try:
        return await statement
    except asyncpg.SerializationError:
        raise SelectionChanged(
            "the rows changed since the preview (another session changed some while this "
            "one acted). Nothing changed."
        ) from None
