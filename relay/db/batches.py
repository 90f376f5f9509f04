"""The statements of batch leases (relay.claims = "batch", see queries.CLAIM_BATCH) for one
schema: what the store runs for rows whose token is a batch's, and the reaper's."""

from __future__ import annotations

from dataclasses import dataclass

from relay.db import queries


@dataclass(frozen=True, slots=True)
class BatchStatements:
    record: str
    record_delivered: str
    heartbeat: str
    release: str
    reap: str
    forget: str

    @classmethod
    def of(cls, schema: str, delete_delivered: bool) -> BatchStatements:
        """For ``schema``; ``delete_delivered`` (retention = 0): records delete what they
        deliver."""

        def sql(statement: str) -> str:
            return queries.render_ops(statement, schema)

        deleting = delete_delivered
        return cls(
            record=sql(queries.RECORD_BATCH_DELETING if deleting else queries.RECORD_BATCH),
            record_delivered=sql(
                queries.RECORD_BATCH_DELIVERED_DELETING
                if deleting
                else queries.RECORD_BATCH_DELIVERED
            ),
            heartbeat=sql(queries.HEARTBEAT_BATCHES),
            release=sql(queries.RELEASE_BATCH),
            reap=sql(queries.REAP_BATCHES),
            forget=sql(queries.FORGET_BATCHES),
        )
