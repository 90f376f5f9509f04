"""The relay's database side: every statement it runs, over one asyncpg pool. Store is what the
pipeline, the maintenance jobs and the sinks are given: it runs the one-statement steps and the
ordered destinations' claims itself, and hands the rest to its parts: the unordered claim's
lanes (relay/db/claims.py), the ordered destinations' owners (relay/db/owner.py, whose
connection their claims run on), the pending gauges (relay/db/gauges.py), retention
(relay/db/retention.py) and the start-up checks (relay/db/checks.py)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from outbox.status import Status
from relay.db import checks, queries
from relay.db.batches import BatchLeases, BatchStatements
from relay.db.claims import UnorderedClaims
from relay.db.envelopes import envelopes
from relay.db.envelopes import read_headers as read_headers
from relay.db.errors import DB_ERRORS as DB_ERRORS
from relay.db.errors import UNAVAILABLE as UNAVAILABLE
from relay.db.errors import is_plain_sql_error as is_plain_sql_error
from relay.db.gauges import PendingGauges
from relay.db.order import in_id_order as in_id_order
from relay.db.owned import OwnedLane
from relay.db.owner import Owner, absorb
from relay.db.pool import connection
from relay.db.pool import create_pool as create_pool  # where it used to live
from relay.db.retention import Retention, RetentionBatch, RetentionCursor
from relay.db.snapshots import SnapshotHolder, oldest_holder
from relay.model import Envelope


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see relay/model.py
class Record:
    """One outcome as the RECORD statement takes it."""

    id: int
    token: int  # the fencing token of the claim this outcome belongs to
    # delivered, pending or failed (a Status); another source's rows may have states of their
    # own (a delivery may be cancelled), compared by value
    status: str
    counted: int  # 1 if this was an attempt, 0 if deferred
    delay: float  # seconds until run_after, for pending
    error: str | None
    # For ordered destinations: which key's next row a final outcome lets go.
    destination: str = ""
    key: str | None = None
    # Already written by the sink (Outcome.recorded): record() counts it as applied.
    written: bool = False


class Store:
    def __init__(
        self,
        pool: asyncpg.Pool,
        schema: str,
        relay_id: str,
        lease: float,
        *,
        delete_delivered: bool = False,
        batched: Collection[str] = (),
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
        # Its parts run their statements through _call (bound here, so a subclass's runs too).
        self.gauges = PendingGauges(pool, schema)
        self.unordered = UnorderedClaims(
            self._call,
            self.statements,
            schema,
            relay_id,
            lease,
            self.gauges.forget,
            batched=batched,
        )
        self.owner = Owner(pool, self._call, self.statements, schema)
        self.retention = Retention(pool, schema)

        def sql(statement: str) -> str:
            return queries.render_ops(statement, schema)

        self._record = sql(queries.RECORD_DELETING if delete_delivered else queries.RECORD)
        self._record_delivered = sql(
            queries.RECORD_DELIVERED_DELETING if delete_delivered else queries.RECORD_DELIVERED
        )
        self.batches = BatchStatements.of(schema, delete_delivered)  # negative tokens
        self._heartbeat = sql(queries.HEARTBEAT)
        self._settled = sql(queries.SETTLED)
        self._reap = sql(queries.REAP)
        self._expired = sql(queries.EXPIRED)
        self._release = sql(queries.RELEASE)
        self._table = queries.qualified_table(schema)
        self._fence = sql(queries.FENCE)
        self._claim_ordered = sql(queries.CLAIM_ORDERED)
        self._claim_owned = sql(queries.CLAIM_OWNED)
        self._running_keyed = sql(queries.RUNNING_KEYED)
        self._still_running = sql(queries.STILL_RUNNING)
        self._unowned_peers = sql(queries.UNOWNED_PEERS)
        self._blocked_keys = sql(queries.BLOCKED_KEYS)
        self._unknown = sql(queries.UNKNOWN_DESTINATIONS)
        self._fail_unknown = sql(queries.FAIL_UNKNOWN_DESTINATIONS)
        self._paused = sql(queries.PAUSED)
        self._register = sql(queries.REGISTER)
        self._unregister = sql(queries.UNREGISTER)
        self._forget_relays = sql(queries.FORGET_RELAYS)

    async def _call(self, method: str, sql: str, *args: Any) -> Any:
        """Run ``sql`` in a pooled connection of its own (see relay.db.pool.connection)."""
        async with connection(self.pool) as conn:
            return await getattr(conn, method)(sql, *args)

    async def call(self, method: str, sql: str, *args: Any) -> Any:
        """Run a statement of a sink that keeps tables of its own (the endpoints sink), on
        this pool, with its connection handling; ``sql`` is rendered for the schema."""
        return await self._call(method, queries.render_ops(sql, self.schema), *args)

    # --- start-up checks and upkeep (relay/db/checks.py, gauges.py, retention.py) ------------

    async def missing_tables(self) -> list[str]:
        """The outbox tables this relay needs that are not in its schema."""
        return await checks.missing_tables(self._call, self.schema)

    async def missing_privileges(self) -> list[str]:
        """What the relay's role may not do on the endpoint tables (see checks)."""
        return await checks.missing_privileges(self._call, self.schema)

    async def server_encoding(self) -> str:
        return str(await self._call("fetchval", queries.SERVER_ENCODING))

    async def paused(self) -> set[str]:
        return {r[0] for r in await self._call("fetch", self._paused)}

    async def ping(self) -> None:
        await self._call("fetchval", queries.PING)

    async def pending_stats(self) -> dict[str, tuple[int, float]] | None:
        """Pending rows and oldest pending age per destination; None if another relay is
        computing them at this moment."""
        return await self.gauges.pending_stats()

    async def snapshot_holder(self) -> SnapshotHolder | None:
        """The oldest snapshot or transaction holding back VACUUM of this database."""
        async with connection(self.pool) as conn:
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
        return await self.retention.batch(retention, log_retention, batch_size, after)

    # --- the unordered claim (relay/db/claims.py) ---------------------------------------------

    async def claim(self, destination: str, limit: int) -> list[Envelope]:
        """Claim up to ``limit`` rows of an unordered ``destination`` (see queries.CLAIM), its
        fresh rows from where its previous claim ended."""
        return await self.unordered.claim(destination, limit)

    def fresh_cursor(self, destination: str) -> int:
        """Where the next claim of ``destination``'s fresh rows starts (0: no claim yet)."""
        return self.unordered.fresh_cursor(destination)

    async def sweep(self) -> int:
        """Walk again from fresh rows found below the cursors (see UnorderedClaims.sweep);
        returns how many destinations had some."""
        return await self.unordered.sweep()

    # --- outcomes and leases ------------------------------------------------------------------

    async def record(self, records: Sequence[Record]) -> set[tuple[int, int]]:
        """Write outcomes; returns the (id, token) pairs written (the others are no longer
        this relay's under the claim the outcome belongs to). Records a sink already wrote
        are counted as written, not sent again."""
        records = in_id_order(records)
        if any(r.written for r in records):
            done = {(r.id, r.token) for r in records if r.written}
            rest = [r for r in records if not r.written]
            return done | (await self.record(rest) if rest else set())
        if any(r.token < 0 for r in records):
            # Rows of batch leases: their own statement, and the others' after it.
            batch = [r for r in records if r.token < 0]
            rows_ = [r for r in records if r.token >= 0]
            done = await self._write(batch, self.batches.record, self.batches.record_delivered)
            return done | (await self.record(rows_) if rows_ else set())
        return await self._write(records, self._record, self._record_delivered)

    async def _write(
        self, records: Sequence[Record], every: str, delivered_only: str
    ) -> set[tuple[int, int]]:
        """record with ``every`` (queries.RECORD's parameters) or, for a batch of plain
        deliveries, ``delivered_only`` (queries.RECORD_DELIVERED's)."""
        self.statements["record"] += 1
        if all(
            r.status == Status.DELIVERED and r.counted == 1 and r.error is None for r in records
        ):
            self.statements["record_delivered"] += 1  # of the "record" ones
            rows = await self._call(
                "fetch",
                delivered_only,
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
        rows = await self._call("fetch", every, *args)
        return {(r[0], r[1]) for r in rows}

    async def settled(self, leases: Sequence[tuple[int, int]]) -> set[int]:
        """Of (id, token) pairs, the ids recorded as delivered under that claim (rows of
        batch leases never are: only the endpoints sink records in its own statements)."""
        leases = [(i, t) for i, t in leases if t >= 0]
        if not leases:
            return set()
        rows = await self._call(
            "fetch", self._settled, [i for i, _ in leases], [t for _, t in leases]
        )
        return {r[0] for r in rows}

    async def heartbeat(self, leases: Sequence[tuple[int, int]]) -> set[int]:
        """Extend the leases of (id, token) pairs; returns the ids still held. Rows of batch
        leases (negative tokens) are held while their batch is: one row per batch renewed."""
        leases = sorted(leases)  # in id order: see in_id_order
        held: set[int] = set()
        batched = [(i, t) for i, t in leases if t < 0]
        if batched:
            self.statements["heartbeat"] += 1
            tokens = [t for _, t in batched]
            rows = await self._call(
                "fetch", self.batches.heartbeat, tokens, self.relay_id, self.lease
            )
            renewed = {r[0] for r in rows}
            held.update(i for i, t in batched if t in renewed)
            leases = [(i, t) for i, t in leases if t >= 0]
        if leases:
            self.statements["heartbeat"] += 1
            rows = await self._call(
                "fetch",
                self._heartbeat,
                [i for i, _ in leases],
                [t for _, t in leases],
                self.relay_id,
                self.lease,
            )
            held.update(r[0] for r in rows)
        return held

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

    @property
    def batch_leases(self) -> BatchLeases:
        """The reaper's statements for batch leases (relay/db/batches.py)."""
        return BatchLeases(self._call, self.statements, self.batches)

    async def reap_batches(
        self, max_attempts: int, per_destination: dict[str, int], limit: int = 5000
    ) -> list[asyncpg.Record]:
        """End batch leases that expired (see BatchLeases.reap)."""
        return await self.batch_leases.reap(max_attempts, per_destination, limit)

    async def forget_batches(self, keep: float) -> int:
        """Delete ended batch leases older than ``keep`` seconds (see BatchLeases.forget)."""
        return await self.batch_leases.forget(keep)

    async def expired(self, limit: int, never: Sequence[int]) -> list[int]:
        return [r[0] for r in await self._call("fetch", self._expired, limit, list(never))]

    # --- ordered destinations (relay/pipeline/ordered.py; their owner: relay/db/owner.py) ----

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
        safe_id = await self.owner.on_owner(destination, "fetchval", self._fence, self._table, 0)
        self.statements["claim"] += 1
        until = time.monotonic() + self.lease
        rows = await self.owner.on_owner(
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
        return envelopes(rows[:-1], until), rows[-1][2]

    def owns(self, destination: str) -> bool:
        return self.owner.owns(destination)

    async def own(self, destination: str) -> bool:
        """Whether this relay owns ordered ``destination``, taking it if no relay does."""
        return await self.owner.own(destination)

    async def disown(self) -> None:
        """Let go of every ordered destination (see Owner.disown)."""
        await self.owner.disown()

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
        conn = self.owner.holding(destination)
        try:
            # Two statements, in this order: the claim's snapshot must be younger than the
            # fence. On the owner's connection: the lock is held while the claim commits.
            safe_id = await self.owner.fence(conn, lane)
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
            await self.owner.failed(exc)
            raise
        if any(r[0] == -4 for r in rows):
            return [], None
        claimed = [r for r in rows if r[0] > 0]
        more = absorb(lane, rows, claimed, limit, reading, safe_id)
        return envelopes(claimed, until), more

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

    async def blocked_keys(self, blocking: Sequence[str]) -> list[asyncpg.Record]:
        return list(await self._call("fetch", self._blocked_keys, list(blocking)))

    async def release(self, leases: Sequence[tuple[int, int]]) -> None:
        """Put (id, token) pairs back to pending, unattempted."""
        leases = sorted(leases)  # in id order: see in_id_order
        for sql, pairs in (
            (self.batches.release, [(i, t) for i, t in leases if t < 0]),
            (self._release, [(i, t) for i, t in leases if t >= 0]),
        ):
            if pairs:
                await self._call(
                    "execute", sql, self.relay_id, [i for i, _ in pairs], [t for _, t in pairs]
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
            bool(self.unordered.batched),  # 'batch-claims' (see queries.MIXED_CLAIMS)
        )

    async def unregister(self) -> None:
        await self._call("execute", self._unregister, self.relay_id)

    async def forget_relays(self, older_than: float) -> None:
        await self._call("execute", self._forget_relays, older_than)
