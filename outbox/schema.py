"""The outbox tables as SQLAlchemy metadata, for teams that manage their schema with Alembic.

``migrations/`` is the source of truth; a test migrates a database and checks that this model
matches it column for column and index for index.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    DDL,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Float,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Table,
    Text,
    TextClause,
    UniqueConstraint,
    event,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.types import UserDefinedType

from outbox.queries import check_schema, quote_ident
from outbox.sql import load
from outbox.status import Status as Status  # where it used to live

TABLE_NAME = "outbox"
PAUSED_TABLE_NAME = "outbox_paused"
RELAYS_TABLE_NAME = "outbox_relays"
ENDPOINTS_TABLE_NAME = "outbox_endpoints"
DELIVERIES_TABLE_NAME = "outbox_deliveries"
ATTEMPTS_TABLE_NAME = "outbox_attempts"
INBOX_TABLE_NAME = "outbox_inbox"
BATCHES_TABLE_NAME = "outbox_batches"


# The functions and triggers of migrations 0001 and 0003, created with the table by
# metadata.create_all so a schema managed with Alembic gets the wake-up and the ordering fence
# too; the endpoints' wake-up (0006) likewise. Their text is in schema.sql beside this module.
# The drift test checks they match what the migrations create.
_ddl = load("outbox", "schema.sql", binds="named")

NOTIFY_FUNCTION = _ddl["notify_function"]
NOTIFY_TRIGGER = _ddl["notify_trigger"]
FENCE_FUNCTION = _ddl["fence_function"]
FENCE_TRIGGER = _ddl["fence_trigger"]
ENDPOINTS_NOTIFY_FUNCTION = _ddl["endpoints_notify_function"]
ENDPOINTS_NOTIFY_TRIGGER = _ddl["endpoints_notify_trigger"]
ENDPOINTS_TENANT_SINCE_FUNCTION = _ddl["endpoints_tenant_since_function"]
ENDPOINTS_TENANT_SINCE_TRIGGER = _ddl["endpoints_tenant_since_trigger"]


def _attach_triggers(table: Table, schema: str | None) -> None:
    prefix = f"{quote_ident(check_schema(schema))}." if schema else ""
    for sql in (NOTIFY_FUNCTION, FENCE_FUNCTION):
        event.listen(table, "before_create", DDL(sql.replace("{schema}", prefix)))  # type: ignore[no-untyped-call]
    for sql in (NOTIFY_TRIGGER, FENCE_TRIGGER):
        event.listen(table, "after_create", DDL(sql.replace("{schema}", prefix)))  # type: ignore[no-untyped-call]


def define_outbox_table(metadata: MetaData, schema: str | None = None) -> Table:
    """Add the outbox table to ``metadata`` (in ``schema``, or the search path when None).

    ``create_all`` also creates its NOTIFY and ordering-fence triggers.
    """
    table = _outbox_table(metadata, schema)
    _attach_triggers(table, schema)
    return table


def _outbox_table(metadata: MetaData, schema: str | None) -> Table:
    return Table(
        TABLE_NAME,
        metadata,
        _id(),
        Column("destination", Text, nullable=False),
        Column("key", Text, nullable=True),
        Column("payload", LargeBinary, nullable=False),
        Column(
            "content_type",
            Text,
            nullable=False,
            server_default=text("'application/octet-stream'::text"),
        ),
        Column("headers", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
        Column("status", Text, nullable=False, server_default=text("'pending'::text")),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("run_after", DateTime(timezone=True), nullable=False, server_default=text("now()")),
        Column("locked_by", Text, nullable=True),
        Column("locked_until", DateTime(timezone=True), nullable=True),
        Column("last_error", Text, nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
        Column("delivered_at", DateTime(timezone=True), nullable=True),
        # The fencing token: a claim increments it, and the claiming relay's writes apply only
        # while the row still carries the value that claim returned.
        Column("claims", Integer, nullable=False, server_default=text("0")),
        Column("finished_at", DateTime(timezone=True), nullable=True),
        # For destinations of kind "endpoints": which endpoints an event goes to.
        Column("event_type", Text, nullable=True),
        Column("tenant", Text, nullable=True),
        *_outbox_constraints_and_indexes(),
        schema=schema,
    )


def _partial_index(name: str, *columns: str | TextClause, where: str) -> Index:
    """An index over the rows ``where`` holds for (a partial index)."""
    return Index(name, *columns, postgresql_where=text(where))


def _outbox_constraints_and_indexes() -> list[CheckConstraint | Index]:
    """As the migrations create them (the drift test compares)."""
    return [
        CheckConstraint("destination <> ''", name="outbox_destination_check"),
        CheckConstraint(
            "status IN ('pending', 'running', 'delivered', 'failed', 'skipped')",
            name="outbox_status_check",
        ),
        _partial_index(
            "outbox_claim_idx", "destination", "run_after", "id", where="status = 'pending'"
        ),
        _partial_index(
            "outbox_lease_idx", "destination", "locked_until", where="status = 'running'"
        ),
        _partial_index("outbox_delivered_idx", "delivered_at", where="status = 'delivered'"),
        _partial_index(
            "outbox_finished_idx",
            text("(COALESCE(finished_at, created_at))"),
            where="status IN ('failed', 'skipped')",
        ),
        _partial_index(
            "outbox_key_idx",
            "destination",
            "key",
            "id",
            where="status IN ('pending', 'failed') AND key IS NOT NULL",
        ),
        _partial_index(
            "outbox_unkeyed_idx",
            "destination",
            "run_after",
            "id",
            where="status = 'pending' AND key IS NULL",
        ),
        _partial_index(
            "outbox_fresh_idx",
            "destination",
            "id",
            where="status = 'pending' AND claims = 0 AND run_after <= created_at",
        ),
        _partial_index(
            "outbox_waiting_idx",
            "destination",
            "run_after",
            "id",
            where="status = 'pending' AND (claims <> 0 OR run_after > created_at)",
        ),
        # Failed rows of ordered keys (migration 0014): an ordered destination's owner reads them.
        _partial_index(
            "outbox_failed_key_idx",
            "destination",
            "key",
            "id",
            where="status = 'failed' AND key IS NOT NULL",
        ),
    ]


def define_paused_table(metadata: MetaData, schema: str | None = None) -> Table:
    """Add ``outbox_paused`` (destinations no relay claims) to ``metadata``."""
    return Table(
        PAUSED_TABLE_NAME,
        metadata,
        Column("destination", Text, primary_key=True),
        Column("paused_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
        Column("paused_by", Text, nullable=True),
        Column("reason", Text, nullable=True),
        CheckConstraint("destination <> ''", name="outbox_paused_destination_check"),
        schema=schema,
    )


def define_relays_table(metadata: MetaData, schema: str | None = None) -> Table:
    """Add ``outbox_relays`` (the relays that run, and what they serve) to ``metadata``."""
    return Table(
        RELAYS_TABLE_NAME,
        metadata,
        Column("relay_id", Text, primary_key=True),
        Column("host", Text, nullable=True),
        Column("pid", Integer, nullable=True),
        Column("version", Text, nullable=True),
        Column("destinations", ARRAY(Text), nullable=False, server_default=text("'{}'::text[]")),
        Column("started_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
        Column("seen_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
        Column("stopped_at", DateTime(timezone=True), nullable=True),
        Column("circuits", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
        # What the relay can do: 'ordered-owner' (migration 0013).
        Column("features", ARRAY(Text), nullable=False, server_default=text("'{}'::text[]")),
        Column("features_at", DateTime(timezone=True), nullable=True),
        schema=schema,
    )


def _id() -> Column[Any]:
    return Column("id", BigInteger, Identity(always=True), primary_key=True)


def _event_and_endpoint() -> tuple[Column[Any], Column[Any]]:
    """The event and the endpoint a delivery, or an attempt at one, is of."""
    return (
        Column("event_id", BigInteger, nullable=False),
        Column("endpoint_id", BigInteger, nullable=False),
    )


def _timestamp(name: str, *, now: bool = False) -> Column[Any]:
    if now:
        return Column(name, DateTime(timezone=True), nullable=False, server_default=text("now()"))
    return Column(name, DateTime(timezone=True), nullable=True)


def define_endpoints_table(metadata: MetaData, schema: str | None = None) -> Table:
    """Add ``outbox_endpoints`` (webhook receivers registered at runtime) to ``metadata``."""
    table = Table(
        ENDPOINTS_TABLE_NAME,
        metadata,
        _id(),
        Column("destination", Text, nullable=False),
        Column("url", Text, nullable=False),
        Column("tenant", Text, nullable=True),
        Column("event_types", ARRAY(Text), nullable=False, server_default=text("'{}'::text[]")),
        Column("secret", Text, nullable=False),
        Column("previous_secret", Text, nullable=True),
        _timestamp("previous_secret_until"),
        Column("rate_limit", Integer, nullable=True),
        Column("description", Text, nullable=False, server_default=text("''::text")),
        Column("enabled", Boolean, nullable=False, server_default=text("true")),
        Column("disabled_reason", Text, nullable=True),
        _timestamp("disabled_at"),
        _timestamp("failing_since"),
        _timestamp("last_success_at"),
        _timestamp("created_at", now=True),
        _timestamp("updated_at", now=True),
        _timestamp("circuit_open_until"),
        _timestamp("tenant_since"),  # migration 0019: when its tenant last changed
        CheckConstraint("destination <> ''", name="outbox_endpoints_destination_check"),
        CheckConstraint("url <> ''", name="outbox_endpoints_url_check"),
        CheckConstraint(
            "rate_limit IS NULL OR rate_limit > 0", name="outbox_endpoints_rate_limit_check"
        ),
        _partial_index("outbox_endpoints_destination_idx", "destination", "id", where="enabled"),
        _partial_index("outbox_endpoints_match_idx", "destination", "tenant", where="enabled"),
        Index("outbox_endpoints_tenant_idx", "tenant", "id"),  # migration 0019: the portal's
        schema=schema,
    )
    prefix = f"{quote_ident(check_schema(schema))}." if schema else ""
    for when, sql in (
        ("before_create", ENDPOINTS_NOTIFY_FUNCTION),
        ("after_create", ENDPOINTS_NOTIFY_TRIGGER),
        ("before_create", ENDPOINTS_TENANT_SINCE_FUNCTION),
        ("after_create", ENDPOINTS_TENANT_SINCE_TRIGGER),
    ):
        event.listen(table, when, DDL(sql.replace("{schema}", prefix)))  # type: ignore[no-untyped-call]
    return table


# A delivery of the claim's fresh lane (migration 0018): never claimed, due when it was written,
# not a replay. Written alike wherever the lane is read (relay/db/queries/deliveries.sql).
DELIVERY_FRESH = "claims = 0 AND NOT replay AND run_after <= created_at"


def _deliveries_indexes() -> list[Index]:
    """outbox_deliveries' indexes, as the migrations create them (the drift test compares)."""
    return [
        # The claim's lanes (migration 0018): never claimed, and due again. Together they hold
        # every pending delivery (migration 0020 dropped the index of all of them).
        _partial_index(
            "outbox_deliveries_fresh_idx",
            "endpoint_id",
            "id",
            where=f"status = 'pending' AND {DELIVERY_FRESH}",
        ),
        _partial_index(
            "outbox_deliveries_waiting_idx",
            "endpoint_id",
            "run_after",
            "id",
            where="status = 'pending' AND (claims <> 0 OR replay OR run_after > created_at)",
        ),
        Index("outbox_deliveries_endpoint_idx", "endpoint_id", "id"),
        _partial_index("outbox_deliveries_lease_idx", "locked_until", where="status = 'running'"),
        _partial_index(
            "outbox_deliveries_in_flight_idx",
            "endpoint_id",
            "locked_until",
            "locked_by",
            where="status = 'running'",
        ),
        _partial_index(
            "outbox_deliveries_finished_idx",
            "finished_at",
            where="status IN ('delivered', 'failed', 'cancelled')",
        ),
    ]


def define_deliveries_table(metadata: MetaData, schema: str | None = None) -> Table:
    """Add ``outbox_deliveries`` (one row per event and matching endpoint) to ``metadata``."""
    return Table(
        DELIVERIES_TABLE_NAME,
        metadata,
        _id(),
        *_event_and_endpoint(),
        Column("destination", Text, nullable=False),
        Column("status", Text, nullable=False, server_default=text("'pending'::text")),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        _timestamp("run_after", now=True),
        Column("locked_by", Text, nullable=True),
        _timestamp("locked_until"),
        Column("claims", Integer, nullable=False, server_default=text("0")),
        Column("last_error", Text, nullable=True),
        Column("last_status", Integer, nullable=True),
        _timestamp("created_at", now=True),
        _timestamp("finished_at"),
        Column("replay", Boolean, nullable=False, server_default=text("false")),
        CheckConstraint(
            "status IN ('pending', 'running', 'delivered', 'failed', 'cancelled')",
            name="outbox_deliveries_status_check",
        ),
        UniqueConstraint(
            "event_id", "endpoint_id", name="outbox_deliveries_event_id_endpoint_id_key"
        ),
        *_deliveries_indexes(),
        schema=schema,
    )


def define_attempts_table(metadata: MetaData, schema: str | None = None) -> Table:
    """Add ``outbox_attempts`` (the message log of endpoint deliveries) to ``metadata``."""
    return Table(
        ATTEMPTS_TABLE_NAME,
        metadata,
        _id(),
        Column("delivery_id", BigInteger, nullable=False),
        *_event_and_endpoint(),
        _timestamp("at", now=True),
        Column("http_status", Integer, nullable=True),
        Column("duration_ms", Float, nullable=True),
        Column("response", Text, nullable=True),
        Column("error", Text, nullable=True),
        Column("replay", Boolean, nullable=False, server_default=text("false")),
        Index("outbox_attempts_event_idx", "event_id", "id"),
        Index("outbox_attempts_endpoint_idx", "endpoint_id", "at"),
        # No index of `at` alone (migration 0020): retention walks the log by id.
        schema=schema,
    )


def define_inbox_table(metadata: MetaData, schema: str | None = None) -> Table:
    """Add ``outbox_inbox`` (the events each consumer has applied, see ``outbox.inbox``) to
    ``metadata``."""
    return Table(
        INBOX_TABLE_NAME,
        metadata,
        Column("consumer", Text, primary_key=True),
        Column("event_id", Text, primary_key=True),
        _timestamp("received_at", now=True),
        CheckConstraint("consumer <> ''", name="outbox_inbox_consumer_check"),
        CheckConstraint("event_id <> ''", name="outbox_inbox_event_id_check"),
        Index("outbox_inbox_received_idx", "received_at"),
        schema=schema,
    )


class Xid(UserDefinedType[int]):
    """PostgreSQL's ``xid``, a 32-bit transaction id (``outbox_batches.snapshot_xmax``)."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "xid"


def define_batches_table(metadata: MetaData, schema: str | None = None) -> Table:
    """Add ``outbox_batches`` (the relays' batch leases, migration 0015) to ``metadata``."""
    return Table(
        BATCHES_TABLE_NAME,
        metadata,
        _id(),
        Column("destination", Text, nullable=False),
        Column("epoch", BigInteger, nullable=False),
        Column("first_id", BigInteger, nullable=False),
        Column("last_id", BigInteger, nullable=False),
        Column("relay", Text, nullable=True),
        Column("lease_until", DateTime(timezone=True), nullable=False),
        _timestamp("created_at", now=True),
        # The xmax of the claim's snapshot (migration 0016; NULL before it).
        Column("snapshot_xmax", Xid(), nullable=True),
        UniqueConstraint("destination", "epoch", "first_id", name="outbox_batches_chain_key"),
        CheckConstraint("last_id > first_id", name="outbox_batches_range_check"),
        _partial_index("outbox_batches_lease_idx", "lease_until", where="relay IS NOT NULL"),
        schema=schema,
    )


metadata = MetaData()
outbox_table = define_outbox_table(metadata)
paused_table = define_paused_table(metadata)
relays_table = define_relays_table(metadata)
endpoints_table = define_endpoints_table(metadata)
deliveries_table = define_deliveries_table(metadata)
attempts_table = define_attempts_table(metadata)
inbox_table = define_inbox_table(metadata)
batches_table = define_batches_table(metadata)
