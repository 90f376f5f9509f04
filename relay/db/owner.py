"""The owners of ordered destinations (relay/pipeline/ordered.py): the connection that holds the
session locks of the destinations this relay owns (see queries.OWN_ORDERED), which their claims
run on (Store.claim_owned, Store.claim_ordered), and how a claim of the owner reads the fence
and takes what it read into the destination's lane (relay/db/owned.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import asyncpg
import structlog

from relay.db import queries
from relay.db.errors import is_plain_sql_error
from relay.db.owned import OwnedLane
from relay.db.pool import Call, dedicated

log = structlog.get_logger("relay")


class Owner:
    """The ordered destinations this relay owns, on one store: ``call`` runs a statement on
    ``pool`` (for a destination it does not own), ``statements`` counts them by name."""

    def __init__(
        self, pool: asyncpg.Pool, call: Call, statements: Counter[str], schema: str
    ) -> None:
        self.pool = pool
        self._call = call
        self.statements = statements
        # The connection that holds the session locks of the ordered destinations this relay
        # owns, and runs their claims: when it ends, so do both.
        self.conn: asyncpg.Connection | None = None
        self._owned: set[str] = set()
        self._table = queries.qualified_table(schema)
        self._fence = queries.render_ops(queries.FENCE, schema)
        self._own = queries.render_ops(queries.OWN_ORDERED, schema)

    def owns(self, destination: str) -> bool:
        if self.conn is not None and self.conn.is_closed():
            # Its session ended (the server closed it, idle or not): so did its locks.
            self.conn = None
            if self._owned:
                log.info("relay.ordered.released", destinations=sorted(self._owned))
            self._owned.clear()
        return destination in self._owned

    async def on_owner(self, destination: str, method: str, sql: str, *args: Any) -> Any:
        """Run a statement of ``destination``'s claim: on the owner's connection if this relay
        owns it (so that a claim fails once the lock is gone, in whichever mode the owner
        claims), on the pool otherwise."""
        conn = self.conn
        if conn is None or destination not in self._owned:
            return await self._call(method, sql, *args)
        try:
            return await getattr(conn, method)(sql, *args)
        except BaseException as exc:
            await self.failed(exc)
            raise

    async def own(self, destination: str) -> bool:
        """Whether this relay owns ordered ``destination``, taking it if no relay does."""
        if destination in self._owned:
            return True
        if self.conn is None:
            self.conn = await dedicated(self.pool)
        try:
            self.statements["own"] += 1
            taken = bool(await self.conn.fetchval(self._own, self._table, destination))
        except BaseException as exc:
            await self.failed(exc)
            raise
        if taken:
            self._owned.add(destination)
            log.info("relay.ordered.owner", destination=destination)
        return taken

    async def failed(self, exc: BaseException) -> None:
        """A statement on the owner's connection failed: the ownership ends with the
        connection, unless the server merely refused the statement (the connection, and the
        locks, are fine; the memory of what was read stays valid)."""
        conn = self.conn
        if conn is None or conn.is_closed() or not is_plain_sql_error(exc):
            await self.disown()

    async def disown(self) -> None:
        """Let go of every ordered destination: the connection holding them is closed (its
        session locks end with it)."""
        conn, self.conn = self.conn, None
        if self._owned:
            log.info("relay.ordered.released", destinations=sorted(self._owned))
        self._owned.clear()
        if conn is not None:
            conn.terminate()

    def holding(self, destination: str) -> asyncpg.Connection:
        """The owner's connection, which an owned ``destination``'s claim runs on."""
        conn = self.conn
        if conn is None or destination not in self._owned:
            raise RuntimeError(f"ordered destination {destination!r} is not this relay's")
        return conn

    async def fence(self, conn: asyncpg.Connection, lane: OwnedLane) -> int:
        """FENCE's safe id for an owned destination's claim, read on the owner's connection;
        ``lane`` starts again if the table's epoch changed."""
        safe_id: int
        self.statements["fence"] += 1
        safe_id, *epoch, top, _, _ = await conn.fetchrow(self._fence, self._table, lane.top)
        if tuple(epoch) != lane.epoch:
            # A TRUNCATE or a new server: ids may be handed out again, and ids in memory
            # may now be other rows.
            lane.reset(tuple(epoch))
            self.statements["fence"] += 1
            safe_id, *_, top, _, _ = await conn.fetchrow(self._fence, self._table, 0)
        lane.top = max(lane.top, top)
        return safe_id


def absorb(
    lane: OwnedLane,
    rows: Sequence[asyncpg.Record],
    claimed: Sequence[asyncpg.Record],
    limit: int,
    reading: int,
    safe_id: int,
) -> bool:
    """Take what CLAIM_OWNED read into ``lane``; whether more may be claimable at once."""
    ids_claimed = {r[0] for r in claimed}
    scanned = sorted((int(r[4]), r[2]) for r in rows if r[0] == -3)
    # -2 rows carry no key: found by id among the keys' first rows (or it has none).
    firsts = {queue[0]: key for key, queue in lane.queues.items()}
    taken = [(r[0], r[2]) for r in claimed]
    gone = [(i, firsts.get(i)) for i in (int(r[4]) for r in rows if r[0] == -2)]
    if not reading:
        hw = lane.hw
    elif len(scanned) >= reading:
        hw = scanned[-1][0]
    else:
        hw = safe_id  # short of the limit: every fresh row up to the fence was read
    lane.absorb(taken + gone, [(i, k) for i, k in scanned if i not in ids_claimed], hw)
    lane.full = len(claimed) >= limit
    # Claim again at once: the batch was full, the reading stopped at its limit or did not
    # read (the next one does), or rows found gone may have left heads behind them.
    return lane.full or not reading or len(scanned) >= reading or bool(gone)
