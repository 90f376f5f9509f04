"""`pause`, `resume` and `skip`: a destination's rows held back from every relay and let go
again; failed rows given up on (skipped, never delivered), so that the keys they block move
on."""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from relay.ops import queries
from relay.ops.common import Result, check_tables, failed_rows, iso, sql


@dataclass(frozen=True)
class PauseResult(Result):
    destination: str
    paused: bool
    already_paused: bool
    since: str | None


@dataclass(frozen=True)
class ResumeResult(Result):
    destination: str
    paused: bool
    was_paused: bool
    paused_since: str | None


@dataclass(frozen=True)
class SkipIds(Result):
    rows: int
    ids: list[int]


@dataclass(frozen=True)
class SkipCount(Result):
    """skip's dry run: the rows it would skip, per destination."""

    dry_run: bool
    rows: int
    ids: list[int]
    destinations: dict[str, SkipIds]


@dataclass(frozen=True)
class Skipped(Result):
    dry_run: bool
    rows: int
    ids: list[int]


async def pause(
    conn: asyncpg.Connection, schema: str, destination: str, by: str | None, reason: str | None
) -> PauseResult:
    await check_tables(conn, schema)
    r = await conn.fetchrow(sql(queries.PAUSE, schema), destination, by, reason)
    assert r is not None
    return PauseResult(
        destination=destination,
        paused=True,
        already_paused=not r["inserted"],
        since=iso(r["paused_at"]),
    )


async def resume(conn: asyncpg.Connection, schema: str, destination: str) -> ResumeResult:
    await check_tables(conn, schema)
    async with conn.transaction():
        r = await conn.fetchrow(sql(queries.RESUME, schema), destination)
        if r is not None:
            # Both the claims and the endpoint deliveries of the destination start again.
            await conn.execute(queries.NOTIFY_ENDPOINTS, f"{schema}.outbox")
    return ResumeResult(
        destination=destination,
        paused=False,
        was_paused=r is not None,
        paused_since=iso(r["paused_at"]) if r is not None else None,
    )


async def skip_count(conn: asyncpg.Connection, schema: str, ids: list[int]) -> SkipCount:
    """What skip would do: the rows checked (all failed, or AdminError), per destination."""
    await check_tables(conn, schema)
    async with conn.transaction():
        rows = await failed_rows(conn, schema, ids, verb="skipped", hints=("", ""))
    per: dict[str, list[int]] = {}
    for r in rows:
        per.setdefault(r["destination"], []).append(r["id"])
    found = sorted({r["id"] for r in rows})
    return SkipCount(
        dry_run=True,
        rows=len(found),
        ids=found,
        destinations={d: SkipIds(len(i), sorted(i)) for d, i in per.items()},
    )


async def skip(conn: asyncpg.Connection, schema: str, ids: list[int], by: str) -> Skipped:
    """Mark failed rows ``skipped`` (never delivered) and let their keys move on; AdminError
    (and nothing changed) if one is not failed."""
    await check_tables(conn, schema)
    async with conn.transaction():
        await failed_rows(conn, schema, ids, verb="skipped", hints=("", ""))
        done = await conn.fetch(sql(queries.SKIP, schema), ids, by)
        # The key's next row is its head now; wake the relays at commit to claim it.
        await conn.execute(queries.NOTIFY, f"{schema}.outbox")
    return Skipped(dry_run=False, rows=len(done), ids=sorted(r["id"] for r in done))
