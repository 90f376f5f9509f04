"""The relay's database side: every statement it runs, over one asyncpg pool."""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

import asyncpg
import structlog

from outbox.errors import describe
from outbox.status import Status
from relay.db import queries
from relay.db.owned import OwnedLane
from relay.db.pool import create_pool as create_pool  # where it used to live
from relay.db.pool import dedicated
from relay.db.snapshots import SnapshotHolder, oldest_holder
from relay.model import Envelope, Lease, UnreadableHeaders, epoch

# Errors that mean "the database is unreachable or restarting", as opposed to a bug.
# InternalClientError: asyncpg's on a connection closed mid-statement ("cannot switch to state
# …", MagicStack/asyncpg issue 1069); Store discards it, so the retry gets a fresh one.
log = structlog.get_logger("relay")

DB_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
)

# Errors that say the database cannot take this relay's writes right now, whatever is written:
# unreachable, restarting, read-only, out of connections, a grant missing, a lock or statement
# timeout. Work that hits one is kept and tried again later. Any other error the server
# reports for a statement may be about the values written (see the completer).
UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.PostgresConnectionError,
    asyncpg.OperatorInterventionError,
    asyncpg.InsufficientResourcesError,
    asyncpg.PostgresSystemError,
    asyncpg.ReadOnlySQLTransactionError,
    asyncpg.LockNotAvailableError,
    asyncpg.TransactionRollbackError,
    asyncpg.InsufficientPrivilegeError,
    asyncpg.InvalidAuthorizationSpecificationError,
    asyncpg.InvalidCatalogNameError,
)


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see relay/model.py
class Record:
    """One outcome as the RECORD statement takes it."""

    id: int
    token: int  # the fencing token of the claim this outcome belongs to
    status: Status  # delivered, pending or failed
    counted: int  # 1 if this was an attempt, 0 if deferred
    delay: float  # seconds until run_after, for pending
    error: str | None
    # For ordered destinations: which key's next row a final outcome lets go.
    destination: str = ""
    key: str | None = None
    # Already written by the sink (Outcome.recorded): record() counts it as applied.
    written: bool = False


# Where a retention run's last batch of delivered rows stopped: (delivered_at, id).
RetentionCursor = tuple[Any, int]


# How long an unordered claim that follows a full batch may go on the FENCE reading made
# before it (see Store.claim): a drain reads it once in a few claims, not at every one.
FENCE_REUSE = 0.5

# The claim's lanes (migration 0012), and what each one's predicate must say.
LANES = {"outbox_fresh_idx": "claims = 0", "outbox_waiting_idx": "claims <> 0"}


@dataclass(frozen=True, slots=True)
class _Lane:
    """Where an unordered destination's claims stand in its fresh rows (see queries.CLAIM):
    the cursor, where the next claim's read of late commits begins, and what FENCE read before
    the last claim (the highest id then visible, the open inserts' keys)."""

    cursor: int = 0
    recheck: int = 0
    top: int = 0
    held: frozenset[str] = frozenset()  # "<virtual transaction id>/<key>"

    def recheck_from(self, held: Collection[str]) -> int:
        """Where the next claim's read of late commits begins, now that FENCE reads ``held``:
        inserting transactions open at the previous reading and ended since may have
        committed their rows behind the cursor."""
        ended = self.held.difference(held)
        if ended:
            return min(self.recheck, *(int(k.rsplit("/", 1)[1]) for k in ended))
        return self.recheck


@dataclass(slots=True)
class RetentionBatch:
    """What one retention batch did: rows deleted, whether more may be due, where it
    stopped in the delivered rows (for the next batch of the same run)."""

    deleted: int
    more: bool
    cursor: RetentionCursor | None


class Store:
    def __init__(
        self,
        pool: asyncpg.Pool,
        schema: str,
        relay_id: str,
        lease: float,
        *,
        delete_delivered: bool = False,
    ) -> None:
        self.pool = pool
        # Statements run, by name: the benchmark reports statements per event from these.
        self.statements: Counter[str] = Counter()
        self.relay_id = relay_id
        self.lease = lease
        self.schema = schema
        self.channel = f"{schema}.outbox"
        # retention = 0: delivered rows are deleted by the statement that records them.
        self.delete_delivered = delete_delivered
        self._claim_state()

        def sql(statement: str) -> str:
            return queries.render_ops(statement, schema)

        self._claim_statements(sql)
        self._outcome_statements(sql, delete_delivered)
        self._upkeep_statements(sql)
        self._table = queries.qualified_table(schema)
        self._paused_table = queries.qualified_table(schema, queries.PAUSED_TABLE)
        self._relays_table = queries.qualified_table(schema, queries.RELAYS_TABLE)
        self._endpoint_tables = tuple(
            queries.qualified_table(schema, t)
            for t in ("outbox_endpoints", "outbox_deliveries", "outbox_attempts")
        )

    def _claim_state(self) -> None:
        """Where the claims stand, kept between them."""
        # The last FENCE reading an unordered claim made (monotonic time, row), of the epoch
        # the cursors hold for, and the destinations whose last claim filled its batch: their
        # next claim, at once, may go on that reading (see claim).
        self._reading: tuple[float, asyncpg.Record] | None = None
        self._draining: set[str] = set()
        # Per unordered destination, where its next claim of fresh rows starts and up to where
        # every fresh row has been seen (see CLAIM), and the table's epoch they hold for.
        self._cursors: dict[str, _Lane] = {}
        self._rewinds: dict[str, int] = {}
        self._claiming: set[str] = set()
        self._epoch: tuple[object, ...] = ()
        self._stats_epoch: tuple[object, ...] = ()
        self._stats_top = 0
        # Per destination, below which the pending gauges need not count (see
        # PENDING_BY_DESTINATION).
        self._stats_floors: dict[str, int] = {}
        # The pooled connection that holds the session locks of the ordered destinations this
        # relay owns, and runs their claims (relay/pipeline/ordered.py): when it ends, so do both.
        self._owner: asyncpg.Connection | None = None
        self._owned: set[str] = set()

    def _claim_statements(self, sql: Callable[[str], str]) -> None:
        self._claim = sql(queries.CLAIM)
        self._claim_fresh = sql(queries.CLAIM_FRESH)
        self._fresh_below = sql(queries.FRESH_BELOW)
        self._claim_ordered = sql(queries.CLAIM_ORDERED)
        self._claim_owned = sql(queries.CLAIM_OWNED)
        self._own = sql(queries.OWN_ORDERED)
        self._running_keyed = sql(queries.RUNNING_KEYED)
        self._still_running = sql(queries.STILL_RUNNING)
        self._unowned_peers = sql(queries.UNOWNED_PEERS)
        self._fence = sql(queries.FENCE)
        self._blocked_keys = sql(queries.BLOCKED_KEYS)

    def _outcome_statements(self, sql: Callable[[str], str], delete_delivered: bool) -> None:
        self._record = sql(queries.RECORD_DELETING if delete_delivered else queries.RECORD)
        self._record_delivered = sql(
            queries.RECORD_DELIVERED_DELETING if delete_delivered else queries.RECORD_DELIVERED
        )
        self._heartbeat = sql(queries.HEARTBEAT)
        self._settled = sql(queries.SETTLED)
        self._reap = sql(queries.REAP)
        self._expired = sql(queries.EXPIRED)
        self._release = sql(queries.RELEASE)

    def _upkeep_statements(self, sql: Callable[[str], str]) -> None:
        self._unknown = sql(queries.UNKNOWN_DESTINATIONS)
        self._fail_unknown = sql(queries.FAIL_UNKNOWN_DESTINATIONS)
        self._paused = sql(queries.PAUSED)
        self._pending = sql(queries.PENDING_BY_DESTINATION)
        self._retention_delivered = sql(queries.RETENTION_DELIVERED)
        self._delete_locked = sql(queries.DELETE_LOCKED)
        self._purge_finished = sql(queries.PURGE_FINISHED)
        self._register = sql(queries.REGISTER)
        self._unregister = sql(queries.UNREGISTER)
        self._forget_relays = sql(queries.FORGET_RELAYS)
        # Retention of ended endpoint deliveries and of the message log (migration 0006).
        self._purge_deliveries = sql(queries.PURGE_DELIVERIES)
        self._purge_attempts = sql(queries.PURGE_ATTEMPTS)

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection. One that fails in the middle of a statement is closed rather
        than returned to the pool: it may be left mid-protocol (the pool skips its reset, see
        ``relay.db.pool``), and every later use of it would fail."""
        async with self.pool.acquire() as conn:
            try:
                yield conn
            except BaseException as exc:
                if not is_plain_sql_error(exc) or isinstance(exc, SESSION_STALE):
                    # A connection the server closed is already detached from the pool.
                    with contextlib.suppress(asyncpg.InterfaceError):
                        conn.terminate()
                raise

    async def _call(self, method: str, sql: str, *args: Any) -> Any:
        async with self._connection() as conn:
            return await getattr(conn, method)(sql, *args)

    async def call(self, method: str, sql: str, *args: Any) -> Any:
        """Run a statement of a sink that keeps tables of its own (the endpoints sink), on
        this pool, with its connection handling; ``sql`` is rendered for the schema."""
        return await self._call(method, queries.render_ops(sql, self.schema), *args)

    async def missing_tables(self) -> list[str]:
        """The outbox tables this relay needs that are not in its schema."""
        tables = (self._table, self._paused_table, self._relays_table, *self._endpoint_tables)
        missing = [t for t in tables if not await self._call("fetchval", queries.TABLE_EXISTS, t)]
        added = (  # columns of later migrations, the first one missing said
            (self._endpoint_tables[1], "replay", "0007"),
            (self._endpoint_tables[0], "circuit_open_until", "0009"),
            (self._relays_table, "circuits", "0010"),
            (self._relays_table, "features_at", "0013"),
        )
        for table, column, migration in added:
            if missing:
                break
            if not await self._call("fetchval", queries.COLUMN_EXISTS, table, column):
                missing.append(f"{table}.{column} (migration {migration})")
        if not missing:
            # The claim's lanes: without them it would read the whole table, claim after claim.
            for index, holds in LANES.items():
                name = queries.qualified_table(self.schema, index)
                predicate = await self._call("fetchval", queries.INDEX_VALID, name)
                if predicate is None:
                    missing.append(f"{name} (migration 0012)")
                elif holds not in predicate:
                    # Built by a first version of 0012 (on main for a day, never released),
                    # which `migrate` does not run again.
                    missing.append(
                        f"{name} as migration 0012 builds it now (it holds {predicate}): "
                        f"DROP INDEX CONCURRENTLY {name}; then run its CREATE INDEX from "
                        "migrations/0012_claim_lanes.sql"
                    )
            # The owner's claim of an ordered destination reads the failed rows by it.
            failed = queries.qualified_table(self.schema, "outbox_failed_key_idx")
            if await self._call("fetchval", queries.INDEX_VALID, failed) is None:
                missing.append(f"{failed} (migration 0014)")
        return missing

    async def missing_privileges(self) -> list[str]:
        """What the relay's role may not do on the endpoint tables (a role granted before
        migration 0006/0007: deploy/sql/relay_role.sql must run again). Retention reads them
        for every destination."""
        endpoints, deliveries, attempts = self._endpoint_tables
        wanted = [
            (endpoints, "SELECT"),
            (deliveries, "SELECT"),
            (deliveries, "INSERT"),
            (deliveries, "UPDATE"),
            (deliveries, "DELETE"),
            (attempts, "SELECT"),
            (attempts, "INSERT"),
            (attempts, "DELETE"),
        ]
        return [
            f"{what} on {table}"
            for table, what in wanted
            if not await self._call("fetchval", queries.TABLE_PRIVILEGE, table, what)
        ]

    async def server_encoding(self) -> str:
        return str(await self._call("fetchval", queries.SERVER_ENCODING))

    async def paused(self) -> set[str]:
        return {r[0] for r in await self._call("fetch", self._paused)}

    async def ping(self) -> None:
        await self._call("fetchval", queries.PING)

    async def _as_only_runner(
        self, job: str, sql: str, *args: object
    ) -> list[asyncpg.Record] | None:
        """Run ``sql`` in a transaction holding the job's advisory lock; None if another
        relay holds it right now. The lock ends with the transaction, or with the connection
        if this relay dies, so it can never be left behind."""
        async with self._connection() as conn, conn.transaction():
            if not await conn.fetchval(queries.TRY_JOB_LOCK, f"{self.schema}:{job}"):
                return None
            return list(await conn.fetch(sql, *args))

    async def pending_stats(self) -> dict[str, tuple[int, float]] | None:
        """Pending rows and oldest pending age per destination; None if another relay is
        computing them at this moment."""
        async with self._connection() as conn, conn.transaction():
            if not await conn.fetchval(queries.TRY_JOB_LOCK, f"{self.schema}:stats"):
                return None
            # Two statements, in this order: the count's snapshot must be younger than the fence.
            safe_id, *epoch, self._stats_top, _ = await conn.fetchrow(
                self._fence, self._table, self._stats_top
            )
            if tuple(epoch) != self._stats_epoch:  # see claim
                self._stats_epoch = tuple(epoch)
                self._stats_floors.clear()
                safe_id, *_, self._stats_top, _ = await conn.fetchrow(self._fence, self._table, 0)
            floors = self._stats_floors
            rows = await conn.fetch(self._pending, list(floors), list(floors.values()), safe_id)
        self._stats_floors = {r["destination"]: r["floor"] for r in rows}
        return {r["destination"]: (r["rows"], r["oldest_age"]) for r in rows if r["rows"]}

    async def snapshot_holder(self) -> SnapshotHolder | None:
        """The oldest snapshot or transaction holding back VACUUM of this database."""
        async with self._connection() as conn:
            return await oldest_holder(conn)

    async def delete_finished(
        self,
        retention: float,
        batch_size: int,
        message_log_retention: float | None = None,
        after: RetentionCursor | None = None,
    ) -> RetentionBatch | None:
        """Delete one batch of delivered (and skipped) rows older than ``retention`` seconds,
        resuming after ``after`` (the previous batch's cursor in one retention run), and one
        of ended endpoint deliveries and attempts older than ``message_log_retention``
        (default: ``retention``); None if another relay is running retention at this moment."""
        log_retention = retention if message_log_retention is None else message_log_retention
        async with self._connection() as conn, conn.transaction():
            if not await conn.fetchval(queries.TRY_JOB_LOCK, f"{self.schema}:retention"):
                return None
            at, last_id = after if after is not None else (None, None)
            row = await conn.fetchrow(self._retention_delivered, retention, batch_size, at, last_id)
            deleted = await self._delete_locked_rows(conn, row["ids"], Status.DELIVERED)
            more = row["examined"] >= batch_size
            cursor = (row["at"], row["id"]) if row["examined"] else after
            if not more:
                ids = [
                    r[0]
                    for r in await conn.fetch(
                        self._purge_finished, retention, None, batch_size, [Status.SKIPPED]
                    )
                ]
                deleted += await self._delete_locked_rows(conn, ids, Status.SKIPPED)
                more = len(ids) >= batch_size
        # The message log and ended deliveries have a retention of their own (counted apart:
        # the batch size bounds each), in a transaction of its own: holding the events' locks
        # above while locking deliveries would deadlock with a replay, which locks a delivery
        # and then its event.
        # (If another relay took the job meanwhile, it purges the log in its own batch.)
        try:
            async with self._connection() as conn, conn.transaction():
                if await conn.fetchval(queries.TRY_JOB_LOCK, f"{self.schema}:retention"):
                    for statement in (self._purge_deliveries, self._purge_attempts):
                        status = await conn.execute(statement, log_retention, batch_size)
                        n = int(status.split()[-1])
                        deleted, more = deleted + n, more or n >= batch_size
        except DB_ERRORS as exc:
            # The events' batch is committed: counted, and the log purged by the next run.
            log.warning("relay.retention.message_log_failed", error=describe(exc))
        return RetentionBatch(deleted, more, cursor)

    async def _delete_locked_rows(
        self, conn: asyncpg.Connection, ids: Sequence[int], status: Status
    ) -> int:
        """The second statement of a purge (queries.DELETE_LOCKED): how many it deleted."""
        if not ids:
            return 0
        done = await conn.execute(self._delete_locked, list(ids), [status])
        return int(done.split()[-1])

    async def claim(self, destination: str, limit: int) -> list[Envelope]:
        """Claim up to ``limit`` rows of an unordered ``destination`` (see queries.CLAIM), its
        fresh rows from where its previous claim ended."""
        # Two statements, in this order: the claim's snapshot must be younger than the fence.
        state = self._cursors.get(destination, _Lane())
        reading = self._reading
        reuse = (
            reading is not None
            and destination in self._draining
            and state.cursor < reading[1][3]
            and time.monotonic() - reading[0] < FENCE_REUSE
        )
        # Cleared before anything is awaited: a claim that fails reads the fence afresh.
        self._draining.discard(destination)
        if reuse:
            assert reading is not None
            # A drain: the previous claim filled its batch, and rows visible at the last
            # reading are still ahead of the cursor. An older reading is as safe as a new one
            # (the claim's snapshot is younger still); what it would cost is a late range from
            # its highest id up to the cursor, empty while the cursor is below that id. FENCE
            # was about a twentieth of a drain's database time, most of it planning. Only a
            # reading of the current epoch is kept (below), and the unordered claims alone
            # share it.
            row = reading[1]
        else:
            self.statements["fence"] += 1
            row = await self._call("fetchrow", self._fence, self._table, state.top)
        _, *epoch, top, held = row
        if tuple(epoch) != self._epoch:
            state = _Lane()
            row = await self._new_epoch(tuple(epoch))
            _, *epoch, top, held = row
        if not reuse:
            self._reading = (time.monotonic(), row)
        state = self._cursors.get(destination, state)
        recheck = state.recheck_from(held)
        above = max(state.top, top)  # never lower: rows deleted since are no new ids
        self.statements["claim"] += 1
        until = time.monotonic() + self.lease  # before the statement: never later than its now()
        self._claiming.add(destination)
        args: tuple[object, ...] = (destination, limit, self.relay_id, self.lease, state.cursor)
        try:
            if recheck >= state.cursor:
                # Nothing between the two can have committed late: no late range to read.
                rows = await self._call("fetch", self._claim_fresh, *args, above)
            else:
                rows = await self._call("fetch", self._claim, *args, above, recheck)
        finally:
            self._claiming.discard(destination)
        self._advance(destination, rows, limit, above, held)
        return self._envelopes([r for r in rows if r[0] != -1], until)

    async def _new_epoch(self, epoch: tuple[object, ...]) -> asyncpg.Record:
        """A new table file (TRUNCATE) or a new server (a restart, a failover): ids may be
        handed out again below where the cursors stand, and the fence is read again from the
        start (the reading before capped its highest id with the old epoch's)."""
        self._reading = None
        self._epoch = epoch
        self._cursors.clear()
        self._stats_floors.clear()
        self.statements["fence"] += 1
        return await self._call("fetchrow", self._fence, self._table, 0)

    def _advance(
        self,
        destination: str,
        rows: Sequence[asyncpg.Record],
        limit: int,
        above: int,
        held: Collection[str],
    ) -> None:
        """Where ``destination``'s next claim starts, from the marker row of the claim that
        read ``rows``, and whether it drains (the claim filled its batch)."""
        # The marker row comes last (UNION ALL keeps its branches' order); found by its id.
        marker = rows[-1] if rows[-1][0] == -1 else next(r for r in rows if r[0] == -1)
        cursor, recheck = int(marker[2]), int(marker[4])
        rewind = self._rewinds.pop(destination, None)
        if rewind is not None:  # the sweep found rows below while this claim ran
            cursor, recheck = min(cursor, rewind), min(recheck, rewind)
        self._cursors[destination] = _Lane(cursor, recheck, above, frozenset(held))
        if len(rows) > limit:  # the marker and a full batch
            self._draining.add(destination)

    def fresh_cursor(self, destination: str) -> int:
        """Where the next claim of ``destination``'s fresh rows starts (0: no claim yet)."""
        return self._cursors.get(destination, _Lane()).cursor

    async def sweep(self) -> int:
        """Look below each destination's cursor for fresh rows its claims will not reach
        (ids handed out again: see queries.FRESH_BELOW) and walk from them again; returns how
        many destinations had some. Under a held snapshot this reads every dead entry below
        the cursors: the relay runs it every 30 minutes, off the claim's path."""
        found = 0
        for destination, lane in list(self._cursors.items()):
            self.statements["sweep"] += 1
            lowest = await self._call("fetchval", self._fresh_below, destination, lane.recheck)
            if lowest is not None:
                start = lowest - 1
                now = self._cursors.get(destination, lane)
                self._cursors[destination] = replace(
                    now, cursor=min(now.cursor, start), recheck=min(now.recheck, start)
                )
                if destination in self._claiming:
                    # The claim running now would write its own answer back over this.
                    self._rewinds[destination] = min(self._rewinds.get(destination, start), start)
                found += 1
        return found

    @staticmethod
    def _envelopes(rows: Sequence[asyncpg.Record], until: float) -> list[Envelope]:
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

    async def record(self, records: Sequence[Record]) -> set[tuple[int, int]]:
        """Write outcomes; returns the (id, token) pairs written (the others are no longer
        this relay's under the claim the outcome belongs to). Records a sink already wrote
        are counted as written, not sent again."""
        if any(r.written for r in records):
            done = {(r.id, r.token) for r in records if r.written}
            rest = [r for r in records if not r.written]
            return done | (await self.record(rest) if rest else set())
        self.statements["record"] += 1
        if all(
            r.status == Status.DELIVERED and r.counted == 1 and r.error is None for r in records
        ):
            self.statements["record_delivered"] += 1  # of the "record" ones
            rows = await self._call(
                "fetch",
                self._record_delivered,
                [r.id for r in records],
                [r.token for r in records],
                self.relay_id,
            )
            return {(r[0], r[1]) for r in rows}
        args: list[Any] = [
            [r.id for r in records],
            [r.token for r in records],
            [r.status for r in records],
            [r.counted for r in records],
            [r.delay for r in records],
            [r.error for r in records],
            self.relay_id,
        ]
        if self.delete_delivered:
            # RECORD_DELETING takes the delivered pairs apart as well (see there why).
            delivered = [r for r in records if r.status == Status.DELIVERED]
            args += [[r.id for r in delivered], [r.token for r in delivered]]
        rows = await self._call("fetch", self._record, *args)
        return {(r[0], r[1]) for r in rows}

    async def settled(self, leases: Sequence[tuple[int, int]]) -> set[int]:
        """Of (id, token) pairs, the ids recorded as delivered under that claim."""
        rows = await self._call(
            "fetch", self._settled, [i for i, _ in leases], [t for _, t in leases]
        )
        return {r[0] for r in rows}

    async def heartbeat(self, leases: Sequence[tuple[int, int]]) -> set[int]:
        """Extend the leases of (id, token) pairs; returns the ids still held."""
        self.statements["heartbeat"] += 1
        rows = await self._call(
            "fetch",
            self._heartbeat,
            [i for i, _ in leases],
            [t for _, t in leases],
            self.relay_id,
            self.lease,
        )
        return {r[0] for r in rows}

    async def reap(
        self,
        max_attempts: int,
        per_destination: dict[str, int],
        limit: int = 5000,
        *,
        only: Sequence[int] | None = None,
        never: Sequence[int] = (),
        within: float | None = None,
    ) -> list[asyncpg.Record]:
        """Put rows whose lease expired back to pending (or failed); ``within``: only those
        whose lease ended in the last so many seconds (None: whenever)."""
        self.statements["reap"] += 1
        return list(
            await self._call(
                "fetch",
                self._reap,
                max_attempts,
                limit,
                list(per_destination),
                list(per_destination.values()),
                list(only) if only is not None else None,
                list(never),
                within,
            )
        )

    async def expired(self, limit: int, never: Sequence[int]) -> list[int]:
        return [r[0] for r in await self._call("fetch", self._expired, limit, list(never))]

    async def claim_ordered(
        self,
        destination: str,
        limit: int,
        parks_poison: bool,
        scan: int,
        cursor: str | None,
        origin: str | None = None,
    ) -> tuple[list[Envelope], str | None]:
        """Claim heads of ``destination``'s keys (see queries.CLAIM_ORDERED), examining at most
        ``scan`` keys after ``cursor``, up to the end of a round that ends at ``origin``'s key
        (None: at the last key; the cursor's own key: once round); returns the rows and the
        cursor for the next claim (None when the round is over)."""
        # Two statements, in this order: the claim's snapshot must be younger than the fence.
        # Read for every claim: an older reading (as an unordered drain reuses one) may come
        # from before a TRUNCATE ... RESTART IDENTITY, and its fence would let a head through
        # while a lower id of its key can still commit (found by a review).
        self.statements["fence"] += 1
        safe_id = await self._on_owner(destination, "fetchval", self._fence, self._table, 0)
        self.statements["claim"] += 1
        until = time.monotonic() + self.lease
        rows = await self._on_owner(
            destination,
            "fetch",
            self._claim_ordered,
            destination,
            limit,
            self.relay_id,
            self.lease,
            scan,
            parks_poison,
            cursor,
            safe_id,
            origin if cursor is not None else None,
        )
        return self._envelopes(rows[:-1], until), rows[-1][2]

    # --- ordered destinations' owners (relay/pipeline/ordered.py) ---------------------------------

    def owns(self, destination: str) -> bool:
        if self._owner is not None and self._owner.is_closed():
            # Its session ended (the server closed it, idle or not): so did its locks.
            self._owner = None
            if self._owned:
                log.info("relay.ordered.released", destinations=sorted(self._owned))
            self._owned.clear()
        return destination in self._owned

    async def _on_owner(self, destination: str, method: str, sql: str, *args: Any) -> Any:
        """Run a statement of ``destination``'s claim: on the owner's connection if this relay
        owns it (so that a claim fails once the lock is gone, in whichever mode the owner
        claims), on the pool otherwise."""
        conn = self._owner
        if conn is None or destination not in self._owned:
            return await self._call(method, sql, *args)
        try:
            return await getattr(conn, method)(sql, *args)
        except BaseException as exc:
            await self._owner_failed(exc)
            raise

    async def own(self, destination: str) -> bool:
        """Whether this relay owns ordered ``destination``, taking it if no relay does."""
        if destination in self._owned:
            return True
        if self._owner is None:
            self._owner = await dedicated(self.pool)
        try:
            self.statements["own"] += 1
            taken = bool(await self._owner.fetchval(self._own, self._table, destination))
        except BaseException as exc:
            await self._owner_failed(exc)
            raise
        if taken:
            self._owned.add(destination)
            log.info("relay.ordered.owner", destination=destination)
        return taken

    async def _owner_failed(self, exc: BaseException) -> None:
        """A statement on the owner's connection failed: the ownership ends with the
        connection, unless the server merely refused the statement (the connection, and the
        locks, are fine; the memory of what was read stays valid)."""
        conn = self._owner
        if conn is None or conn.is_closed() or not is_plain_sql_error(exc):
            await self.disown()

    async def disown(self) -> None:
        """Let go of every ordered destination: the connection holding them is closed (its
        session locks end with it)."""
        conn, self._owner = self._owner, None
        if self._owned:
            log.info("relay.ordered.released", destinations=sorted(self._owned))
        self._owned.clear()
        if conn is not None:
            conn.terminate()

    async def running_keyed(self, destination: str) -> dict[int, tuple[int, str]]:
        """Keyed rows of ``destination`` in flight: id -> (token, key)."""
        rows = await self._call("fetch", self._running_keyed, destination)
        return {r[0]: (r[1], r[2]) for r in rows}

    async def still_running(self, leases: Collection[tuple[int, int]]) -> set[int]:
        """Of (id, token) pairs, the ids still running under that claim."""
        rows = await self._call(
            "fetch", self._still_running, [i for i, _ in leases], [t for _, t in leases]
        )
        return {r[0] for r in rows}

    async def unowned_peers(self, destination: str, seen_within: float) -> bool:
        """Whether a relay of an earlier release serves ``destination``."""
        return bool(
            await self._call(
                "fetchval", self._unowned_peers, self.relay_id, destination, seen_within
            )
        )

    async def claim_owned(
        self,
        destination: str,
        limit: int,
        parks_poison: bool,
        scan: int,
        lane: OwnedLane,
        busy: Collection[str],
        peers_within: float,
    ) -> tuple[list[Envelope], bool | None]:
        """Claim heads of owned ``destination``'s keys (see queries.CLAIM_OWNED), reading at
        most ``scan`` fresh rows after those ``lane`` holds; ``busy``: the keys in flight.
        Returns the rows, and whether more may be claimable at once (the batch was full, or
        the reading stopped at ``scan``); None instead when a relay of an earlier release,
        seen within ``peers_within`` seconds, serves the destination: nothing was claimed."""
        conn = self._owner
        if conn is None or destination not in self._owned:
            raise RuntimeError(f"ordered destination {destination!r} is not this relay's")
        try:
            # Two statements, in this order: the claim's snapshot must be younger than the
            # fence. On the owner's connection: the lock is held while the claim commits.
            safe_id = await self._owned_fence(conn, lane)
            ids, keys, keyless = lane.candidates(busy, limit)
            # After a full batch the next one most likely fills from memory too: no reading
            # ahead, so a drain keeps in memory about what it needs, in id order.
            reading = 0 if lane.full else scan
            self.statements["claim"] += 1
            until = time.monotonic() + self.lease
            rows = await conn.fetch(
                self._claim_owned,
                destination,
                limit,
                self.relay_id,
                self.lease,
                lane.hw,
                safe_id,
                reading,
                not parks_poison,
                ids,
                keys,
                list(busy),
                keyless,
                peers_within,
            )
        except BaseException as exc:
            await self._owner_failed(exc)
            raise
        if any(r[0] == -4 for r in rows):
            return [], None
        claimed = [r for r in rows if r[0] > 0]
        more = self._absorb_owned(lane, rows, claimed, limit, reading, safe_id)
        return self._envelopes(claimed, until), more

    async def _owned_fence(self, conn: asyncpg.Connection, lane: OwnedLane) -> int:
        """FENCE's safe id for an owned destination's claim, read on the owner's connection;
        ``lane`` starts again if the table's epoch changed."""
        safe_id: int
        self.statements["fence"] += 1
        safe_id, *epoch, top, _ = await conn.fetchrow(self._fence, self._table, lane.top)
        if tuple(epoch) != lane.epoch:
            # A TRUNCATE or a new server: ids may be handed out again, and ids in memory
            # may now be other rows.
            lane.reset(tuple(epoch))
            self.statements["fence"] += 1
            safe_id, *_, top, _ = await conn.fetchrow(self._fence, self._table, 0)
        lane.top = max(lane.top, top)
        return safe_id

    @staticmethod
    def _absorb_owned(
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

    async def blocked_keys(self, blocking: Sequence[str]) -> list[asyncpg.Record]:
        return list(await self._call("fetch", self._blocked_keys, list(blocking)))

    async def release(self, leases: Sequence[tuple[int, int]]) -> None:
        """Put (id, token) pairs back to pending, unattempted."""
        await self._call(
            "execute",
            self._release,
            self.relay_id,
            [i for i, _ in leases],
            [t for _, t in leases],
        )

    async def unknown_destinations(
        self, known: Sequence[str], served_within: float
    ) -> list[asyncpg.Record]:
        return list(await self._call("fetch", self._unknown, list(known), served_within))

    async def fail_unknown_destinations(
        self, known: Sequence[str], served_within: float, grace: float
    ) -> list[asyncpg.Record]:
        return list(
            await self._call("fetch", self._fail_unknown, list(known), served_within, grace)
        )

    async def register(
        self,
        host: str,
        pid: int,
        version: str,
        destinations: Sequence[str],
        circuits: dict[str, str] | None = None,
    ) -> None:
        """``circuits``: the destinations whose circuit is not closed here, and its state."""
        await self._call(
            "execute",
            self._register,
            self.relay_id,
            host,
            pid,
            version,
            list(destinations),
            json.dumps(circuits or {}),
        )

    async def unregister(self) -> None:
        await self._call("execute", self._unregister, self.relay_id)

    async def forget_relays(self, older_than: float) -> None:
        await self._call("execute", self._forget_relays, older_than)


# Errors that may come from a session default set when the connection was opened (a database
# or role made read-only, then not): the connection is replaced, so the next one sees the
# current settings.
SESSION_STALE: tuple[type[BaseException], ...] = (asyncpg.ReadOnlySQLTransactionError,)


def read_headers(text: str) -> Any:
    """A row's headers (as text): the object, or UnreadableHeaders saying why it is not one."""
    try:
        return json.loads(text)
    except (RecursionError, ValueError) as exc:
        return UnreadableHeaders(describe(exc))


def is_plain_sql_error(exc: BaseException) -> bool:
    """An error the server reported for the statement, on a connection that is still fine."""
    return isinstance(exc, asyncpg.PostgresError) and not isinstance(
        exc, asyncpg.PostgresConnectionError | asyncpg.AdminShutdownError
    )
