"""The oldest holder of the database's xmin horizon: a snapshot or a transaction that keeps
VACUUM from removing the outbox's dead row versions (relay.db.queries.SNAPSHOT_HOLDER says which
holders count). The relay watches it (relay/maintenance/horizon.py); ``status`` and the
console name it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from outbox.sql import load
from relay.config.base import DEFAULT_SNAPSHOT_WARNING
from relay.db import queries

if TYPE_CHECKING:
    import asyncpg

# relay.snapshot_warning's default (see there).
DEFAULT_WARNING = DEFAULT_SNAPSHOT_WARNING

BACKEND = "backend"
PREPARED = "prepared transaction"
SLOT = "replication slot"

# What ends a holder, for an operator to run (see snapshots.sql): {slot}, {gid} and {pid} are
# filled in by action().
_q = load("relay.db", "snapshots.sql", binds="numbered")
DROP_REPLICATION_SLOT = _q["drop_replication_slot"]
COMMIT_PREPARED = _q["commit_prepared"]
ROLLBACK_PREPARED = _q["rollback_prepared"]
TERMINATE_BACKEND = _q["terminate_backend"]

HIDDEN_HINT = (
    "grant pg_read_all_stats (or pg_monitor) to this role to see the holder's state, "
    "transaction start and age"
)


@dataclass(frozen=True, slots=True)
class SnapshotHolder:
    """One holder, as SNAPSHOT_HOLDER reads it. Text fields come from other sessions
    (application_name, a prepared transaction's gid): untrusted, printed escaped."""

    kind: str  # BACKEND, PREPARED or SLOT
    pid: int | None  # a backend's; a slot's walsender while one is connected
    name: str | None  # the slot's name, or the prepared transaction's gid
    database: str | None
    application_name: str | None
    user: str | None
    client_addr: str | None
    state: str | None  # a backend's (idle in transaction, active, …); a slot's active/inactive
    backend_type: str | None
    xact_start: datetime | None  # a backend's transaction start; a prepared transaction's
    query_start: datetime | None
    command: str | None  # the first word of the backend's query, never more of it
    age_s: float | None  # None: not known (a slot; a backend hidden from this role)
    xid_age: int  # transactions since the xid it holds
    horizon: str  # that xid: with kind, pid and name, which holder this is
    visible: bool  # False: a backend of another role, seen without pg_read_all_stats

    @classmethod
    def from_record(cls, r: asyncpg.Record) -> SnapshotHolder:
        return cls(**{name: r[name] for name in cls.__dataclass_fields__})

    @property
    def identity(self) -> tuple[str, int | None, str | None, str]:
        """The same holder from one reading to the next (its xid only changes if it does)."""
        return (self.kind, self.pid, self.name, self.horizon)

    def over(self, threshold: float, age: float | None = None) -> bool:
        """Whether it has been held longer than ``threshold`` seconds (0: never), by its
        known age or ``age`` (the relay's own observation of it)."""
        seen = self.age_s if self.age_s is not None else age
        return threshold > 0 and seen is not None and seen > threshold

    def describe(self) -> str:
        """Who holds it, in a few words: ``pid 4242 (psql, user report, idle in transaction)``."""
        if self.kind == SLOT:
            walsender = f", pid {self.pid}" if self.pid is not None else ""
            return f"replication slot {self.name} ({self.state}{walsender})"
        if self.kind == PREPARED:
            owner = f"owner {self.user}, database {self.database}"
            return f"prepared transaction {self.name!r} ({owner})"
        parts = [self.application_name or "no application_name", f"user {self.user}"]
        if self.database is not None and not self.visible:
            parts.append(f"database {self.database}")
        if self.visible:
            parts.append(self.state or self.backend_type or "?")
            if self.command:
                parts.append(f"last statement {self.command}")
        else:
            parts.append("state hidden from this role")
        return f"pid {self.pid} ({', '.join(parts)})"

    def action(self) -> str:
        """What ends it, if it is not needed."""
        if self.kind == SLOT:
            return (
                f"a standby's hot_standby_feedback holds it through slot {self.name}: end the "
                "standby's long queries, or if that standby is gone, "
                + DROP_REPLICATION_SLOT.replace("{slot}", _literal(self.name or ""))
            )
        if self.kind == PREPARED:
            gid = _literal(self.name or "")
            commit = COMMIT_PREPARED.replace("{gid}", gid)
            rollback = ROLLBACK_PREPARED.replace("{gid}", gid)
            return (
                f"{commit} or {rollback} (in database {self.database}), once you know which "
                "its transaction manager wants"
            )
        return TERMINATE_BACKEND.replace("{pid}", str(self.pid)) + " if it is not needed"

    def as_json(self, threshold: float) -> dict[str, Any]:
        """What `status --json` and the console say of it."""
        return {
            "over_threshold": self.over(threshold),
            "threshold_s": threshold,
            "kind": self.kind,
            "pid": self.pid,
            "name": self.name,
            "database": self.database,
            "application_name": self.application_name,
            "user": self.user,
            "client_addr": self.client_addr,
            "state": self.state,
            "backend_type": self.backend_type,
            "xact_start": _iso(self.xact_start),
            "query_start": _iso(self.query_start),
            "command": self.command,
            "age_s": round(self.age_s, 3) if self.age_s is not None else None,
            "xid_age": self.xid_age,
            "visible": self.visible,
            "hint": None if self.visible else HIDDEN_HINT,
            "holder": self.describe(),
            "action": self.action(),
        }


async def oldest_holder(conn: asyncpg.Connection) -> SnapshotHolder | None:
    """The oldest holder of this database's xmin horizon, other than ``conn`` itself; None
    if there is none."""
    r = await conn.fetchrow(queries.SNAPSHOT_HOLDER)
    return SnapshotHolder.from_record(r) if r is not None else None


def _iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts is not None else None


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
