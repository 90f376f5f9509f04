"""The states of an outbox row (the ``status`` column). Apart from the SQLAlchemy model, so
that the relay and the commands use it without loading SQLAlchemy."""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    PENDING = "pending"  # waiting for its run_after, then a claim
    RUNNING = "running"  # claimed: a relay holds it under a lease
    DELIVERED = "delivered"
    FAILED = "failed"  # retrying could not help, or the attempts are spent
    SKIPPED = "skipped"  # an operator chose not to deliver a failed row
