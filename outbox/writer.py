"""Adding events to the caller's open transaction.

Nothing here commits or opens a transaction: the event is part of the caller's unit of work,
so it exists exactly when their business change does.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypedDict

from sqlalchemy import TextClause, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from outbox import queries, tracing
from outbox.errors import OutboxError, OutboxValidationError
from outbox.message import DEFAULT_MAX_PAYLOAD_BYTES, NewMessage, Payload, build_message

try:  # asyncpg is a dependency, but keep the import failure readable if it is stripped out
    import asyncpg
except ImportError:  # pragma: no cover
    asyncpg = None

if TYPE_CHECKING:
    import psycopg

    # psycopg is optional: it is imported here for type checkers only, and at run time
    # never (a psycopg connection passed in means psycopg is loaded already).
    AsyncTarget: TypeAlias = (
        AsyncSession | AsyncConnection | psycopg.AsyncConnection[Any] | Any  # Any: asyncpg's
    )
    SyncTarget: TypeAlias = Session | Connection | psycopg.Connection[Any]
else:
    AsyncTarget = AsyncSession | AsyncConnection | Any
    SyncTarget = Session | Connection


class EventSpec(TypedDict, total=False):
    """One event for ``enqueue_many``: the same keywords as ``enqueue``."""

    destination: str
    payload: Payload
    key: str | None
    headers: Mapping[str, str] | None
    run_after: datetime | None
    content_type: str | None
    event_type: str | None
    tenant: str | None


class EventCheck(Protocol):
    """What ``Outbox(catalog=...)`` takes: ``outbox.catalog.Catalog`` is one. Named by its
    method only, so that enqueuing without a catalog never loads the catalog's modules (nor
    its validator): pyproject.toml's import rules hold writer.py to that."""

    def check(self, message: NewMessage, payload: Payload) -> None:
        """Raise an ``OutboxValidationError`` to refuse ``message`` (built from ``payload``)."""


class Outbox:
    """An outbox in one schema. The module-level functions use ``Outbox()`` (schema public).

    ``max_payload_bytes`` refuses events that the broker or endpoint would refuse later.
    ``catalog`` checks each typed event against its declared type before any SQL
    (``outbox.catalog.use`` sets it for the module-level functions).
    """

    def __init__(
        self,
        schema: str = "public",
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        catalog: EventCheck | None = None,
    ) -> None:
        if max_payload_bytes <= 0:
            raise ValueError("max_payload_bytes must be positive")
        queries.check_schema(schema)
        self.schema = schema
        self.max_payload_bytes = max_payload_bytes
        self.catalog = catalog
        table = queries.qualified_table(schema)
        # (unlabelled, labelled): events without event_type and tenant use statements that
        # name only the columns every migrated outbox has (see queries.ENQUEUE_LABELLED_SA).
        self._one_sa = (
            text(queries.render(queries.ENQUEUE_SA, table)),
            text(queries.render(queries.ENQUEUE_LABELLED_SA, table)),
        )
        self._many_sa = (
            text(queries.render(queries.ENQUEUE_MANY_SA, table)),
            text(queries.render(queries.ENQUEUE_MANY_LABELLED_SA, table)),
        )
        self._one_pg = (
            queries.render(queries.ENQUEUE_PG, table),
            queries.render(queries.ENQUEUE_LABELLED_PG, table),
        )
        self._many_pg = (
            queries.render(queries.ENQUEUE_MANY_PG, table),
            queries.render(queries.ENQUEUE_MANY_LABELLED_PG, table),
        )
        self._one_psycopg = (
            queries.render(queries.ENQUEUE_PSYCOPG, table),
            queries.render(queries.ENQUEUE_LABELLED_PSYCOPG, table),
        )
        self._many_psycopg = (
            queries.render(queries.ENQUEUE_MANY_PSYCOPG, table),
            queries.render(queries.ENQUEUE_MANY_LABELLED_PSYCOPG, table),
        )

    # --- building rows -------------------------------------------------------------------

    def _message(
        self,
        destination: str,
        payload: Payload,
        key: str | None,
        headers: Mapping[str, str] | None,
        run_after: datetime | None,
        content_type: str | None,
        trace: Mapping[str, str] | None = None,
        event_type: str | None = None,
        tenant: str | None = None,
    ) -> NewMessage:
        if trace and (headers is None or isinstance(headers, Mapping)):
            headers = tracing.with_trace_headers(headers, trace)
        m = build_message(
            destination=destination,
            payload=payload,
            key=key,
            headers=headers,
            run_after=run_after,
            content_type=content_type,
            event_type=event_type,
            tenant=tenant,
            max_payload_bytes=self.max_payload_bytes,
        )
        # After build_message (its refusals keep their wording, and the row is storable) and
        # before any SQL: a refusal here leaves the caller's transaction as it was.
        if self.catalog is not None:
            self.catalog.check(m, payload)
        return m

    def _messages(self, events: Iterable[EventSpec]) -> list[NewMessage]:
        out = []
        trace = tracing.current_trace_headers()  # once per call: the same span for every event
        for i, ev in enumerate(events):
            try:
                out.append(self._message(**_spec_kwargs(ev), trace=trace))
            except OutboxValidationError as exc:
                raise exc.at(f"events[{i}]") from exc
        return out

    def _one(
        self,
        destination: str,
        payload: Payload,
        key: str | None,
        headers: Mapping[str, str] | None,
        run_after: datetime | None,
        content_type: str | None,
        event_type: str | None,
        tenant: str | None,
    ) -> _Statement:
        m = self._message(
            destination,
            payload,
            key,
            headers,
            run_after,
            content_type,
            tracing.current_trace_headers(),
            event_type,
            tenant,
        )
        args: tuple[Any, ...] = (
            m.destination,
            m.key,
            m.payload,
            m.content_type,
            m.headers_json,
            m.run_after,
        )
        labelled = m.event_type is not None or m.tenant is not None
        if labelled:
            args += (m.event_type, m.tenant)
        return _Statement(
            self._one_sa[labelled],
            dict(zip(_ONE_BINDS, args, strict=False)),
            self._one_pg[labelled],
            args,
            self._one_psycopg[labelled],
        )

    def _many(self, events: Iterable[EventSpec]) -> _Statement | None:
        ms = self._messages(events)
        if not ms:
            return None
        columns: tuple[list[Any], ...] = (
            [m.destination for m in ms],
            [m.key for m in ms],
            [m.payload for m in ms],
            [m.content_type for m in ms],
            [m.headers_json for m in ms],
            [m.run_after for m in ms],
        )
        labelled = any(m.event_type is not None or m.tenant is not None for m in ms)
        if labelled:
            columns += ([m.event_type for m in ms], [m.tenant for m in ms])
        binds = dict(zip(_MANY_BINDS, columns, strict=False))
        return _Statement(
            self._many_sa[labelled],
            binds,
            self._many_pg[labelled],
            columns,
            self._many_psycopg[labelled],
        )

    # The public methods spell their keywords out (and twice, async and sync) so that type
    # checkers and editors show each one; the work is done once, by _one/_many and _run.

    # --- async -----------------------------------------------------------------------------

    async def enqueue(
        self,
        conn: AsyncTarget,
        *,
        destination: str,
        payload: Payload,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        run_after: datetime | None = None,
        content_type: str | None = None,
        event_type: str | None = None,
        tenant: str | None = None,
    ) -> int:
        """Add one event to ``conn``'s open transaction and return its id.

        ``conn``: a SQLAlchemy ``AsyncSession`` or ``AsyncConnection``, an asyncpg
        ``Connection`` or a psycopg ``AsyncConnection``.

        ``event_type`` and ``tenant`` choose the endpoints of an ``endpoints`` destination."""
        statement = self._one(
            destination, payload, key, headers, run_after, content_type, event_type, tenant
        )
        [row_id] = await _run(conn, statement)
        return row_id

    async def enqueue_many(self, conn: AsyncTarget, events: Iterable[EventSpec]) -> list[int]:
        """Add many events in one statement; returns their ids in input order."""
        statement = self._many(events)
        return await _run(conn, statement) if statement is not None else []

    # --- sync ------------------------------------------------------------------------------

    def enqueue_sync(
        self,
        conn: SyncTarget,
        *,
        destination: str,
        payload: Payload,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        run_after: datetime | None = None,
        content_type: str | None = None,
        event_type: str | None = None,
        tenant: str | None = None,
    ) -> int:
        """``enqueue`` for a SQLAlchemy ``Session`` or ``Connection``, or a psycopg
        ``Connection``."""
        statement = self._one(
            destination, payload, key, headers, run_after, content_type, event_type, tenant
        )
        [row_id] = _run_sync(conn, statement)
        return row_id

    def enqueue_many_sync(self, conn: SyncTarget, events: Iterable[EventSpec]) -> list[int]:
        """``enqueue_many`` for a SQLAlchemy ``Session`` or ``Connection``, or a psycopg
        ``Connection``."""
        statement = self._many(events)
        return _run_sync(conn, statement) if statement is not None else []


# The bind names of ENQUEUE_SA and ENQUEUE_MANY_SA, in the order of the asyncpg forms' $n.
_ONE_BINDS = (
    "destination",
    "key",
    "payload",
    "content_type",
    "headers",
    "run_after",
    "event_type",
    "tenant",
)
_MANY_BINDS = (
    "destinations",
    "keys",
    "payloads",
    "content_types",
    "headers",
    "run_afters",
    "event_types",
    "tenants",
)


@dataclass(frozen=True, slots=True)
class _Statement:
    """An insert of one or many events, in each form: SQLAlchemy's (named binds), asyncpg's
    (``$n``) and psycopg's (``%s``, also what Django's cursor takes); the last two bind
    ``args``."""

    sa: TextClause
    binds: dict[str, Any]
    pg: str
    args: tuple[Any, ...]
    psycopg: str


async def _run(conn: AsyncTarget, statement: _Statement) -> list[int]:
    """Run an insert on any async connection we take; the new ids, ascending (input order)."""
    if isinstance(conn, AsyncSession | AsyncConnection):
        await _refuse_async_autocommit(conn)
        result = await conn.execute(statement.sa, statement.binds)
        return sorted(int(i) for i in result.scalars())
    psycopg = _psycopg()
    if psycopg is not None and isinstance(conn, psycopg.AsyncConnection):
        if _pipeline_hides_status(conn, psycopg):
            async with conn.pipeline() as pipeline:
                await pipeline.sync()
        _require_psycopg_transaction(conn, psycopg)
        async with psycopg.AsyncCursor(conn, row_factory=psycopg.rows.tuple_row) as cur:
            await cur.execute(statement.psycopg, statement.args)
            return sorted(int(r[0]) for r in await cur.fetchall())
    if asyncpg is not None and isinstance(conn, asyncpg.Connection):
        _require_asyncpg_transaction(conn)
        rows = await conn.fetch(statement.pg, *statement.args)
        return sorted(int(r[0]) for r in rows)
    raise TypeError(
        "enqueue takes a SQLAlchemy AsyncSession or AsyncConnection, an asyncpg Connection or "
        f"a psycopg AsyncConnection; got {type(conn).__name__} (use enqueue_sync for a sync "
        "Session or psycopg Connection)"
    )


def _run_sync(conn: SyncTarget, statement: _Statement) -> list[int]:
    if isinstance(conn, Session | Connection):
        _refuse_autocommit(conn.connection() if isinstance(conn, Session) else conn)
        result = conn.execute(statement.sa, statement.binds)
        return sorted(int(i) for i in result.scalars())
    psycopg = _psycopg()
    if psycopg is not None and isinstance(conn, psycopg.Connection):
        if _pipeline_hides_status(conn, psycopg):
            with conn.pipeline() as pipeline:
                pipeline.sync()
        _require_psycopg_transaction(conn, psycopg)
        with psycopg.Cursor(conn, row_factory=psycopg.rows.tuple_row) as cur:
            cur.execute(statement.psycopg, statement.args)
            return sorted(int(r[0]) for r in cur.fetchall())
    raise TypeError(
        "enqueue_sync takes a SQLAlchemy Session or Connection, or a psycopg Connection; "
        f"got {type(conn).__name__} (use `await enqueue(...)` for async connections)"
    )


def _psycopg() -> ModuleType | None:
    """psycopg 3 if the application loaded it (it made the connection it passes), else None:
    the outbox does not depend on psycopg, and never imports it itself."""
    return sys.modules.get("psycopg")


_SPEC_KEYS = frozenset(EventSpec.__annotations__)


def _spec_kwargs(ev: EventSpec) -> dict[str, Any]:
    if not isinstance(ev, Mapping):
        raise TypeError(f"each event must be a mapping of enqueue keywords, got {type(ev)!r}")
    unknown = set(ev) - _SPEC_KEYS
    if unknown:
        raise TypeError(f"unknown event keys {sorted(unknown)}; expected {sorted(_SPEC_KEYS)}")
    kw: dict[str, Any] = dict.fromkeys(
        ("key", "headers", "run_after", "content_type", "event_type", "tenant"), None
    )
    kw.update(ev)
    if "destination" not in ev or "payload" not in ev:
        raise TypeError("each event needs 'destination' and 'payload'")
    return kw


def _require_asyncpg_transaction(conn: Any) -> None:
    if not conn.is_in_transaction():
        raise OutboxError(
            "enqueue must run inside the transaction of the business change: wrap it in "
            "`async with conn.transaction():` so the event commits or rolls back with it"
        )


def _pipeline_hides_status(conn: Any, psycopg: Any) -> bool:
    """In pipeline mode, statements still queued leave the status ACTIVE, inside a transaction
    block or not; a sync of the pipeline tells (enqueue's own fetch would sync it anyway)."""
    return bool(
        conn.autocommit
        and conn.info.pipeline_status
        and conn.info.transaction_status == psycopg.pq.TransactionStatus.ACTIVE
    )


def _require_psycopg_transaction(conn: Any, psycopg: Any) -> None:
    """A psycopg connection not in autocommit is always in a transaction: its first statement
    opens one, which lasts until ``commit()``. One in autocommit is in a transaction only
    inside ``with conn.transaction():`` (INTRANS; INERROR is left to the driver to refuse);
    outside (IDLE, or ACTIVE: another thread's statement), each statement commits at once."""
    status = psycopg.pq.TransactionStatus
    if conn.autocommit and conn.info.transaction_status in (status.IDLE, status.ACTIVE):
        raise OutboxError(
            "enqueue must run inside the transaction of the business change, but this "
            "psycopg connection is in autocommit mode outside a transaction: the event would "
            "commit alone. Wrap it in `with conn.transaction():` (`async with` for an "
            "AsyncConnection) so the event commits or rolls back with it"
        )


async def _refuse_async_autocommit(conn: AsyncSession | AsyncConnection) -> None:
    if isinstance(conn, AsyncSession):
        conn = await conn.connection()
    _refuse_autocommit(conn.sync_connection)


def _refuse_autocommit(conn: Connection | None) -> None:
    """In AUTOCOMMIT every statement commits at once: the event would commit alone, even if
    the caller's "transaction" then rolls back. Checked on the driver's own connection, which
    tells whatever set it (execution options, the engine, the driver)."""
    if conn is None:
        return
    driver = conn.connection.dbapi_connection
    if getattr(driver, "autocommit", False) is True or conn._is_autocommit_isolation():
        raise OutboxError(
            "enqueue needs the transaction of the business change, but this connection is in "
            "AUTOCOMMIT mode (isolation_level='AUTOCOMMIT'): each statement commits at once, "
            "so the event would commit alone. Use a connection without AUTOCOMMIT, inside "
            "`with session.begin():` / `with conn.begin():`"
        )


_default = Outbox()
enqueue = _default.enqueue
enqueue_many = _default.enqueue_many
enqueue_sync = _default.enqueue_sync
enqueue_many_sync = _default.enqueue_many_sync
