"""`purge`: delivered and skipped rows (and failed ones, if asked) older than a window,
deleted a batch per transaction; counted first, and confirmed where a preview counted them
(relay/ops/selection.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import asyncpg

from outbox.status import Status
from relay.ops import queries
from relay.ops.common import Result, check_tables, sql
from relay.ops.selection import Selection, same, select

PurgeStatements = list[tuple[str, str, tuple[Any, ...]]]  # (status, lock statement, its args)
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class PurgeCount(Result):
    """A dry run: the rows that would be deleted, per destination and status."""

    dry_run: bool
    rows: int
    destinations: dict[str, dict[str, int]]


@dataclass(frozen=True)
class Purged(Result):
    dry_run: bool
    rows: int
    deleted: dict[str, int]  # delivered, skipped, failed
    batches: int


@dataclass(frozen=True)
class PurgeScope:
    """Which rows a purge deletes: older than ``older_than`` seconds, failed ones too with
    ``failed``, of these destinations (None: every one)."""

    older_than: float
    failed: bool
    destinations: list[str] | None

    def args(self) -> tuple[Any, ...]:
        return (self.older_than, self.destinations, self.failed)


async def purge_preview(
    conn: asyncpg.Connection, schema: str, scope: PurgeScope
) -> tuple[PurgeCount, Selection]:
    """purge's dry run, and the selection that confirms it (``purge(within=…)``), read in
    one snapshot."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        await check_tables(conn, schema)
        counted = await _count(conn, schema, scope)
        selection = await select(conn, queries.PURGE_SELECTION, schema, *scope.args(), None, None)
    return counted, selection


async def purge_count(conn: asyncpg.Connection, schema: str, scope: PurgeScope) -> PurgeCount:
    """What purge would delete, per destination and status; deletes nothing."""
    await check_tables(conn, schema)
    return await _count(conn, schema, scope)


async def _count(conn: asyncpg.Connection, schema: str, scope: PurgeScope) -> PurgeCount:
    rows = await conn.fetch(sql(queries.PURGE_PREVIEW, schema), *scope.args())
    per: dict[str, dict[str, int]] = {}
    for r in rows:
        per.setdefault(r["destination"], {})[r["status"]] = r["rows"]
    return PurgeCount(dry_run=True, rows=sum(r["rows"] for r in rows), destinations=per)


async def purge(
    conn: asyncpg.Connection,
    schema: str,
    scope: PurgeScope,
    *,
    batch_size: int,
    progress: Progress | None = None,
    within: Selection | None = None,
) -> Purged:
    """Delete the rows of ``scope``, delivered and skipped (and failed, if it says so) rows
    that reached that status long enough ago, one small transaction per batch (purge_count
    counts them and deletes nothing).

    ``progress(deleted, total)`` is called before the first batch and after each: the rows
    deleted so far, of the ``total`` counted first (rows that age meanwhile may be deleted
    too, rows another session has locked are passed over).

    ``within``: only the rows of that selection (from purge_preview: aged as of its clock,
    ids up to its highest), or SelectionChanged if they are no longer the rows that match.
    Checked once, before the batches: rows can only leave that set afterwards (deleted by
    another session, a failed row retried), never join it."""
    await check_tables(conn, schema)
    if within is not None:
        return await _purge_within(conn, schema, within, scope, batch_size, progress)
    total = (await _count(conn, schema, scope)).rows
    if progress is not None:
        progress(0, total)
    statements = _statements(scope.failed, queries.PURGE_DELIVERED, queries.PURGE_FINISHED)
    args = (scope.older_than, scope.destinations, batch_size)
    return await _purge_batches(conn, schema, statements, args, total, progress)


def _statements(failed: bool, delivered: str, finished: str) -> PurgeStatements:
    """The lock statements of a purge, a status at a time."""
    statements: PurgeStatements = [
        ("delivered", delivered, ()),
        ("skipped", finished, ([Status.SKIPPED],)),
    ]
    if failed:
        statements.append(("failed", finished, ([Status.FAILED],)))
    return statements


async def _purge_batches(
    conn: asyncpg.Connection,
    schema: str,
    statements: PurgeStatements,
    args: tuple[Any, ...],
    total: int,
    progress: Progress | None,
) -> Purged:
    """Each status's rows a batch at a time (``args``: the lock statements' first, the
    batch size third), until a batch takes fewer than a batch size."""
    batch_size = args[2]
    deleted = {"delivered": 0, "skipped": 0, "failed": 0}
    batches = 0
    for status_name, statement, extra in statements:
        rendered = sql(statement, schema)
        while True:
            taken, n = await _purge_batch(conn, schema, rendered, status_name, *args, *extra)
            deleted[status_name] += n
            batches += 1
            if progress is not None:
                progress(sum(deleted.values()), total)
            if taken < batch_size:
                break
    return Purged(dry_run=False, rows=sum(deleted.values()), deleted=deleted, batches=batches)


async def _purge_batch(
    conn: asyncpg.Connection, schema: str, lock: str, status: str, *args: Any
) -> tuple[int, int]:
    """One batch of a purge, in a transaction of its own: the candidates locked by ``lock``,
    then deleted unless a delivery needs them (queries.DELETE_LOCKED says why in two
    statements); how many it took, and how many it deleted."""
    async with conn.transaction():
        ids = [r[0] for r in await conn.fetch(lock, *args)]
        if not ids:
            return 0, 0
        done = await conn.execute(sql(queries.DELETE_LOCKED, schema), ids, [status])
    return len(ids), int(done.split()[-1])


async def _purge_within(
    conn: asyncpg.Connection,
    schema: str,
    within: Selection,
    scope: PurgeScope,
    batch_size: int,
    progress: Progress | None,
) -> Purged:
    bound = (within.at, within.max_id)
    same(await select(conn, queries.PURGE_SELECTION, schema, *scope.args(), *bound), within)
    if progress is not None:
        progress(0, within.rows)
    statements = _statements(
        scope.failed, queries.PURGE_SELECTED_DELIVERED, queries.PURGE_SELECTED_FINISHED
    )
    args = (scope.older_than, scope.destinations, batch_size, *bound)
    return await _purge_batches(conn, schema, statements, args, within.rows, progress)
