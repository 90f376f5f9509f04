"""The operations on the webhook endpoints registered at runtime (`outbox-relay endpoints`):
add, list, show, update, disable, enable, rotate a secret, delete, and re-encrypt every secret
under a new key; each change in one transaction (re-encryption: one per batch).

They take an asyncpg connection, as the other operations do, but do their work through the
library's own calls (outbox.endpoints): its URL, address and DNS checks, its secret
encryption and its rules for what a change may be are the application's, and are not written
twice. Those calls take a SQLAlchemy connection only, so the library is called through one
made over the same asyncpg connection (:func:`sqlalchemy_on`): no second connection, the session
settings and the transaction are the caller's connection's. SQLAlchemy's dialect sets its own
JSON codecs on that connection, harmless to these statements; give these operations a
connection of their own (the commands' with_db does). SQLAlchemy and outbox.endpoints are
imported when an operation runs, not with this module: listing the commands stays fast.

The library's refusals (a wrong URL, no such endpoint, a secret key problem) become AdminError
with its words, as do missing endpoint tables; other database errors come out as the
driver's, as they do from the other operations."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg

from outbox.errors import OutboxError
from relay.ops import endpoint_queries
from relay.ops.common import AdminError, Result, from_record, seconds, sql

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

    from outbox.endpoints import Endpoint, Endpoints, Reencrypted

T = TypeVar("T")
Action = Callable[["Endpoints", "AsyncConnection"], Awaitable[T]]

RECENT_ATTEMPTS = 10
DELIVERY_STATUSES = ("pending", "running", "delivered", "failed", "cancelled")
REENCRYPT_BATCH = 500


@dataclass(frozen=True)
class Registration:
    """What `add` registers: the keywords of outbox.endpoints' ``create``. The URL must
    resolve (``check_dns``) to public addresses only, unless ``allow_private_networks``."""

    destination: str
    url: str
    tenant: str | None = None
    event_types: tuple[str, ...] = ()
    rate_limit: int | None = None
    description: str = ""
    secret: str | None = None
    allow_private_networks: bool = False
    check_dns: bool = True


# --- results ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Changed(Result):
    """An endpoint as a call left it (with its secret if the call returns it);
    ``unencrypted``: the secret it stored is stored unencrypted, for want of a key here."""

    endpoint: Endpoint
    unencrypted: bool = False

    def to_json(self) -> dict[str, Any]:
        return self.endpoint.as_dict()


@dataclass(frozen=True)
class Listed(Result):
    endpoints: list[Endpoint]

    def to_json(self) -> dict[str, Any]:
        return {"endpoints": [ep.as_dict() for ep in self.endpoints]}


@dataclass(frozen=True)
class Deliveries(Result):
    """An endpoint's deliveries by status, and the last outcome of the newest one tried."""

    pending: int
    running: int
    delivered: int
    failed: int
    cancelled: int
    oldest_pending_age_s: float | None
    last_status: int | None
    last_error: str | None

    @property
    def unfinished(self) -> int:
        return self.pending + self.running


@dataclass(frozen=True)
class Attempt(Result):
    at: str
    event_id: int
    http_status: int | None
    duration_ms: float | None
    error: str | None


@dataclass(frozen=True)
class Shown(Result):
    """An endpoint, its deliveries, and its newest attempts, newest first."""

    endpoint: Endpoint
    deliveries: Deliveries
    recent_attempts: list[Attempt]

    def to_json(self) -> dict[str, Any]:
        return {
            **self.endpoint.as_dict(),
            "deliveries": self.deliveries.to_json(),
            "recent_attempts": [a.to_json() for a in self.recent_attempts],
        }


@dataclass(frozen=True)
class Deleted(Result):
    id: int
    deleted: bool
    cancelled: int  # its unfinished deliveries, now cancelled


@dataclass(frozen=True)
class Reencryption(Result):
    """What re-encryption did, in secrets; ``endpoints``: those its last pass read.
    ``unreadable``: the endpoints whose secret no key opens, left as they are."""

    endpoints: int
    encrypted: int
    rewritten: int
    expired_cleared: int
    unreadable: list[int]


# --- the operations ---------------------------------------------------------------------------


async def add(conn: asyncpg.Connection, schema: str, new: Registration) -> Changed:
    """Register an endpoint; it carries its secret (generated unless given)."""
    return await _change(conn, schema, lambda e, c: e.create(c, **asdict(new)))


async def list_endpoints(
    conn: asyncpg.Connection, schema: str, *, destination: str | None, tenant: str | None
) -> Listed:
    """The endpoints (never their secrets), of ``destination`` and of ``tenant`` if given."""
    listing = _in_transaction(lambda e, c: e.list(c, destination=destination, tenant=tenant))
    found, _ = await library(conn, schema, listing)
    return Listed(found)


async def show(
    conn: asyncpg.Connection, schema: str, endpoint_id: int, *, show_secret: bool = False
) -> Shown:
    """The endpoint, its deliveries by status and its newest attempts, read in one
    transaction."""

    async def read(e: Endpoints, c: AsyncConnection) -> Shown:
        ep = await e.get(c, endpoint_id, show_secret=show_secret)
        # The same connection, in the same transaction, as the library's statement.
        return await _activity(conn, schema, ep)

    shown, _ = await library(conn, schema, _in_transaction(read))
    return shown


async def update(
    conn: asyncpg.Connection,
    schema: str,
    endpoint_id: int,
    changes: dict[str, Any],
    *,
    allow_private_networks: bool,
    check_dns: bool,
) -> Changed:
    """Change what ``changes`` names (the keywords of outbox.endpoints' ``update``)."""
    return await _change(
        conn,
        schema,
        lambda e, c: e.update(
            c,
            endpoint_id,
            **changes,
            allow_private_networks=allow_private_networks,
            check_dns=check_dns,
        ),
    )


async def disable(
    conn: asyncpg.Connection, schema: str, endpoint_id: int, *, reason: str | None
) -> Changed:
    return await _change(conn, schema, lambda e, c: e.disable(c, endpoint_id, reason=reason))


async def enable(conn: asyncpg.Connection, schema: str, endpoint_id: int) -> Changed:
    return await _change(conn, schema, lambda e, c: e.enable(c, endpoint_id))


async def rotate_secret(
    conn: asyncpg.Connection,
    schema: str,
    endpoint_id: int,
    *,
    keep_previous: timedelta,
    secret: str | None,
) -> Changed:
    """A new secret (generated unless given); the previous one still signs for
    ``keep_previous``."""
    return await _change(
        conn,
        schema,
        lambda e, c: e.rotate_secret(c, endpoint_id, keep_previous=keep_previous, secret=secret),
    )


async def delete(conn: asyncpg.Connection, schema: str, endpoint_id: int) -> Deleted:
    """Delete the endpoint; its unfinished deliveries end as cancelled."""
    cancelled, _ = await library(
        conn, schema, _in_transaction(lambda e, c: e.delete(c, endpoint_id))
    )
    return Deleted(id=endpoint_id, deleted=True, cancelled=cancelled)


async def reencrypt(
    conn: asyncpg.Connection, schema: str, *, batch_size: int = REENCRYPT_BATCH
) -> Reencryption:
    """Every secret and previous secret re-encrypted under the first key, a batch per
    transaction; previous secrets past their window cleared."""
    passes, _ = await library(conn, schema, lambda e, c: _reencrypt_passes(e, c, batch_size))
    done = [b for p in passes for b in p]
    # Each change is made once (then it is under the first key), so they add up over passes;
    # the endpoints are those the last pass read.
    return Reencryption(
        endpoints=sum(b.endpoints for b in passes[-1]),
        encrypted=sum(b.encrypted for b in done),
        rewritten=sum(b.rewritten for b in done),
        expired_cleared=sum(b.expired for b in done),
        unreadable=list(dict.fromkeys(i for b in passes[-1] for i in b.unreadable)),
    )


# --- how they run -----------------------------------------------------------------------------


async def _activity(conn: asyncpg.Connection, schema: str, ep: Endpoint) -> Shown:
    """``ep`` with its deliveries by status and its newest attempts."""
    d = await conn.fetchrow(sql(endpoint_queries.ENDPOINT_DELIVERIES, schema), ep.id)
    assert d is not None  # an aggregate: always a row
    attempts = await conn.fetch(
        sql(endpoint_queries.ENDPOINT_RECENT_ATTEMPTS, schema), ep.id, RECENT_ATTEMPTS
    )
    return Shown(
        endpoint=ep,
        deliveries=from_record(
            Deliveries, d, oldest_pending_age_s=seconds(d["oldest_pending_age"])
        ),
        recent_attempts=[
            from_record(
                Attempt,
                a,
                duration_ms=round(a["duration_ms"], 1) if a["duration_ms"] is not None else None,
            )
            for a in attempts
        ],
    )


async def _change(conn: asyncpg.Connection, schema: str, action: Action[Endpoint]) -> Changed:
    ep, unencrypted = await library(conn, schema, _in_transaction(action))
    return Changed(ep, unencrypted)


def _in_transaction(action: Action[T]) -> Action[T]:
    async def once(e: Endpoints, c: AsyncConnection) -> T:
        async with c.begin():
            return await action(e, c)

    return once


async def library(conn: asyncpg.Connection, schema: str, work: Action[T]) -> tuple[T, bool]:
    """``work`` on the schema's endpoints (outbox.endpoints) over a SQLAlchemy connection on
    ``conn``, and whether it stored a secret unencrypted: said by the caller once committed
    (the command line says it on stderr, rather than as the library's log event)."""
    from sqlalchemy.exc import DBAPIError

    endpoints, unencrypted = _recording(schema)
    try:
        async with sqlalchemy_on(conn) as sa:
            result = await work(endpoints, sa)
    except OutboxError as exc:  # EndpointNotFound, OutboxValidationError, a secret key problem
        raise AdminError(str(exc)) from exc
    except DBAPIError as exc:
        # SQLAlchemy's wording adds the SQL; the driver's own error is what the others show.
        orig = exc.orig or exc
        cause = orig.__cause__ or orig
        if isinstance(cause, asyncpg.UndefinedTableError):
            raise _missing_tables(schema, cause) from exc
        if isinstance(cause, asyncpg.PostgresError | asyncpg.InterfaceError | OSError):
            raise cause from None
        # Any other: the driver's words, not SQLAlchemy's (which carry the statement).
        raise asyncpg.InterfaceError(str(cause)) from None
    except asyncpg.UndefinedTableError as exc:  # the statements run on ``conn`` itself
        raise _missing_tables(schema, exc) from exc
    return result, bool(unencrypted)


def _missing_tables(schema: str, exc: asyncpg.UndefinedTableError) -> AdminError:
    return AdminError(
        f"the endpoint tables are missing from schema {schema!r} ({exc}): run "
        "`outbox-relay migrate` (with the same --database-url and --schema)"
    )


def _recording(schema: str) -> tuple[Endpoints, list[int]]:
    """The schema's endpoints, and the ids of those whose new secret they store unencrypted
    (no key here), filled in as they do."""
    from outbox.endpoints import Endpoints

    unencrypted: list[int] = []

    class Recording(Endpoints):
        def _unencrypted(self, ep: Endpoint) -> None:
            unencrypted.append(ep.id)

    return Recording(schema), unencrypted


@asynccontextmanager
async def sqlalchemy_on(conn: asyncpg.Connection) -> AsyncIterator[AsyncConnection]:
    """A SQLAlchemy connection over ``conn``: the library takes nothing else. Its pool holds
    ``conn`` alone and never closes it (the caller does), and its statements' errors name no
    parameter (a secret is one)."""
    from sqlalchemy.ext.asyncio import create_async_engine
    from sqlalchemy.pool import StaticPool

    async def same() -> asyncpg.Connection:
        return conn

    engine = create_async_engine(
        "postgresql+asyncpg://", async_creator=same, poolclass=StaticPool, hide_parameters=True
    )
    try:
        async with engine.connect() as sa:
            yield sa
    finally:
        # SQLAlchemy's dialect decodes json and jsonb on the connection it is given: the
        # caller's connection goes back as it came (strings), whatever it is used for next.
        if not conn.is_closed():
            for name in ("json", "jsonb"):
                await conn.reset_type_codec(name, schema="pg_catalog")


async def _reencrypt_passes(
    endpoints: Endpoints, sa: AsyncConnection, batch_size: int
) -> list[list[Reencrypted]]:
    """Passes over the endpoints, each batch in a transaction of its own. A second pass only
    if the first encrypted secrets that were unencrypted: until its first batch committed, a
    writer without the key could still add one, and it may have done so behind the pass."""
    passes: list[list[Reencrypted]] = []
    while len(passes) < 2:
        batches: list[Reencrypted] = []
        after = 0
        while True:
            async with sa.begin():
                batch = await endpoints.reencrypt(sa, after_id=after, limit=batch_size)
            batches.append(batch)
            if batch.last_id is None or batch.endpoints < batch_size:
                break
            after = batch.last_id
        passes.append(batches)
        if not any(b.encrypted for b in batches):
            break
    return passes
