"""The outbox tables as SQLAlchemy metadata, for teams that manage their schema with Alembic.

``migrations/`` is the source of truth; a test migrates a database and checks that this model
matches it column for column and index for index.
"""

from __future__ import annotations

from enum import StrEnum

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

TABLE_NAME = "outbox"
PAUSED_TABLE_NAME = "outbox_paused"


class Status(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DELIVERED = "delivered"
    FAILED = "failed"


def define_outbox_table(metadata: MetaData, schema: str | None = None) -> Table:
    """Add the outbox table to ``metadata`` (in ``schema``, or the search path when None)."""
    return Table(
        TABLE_NAME,
        metadata,
        Column("id", BigInteger, Identity(always=True), primary_key=True),
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
        CheckConstraint("destination <> ''", name="outbox_destination_check"),
        CheckConstraint(
            "status IN ('pending', 'running', 'delivered', 'failed')", name="outbox_status_check"
        ),
        Index(
            "outbox_claim_idx",
            "run_after",
            "id",
            postgresql_where=text("status = 'pending'"),
        ),
        Index("outbox_lease_idx", "locked_until", postgresql_where=text("status = 'running'")),
        Index(
            "outbox_delivered_idx",
            "delivered_at",
            postgresql_where=text("status = 'delivered'"),
        ),
        schema=schema,
    )


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


metadata = MetaData()
outbox_table = define_outbox_table(metadata)
paused_table = define_paused_table(metadata)
