"""Start-up: connect to the database, waiting out what a restart or failover looks like, and
refusing at once, with what to do, what waiting cannot change."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import asyncpg
import structlog

from outbox.errors import describe
from outbox.migrate import not_utf8
from relay.config import Settings
from relay.db.store import DB_ERRORS, Store, create_pool, is_plain_sql_error
from relay.runtime.claim_modes import NoTurn, batchable, mixed_claims, one_at_a_time, row_relays

log = structlog.get_logger("relay")


class RelayStartupError(Exception):
    """The relay cannot start; the message says what to do."""


# Answers to the start-up statements that waiting will not change. Anything else (the database
# starting up or shutting down, out of connections, unreachable) is waited out for
# relay.startup_timeout. (A read-only database is waited out: a failover makes one for a
# moment.)
REFUSED_AT_STARTUP: tuple[type[BaseException], ...] = (
    asyncpg.InsufficientPrivilegeError,
    asyncpg.QueryCanceledError,
    asyncpg.InvalidCatalogNameError,
    asyncpg.InvalidAuthorizationSpecificationError,
)


Prepare = Callable[[Store], Awaitable[None]]


async def open_store(settings: Settings, relay_id: str, prepare: Prepare) -> Store:
    """A store on a checked database (UTF8, the outbox tables up to date), then handed to
    ``prepare`` (the relay reads what is paused and registers before its first claim). Retries for
    ``relay.startup_timeout`` what may pass; raises :class:`RelayStartupError` otherwise."""
    rs = settings.relay
    deadline = time.monotonic() + rs.startup_timeout
    delay = 0.5
    while True:
        try:
            return await _open(settings, relay_id, prepare, deadline)
        except DB_ERRORS as exc:
            if isinstance(exc, REFUSED_AT_STARTUP):
                # The server answered, and said no: waiting will not change it.
                raise RelayStartupError(refused_at_startup(exc)) from exc
            if time.monotonic() + delay > deadline:
                if isinstance(exc, asyncpg.PostgresError) and is_plain_sql_error(exc):
                    raise RelayStartupError(
                        f"{refused_at_startup(exc)} (still so after {rs.startup_timeout:.0f}s)"
                    ) from exc
                raise RelayStartupError(
                    f"cannot reach the database after {rs.startup_timeout:.0f}s: "
                    f"{describe(exc)}. Check database_url / "
                    "OUTBOX_DATABASE_URL and that PostgreSQL is up."
                ) from exc
            log.warning("relay.database.unavailable", error=describe(exc), retry_in=round(delay, 1))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)


# The least a relay waits for its turn to start (see one_at_a_time), whatever is left of
# relay.startup_timeout: each turn is a few statements, so relays started together wait a
# moment for each other even when told not to wait out an unreachable database.
TURN_WAIT_AT_LEAST = 5.0


async def _open(settings: Settings, relay_id: str, prepare: Prepare, deadline: float) -> Store:
    rs = settings.relay
    pool = await create_pool(
        settings.dsn, relay_id, rs.pool_size, command_timeout=max(2 * rs.lease, 60.0)
    )
    try:
        store = Store(
            pool,
            rs.db_schema,
            relay_id,
            rs.lease,
            delete_delivered=rs.retention == 0,
            batched=batched(settings),
        )
        encoding = await store.server_encoding()
        if encoding != "UTF8":
            raise RelayStartupError(not_utf8(encoding))
        missing = await store.missing_tables()
        if missing:
            raise RelayStartupError(
                f"the outbox tables in schema {rs.db_schema!r} are missing or not up to date "
                f"(no {', '.join(missing)}): run `outbox-relay migrate` first"
            )
        lacking = await store.missing_privileges()
        if lacking:
            raise RelayStartupError(
                f"the relay's role lacks {', '.join(lacking)}: run deploy/sql/relay_role.sql "
                "again (it grants what each migration added; retention reads these tables "
                "for every destination)"
            )
        wait = max(deadline - time.monotonic(), TURN_WAIT_AT_LEAST)
        try:
            async with one_at_a_time(pool, rs.db_schema, wait):
                if rs.claims == "auto":
                    await settle_claims(store, settings)
                mixed = await mixed_claims(store, settings)
                if mixed:
                    raise RelayStartupError(mixed[0])
                await prepare(store)
        except NoTurn as exc:
            raise RelayStartupError(
                f"another session has held the turn to start in schema {rs.db_schema!r} for "
                f"{wait:.0f}s ({exc}): relays starting take turns to settle how they claim and "
                "to register, a few statements each. A relay that hangs while starting holds "
                "it (see its log); stop it, or end the session with pg_terminate_backend(pid)"
            ) from None
    except BaseException:
        await pool.close()
        raise
    return store


def batched(settings: Settings) -> frozenset[str]:
    """The destinations whose fresh rows are claimed under batch leases (relay.claims =
    "batch", or "auto" until settle_claims says otherwise): the unordered ones whose sink does
    not record outcomes in its own statements (the endpoints sink's fan-out does)."""
    if settings.relay.claims == "row":
        return frozenset()
    return batchable(settings)


async def settle_claims(store: Store, settings: Settings) -> None:
    """relay.claims = "auto": batch leases, unless relays running now claim some of this
    relay's destinations by row (relays of an earlier release, or of this one that settled
    on row when they started): then by row, as they do, for as long as this relay runs. Two
    ways on one destination would deliver rows twice; a relay never changes its way while
    it runs, since its batches in flight would be claimed again."""
    by_row = await row_relays(store, settings)
    if by_row:
        store.unordered.batched = frozenset()
        log.warning(
            "relay.claims.auto",
            claims="row",
            relays=by_row,
            action="claiming by row as the running relays listed do; to claim under batch "
            "leases (half the dead row versions under a held snapshot), stop every relay of "
            "these destinations once and start them again: with none running, they start "
            "with batch leases",
        )
    else:
        log.info("relay.claims.auto", claims="batch" if store.unordered.batched else "row")


def refused_at_startup(exc: BaseException) -> str:
    """What to tell an operator whose database refused the relay's start-up statements."""
    what = f"the database refused the relay's start-up statements: {describe(exc)}."
    if isinstance(exc, asyncpg.InsufficientPrivilegeError):
        return (
            f"{what} The relay's role needs SELECT on outbox_paused and SELECT, INSERT, UPDATE, "
            "DELETE on outbox and outbox_relays, and what deploy/sql/relay_role.sql grants on "
            "the endpoint tables (run it again after migrating)"
        )
    if isinstance(exc, asyncpg.QueryCanceledError):
        return (
            f"{what} A statement_timeout set for the relay's role or database is too short "
            "for them; raise it or unset it for the relay's role"
        )
    if isinstance(exc, asyncpg.LockNotAvailableError):
        return (
            f"{what} A lock_timeout set for the relay's role or database ran out: another "
            "session holds a lock on the outbox tables (see pg_locks), or the timeout is short"
        )
    if isinstance(exc, asyncpg.ReadOnlySQLTransactionError):
        return f"{what} The database (or the relay's role) is read-only; the relay must write"
    if isinstance(exc, asyncpg.InvalidCatalogNameError):
        return f"{what} The database in database_url does not exist"
    if isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError):
        return f"{what} Check the user and password in database_url"
    return f"{what} Check the database's logs and the relay's role"
