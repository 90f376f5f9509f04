"""Every relay serving a destination must claim it the same way (relay.claims,
docs/deploying.md): a relay claiming by row takes the fresh rows in flight in another's batch
leases again, and they are delivered twice. Each relay registers how it claims (the
'batch-claims' feature of outbox_relays); one that finds a relay running that serves one of
its destinations the other way refuses to start, and a running one says so in its log."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import asyncpg
import structlog

from relay.config import Settings
from relay.db import queries
from relay.db.pool import dedicated
from relay.db.store import Store

log = structlog.get_logger("relay")

# How recently another relay must have registered to count as running: relays register every
# min(lease / 3, 10 s) of their own lease (relay/app.py), so this relay's lease, when shorter
# than another's interval, would miss it (as relay/pipeline/ordered.py's PEERS_SEEN_WITHIN).
SEEN_WITHIN = 30.0


class NoTurn(Exception):
    """Another session held the turn to start for longer than this relay would wait."""


@contextlib.asynccontextmanager
async def one_at_a_time(pool: asyncpg.Pool, schema: str, wait: float) -> AsyncIterator[None]:
    """Held while a relay starting reads how the relays running claim (settle_claims,
    mixed_claims) and registers how it will: otherwise two relays starting at once each read
    the registry before the other has registered, and may settle on different ways (a
    rolling update stops the last relay claiming by row as it starts new ones: one "auto"
    relay settled on row, the other on batch leases) or both pass the check of ways set in
    their configuration; their rows are then delivered twice. A connection of its own, so
    that a relay whose pool has one connection can register meanwhile; closing it ends the
    lock, as a relay that dies does. Made as the pool's are, with keepalives (pool.dedicated):
    a holder whose host froze would otherwise keep the turn for the kernel's two hours.
    Waits ``wait`` seconds at most, then raises :class:`NoTurn` naming the holder: a relay
    that hangs while starting must not keep every other from starting, without a word."""
    conn = await dedicated(pool)
    try:
        await conn.execute("BEGIN")
        try:
            await conn.execute(queries.SETTLING_LOCK, schema, timeout=wait)
        except TimeoutError:
            holder = await pool.fetchval(queries.SETTLING_HOLDER, schema)
            raise NoTurn(holder or "since ended") from None
        yield
    finally:
        await conn.close()


def batchable(settings: Settings) -> frozenset[str]:
    """The destinations relay.claims = "batch" claims under batch leases: the unordered ones
    whose sink does not record outcomes in its own statements (the endpoints sink's fan-out
    does)."""
    return frozenset(
        name
        for name, d in settings.destinations.items()
        if d.ordering == "none" and d.kind != "endpoints"
    )


async def running_other_way(store: Store, settings: Settings, batch: bool) -> list[asyncpg.Record]:
    """The other relays running (seen within SEEN_WITHIN or a lease, not stopped) that claim
    one of this relay's batchable destinations by row (``batch``: as if this relay claimed
    under batch leases) or under batch leases (not ``batch``)."""
    return list(
        await store.batch_leases.mixed_claims(
            store.relay_id,
            batchable(settings),
            batch,
            max(settings.relay.lease, SEEN_WITHIN),
        )
    )


async def row_relays(store: Store, settings: Settings) -> list[str]:
    """The other relays running that claim one of this relay's batchable destinations by row:
    "<relay> (host <host>): <destinations>"."""
    found = await running_other_way(store, settings, True)
    return [f"{r['relay_id']} (host {r['host']}): {', '.join(r['destinations'])}" for r in found]


async def mixed_claims(store: Store, settings: Settings) -> list[str]:
    """What to tell of each other relay running that claims one of this relay's batchable
    destinations the other way: the relay, its host, the destinations, and what to do."""
    mine = "batch" if store.unordered.batched else "row"
    theirs = "row" if mine == "batch" else "batch"
    found = await running_other_way(store, settings, mine == "batch")
    if settings.relay.claims == "auto":
        what = (
            'and start them all again: with relay.claims = "auto" (this relay\'s) they settle '
            f'on one way. This relay settled on "{mine}" because a relay running claims some '
            "of its destinations so"
        )
    else:
        what = f'and start them all with one setting, or set relay.claims = "{theirs}" here'
    return [
        f"relay {r['relay_id']!r} (host {r['host']}) claims {', '.join(r['destinations'])} "
        f'with relay.claims = "{theirs}", and this relay claims '
        f'{"them" if len(r["destinations"]) > 1 else "it"} with relay.claims = "{mine}": a '
        "relay claiming by row would take the rows in flight in the other's batch leases "
        "again, and deliver them twice. Every relay serving a destination must claim it the "
        "same way: stop the relays of these destinations (a clean stop releases what they "
        f"hold) {what}"
        for r in found
    ]


class MixedClaims:
    """At each registration, the relays running that claim this relay's destinations the
    other way, in the log once each (relay.claims.mixed), as long as they do: two relays that
    start at once both pass the start-up check, and a relay of an earlier release checks
    nothing."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._told: frozenset[str] = frozenset()

    async def __call__(self, store: Store) -> None:
        found = frozenset(await mixed_claims(store, self.settings))
        for problem in sorted(found - self._told):
            log.error("relay.claims.mixed", error=problem)
        self._told = found
