"""`retry`: failed rows back to pending, attempts reset and due now; by id or by filter, and
then only once a dry run's count is confirmed (relay/ops/selection.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import asyncpg

from relay.ops import queries
from relay.ops.common import Result, check_tables, failed_rows, sql
from relay.ops.rows import like_pattern
from relay.ops.selection import Selection, exactly, same, select


@dataclass(frozen=True)
class RetryFilter:
    destinations: list[str] | None = None
    ids: list[int] | None = None
    since: datetime | None = None
    error_like: str | None = None
    # Only rows up to this id (a confirmed preview's selection).
    max_id: int | None = None

    def args(self) -> tuple[Any, ...]:
        return (
            self.destinations,
            self.ids,
            self.since,
            like_pattern(self.error_like),
            self.max_id,
        )


@dataclass(frozen=True)
class IdRange(Result):
    """A destination's rows a command touched (or would): how many, their lowest and highest
    ids."""

    rows: int
    first_id: int
    last_id: int


@dataclass(frozen=True)
class Retried(Result):
    dry_run: bool
    rows: int
    destinations: dict[str, IdRange]


async def retry_preview(
    conn: asyncpg.Connection, schema: str, flt: RetryFilter
) -> tuple[Retried, Selection]:
    """retry's dry run, and the selection that confirms it (``retry(within=…)``), read in
    one snapshot so that they agree."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        counted = await retry(conn, schema, flt, dry_run=True)
        selection = await select(conn, queries.RETRY_SELECTION, schema, *flt.args())
    return counted, selection


async def retry(
    conn: asyncpg.Connection,
    schema: str,
    flt: RetryFilter,
    *,
    dry_run: bool,
    within: Selection | None = None,
) -> Retried:
    """Move matching failed rows back to pending (attempts 0, due now). ``within``: only the
    rows of that selection (from retry_preview), or SelectionChanged if they are no longer
    the rows that match."""
    await check_tables(conn, schema)
    exact = within is not None and not dry_run
    if within is not None:
        flt = replace(flt, max_id=within.max_id)
    # Exact: one snapshot for the check and the change, so what was checked is what changes.
    async with conn.transaction(isolation="repeatable_read" if exact else None):
        if flt.ids:
            hint = "; check the id (`outbox-relay status` lists failed rows per destination)"
            await failed_rows(
                conn, schema, flt.ids, verb="retried", hints=(hint, ". Leave them out")
            )
        if dry_run:
            groups = await conn.fetch(sql(queries.RETRY_PREVIEW, schema), *flt.args())
            per = {
                g["destination"]: IdRange(g["rows"], g["first_id"], g["last_id"]) for g in groups
            }
            return Retried(dry_run=True, rows=sum(g["rows"] for g in groups), destinations=per)
        if within is not None:
            same(await select(conn, queries.RETRY_SELECTION, schema, *flt.args()), within)
        retried = conn.fetch(sql(queries.RETRY, schema), *flt.args())
        changed = await (exactly(retried) if exact else retried)
        if changed:
            await conn.execute(queries.NOTIFY, f"{schema}.outbox")  # wake relays at commit
    return Retried(dry_run=False, rows=len(changed), destinations=_ranges(changed))


def _ranges(changed: list[asyncpg.Record]) -> dict[str, IdRange]:
    ids: dict[str, list[int]] = {}
    for r in changed:
        ids.setdefault(r["destination"], []).append(r["id"])
    return {name: IdRange(len(i), min(i), max(i)) for name, i in ids.items()}
