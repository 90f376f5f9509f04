"""What the operations share: their refusal (AdminError), the checks that the schema has
their tables, their statements rendered for a schema, endpoint origins, and the base of their
typed results (``to_json()``: the dict ``--json`` prints, key for key in field order)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import urlsplit

import asyncpg

from outbox.status import Status
from relay.ops import queries


class AdminError(Exception):
    """The request cannot be carried out; the message says why and what to do."""


@dataclass(frozen=True)
class Result:
    """A typed result of an operation. Timestamps are ISO-8601 text, as they are printed."""

    def to_json(self) -> dict[str, Any]:
        """The result as JSON-ready data: what `--json` prints and the console's API serves."""
        return asdict(self)


R = TypeVar("R", bound=Result)


def from_record(cls: type[R], record: Mapping[str, Any], **computed: Any) -> R:
    """A ``cls`` whose fields are the record's columns of the same names (timestamps as ISO
    text), but those ``computed``."""
    values = {
        f.name: computed[f.name] if f.name in computed else _value(record[f.name])
        for f in fields(cls)
    }
    return cls(**values)


def _value(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts is not None else None


def seconds(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


def sql(statement: str, schema: str) -> str:
    return queries.render_ops(statement, schema)


async def check_tables(conn: asyncpg.Connection, schema: str) -> None:
    for table in ("outbox", queries.PAUSED_TABLE, queries.RELAYS_TABLE):
        if not await conn.fetchval(queries.TABLE_EXISTS, queries.qualified_table(schema, table)):
            raise AdminError(
                f"no {table} table in schema {schema!r}: run `outbox-relay migrate` "
                "(with the same --database-url and --schema)"
            )


# --- endpoints (kind = "endpoints"): what show, status and replay say about them -----------


def origin(url: str | None) -> str | None:
    """``scheme://host[:port]`` of an endpoint's URL, as the relay's errors, logs and metrics
    name it: never the path or query (they often carry tokens), nor credentials. None for an
    endpoint that was deleted."""
    if url is None:
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "(unreadable URL)"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


ENDPOINT_TABLES = ("endpoints", "deliveries", "attempts")


async def has_endpoint_tables(conn: asyncpg.Connection, schema: str) -> bool:
    """Whether the schema has the endpoint tables (migration 0006)."""
    tables = [queries.qualified_table(schema, f"outbox_{t}") for t in ENDPOINT_TABLES]
    return bool(await conn.fetchval(queries.ENDPOINT_TABLES_EXIST, *tables))


async def failed_rows(
    conn: asyncpg.Connection, schema: str, ids: list[int], *, verb: str, hints: tuple[str, str]
) -> list[asyncpg.Record]:
    """The rows with these ids (id, destination, status), all failed: else AdminError, naming
    the ids that do not exist or the rows in another state, with ``hints`` (after either)."""
    rows = await conn.fetch(sql(queries.ID_STATUSES, schema), ids)
    found = {r["id"]: r["status"] for r in rows}
    missing = [i for i in ids if i not in found]
    if missing:
        raise AdminError(
            f"no outbox row with id {', '.join(map(str, missing))}{hints[0]}. Nothing changed."
        )
    not_failed = {i: s for i, s in found.items() if s != Status.FAILED}
    if not_failed:
        listed = ", ".join(f"{i} is {s}" for i, s in sorted(not_failed.items()))
        raise AdminError(f"only failed rows can be {verb}: {listed}{hints[1]}. Nothing changed.")
    return list(rows)
