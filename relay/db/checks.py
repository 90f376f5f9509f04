"""The relay's checks of its schema at start: the tables, columns and indexes of every migration
it needs, and the privileges its role needs on them."""

from __future__ import annotations

from relay.db import queries
from relay.db.pool import Call

# The claim's lanes (migration 0012), and what each one's predicate must say.
LANES = {"outbox_fresh_idx": "claims = 0", "outbox_waiting_idx": "claims <> 0"}


def _tables(schema: str) -> tuple[str, ...]:
    """The outbox tables, qualified for ``schema``: the outbox, its pauses, its relays, the
    endpoints, their deliveries and attempts, and the batch leases (migration 0015)."""
    return (
        queries.qualified_table(schema),
        queries.qualified_table(schema, queries.PAUSED_TABLE),
        queries.qualified_table(schema, queries.RELAYS_TABLE),
        *(
            queries.qualified_table(schema, t)
            for t in ("outbox_endpoints", "outbox_deliveries", "outbox_attempts")
        ),
        queries.qualified_table(schema, queries.BATCHES_TABLE),
    )


async def missing_tables(call: Call, schema: str) -> list[str]:
    """The outbox tables this relay needs that are not in its schema."""
    tables = _tables(schema)
    relays, endpoints, deliveries = tables[2:5]
    batches = tables[-1]
    missing = [t for t in tables if not await call("fetchval", queries.TABLE_EXISTS, t)]
    added = (  # columns of later migrations, the first one missing said
        (deliveries, "replay", "0007"),
        (endpoints, "circuit_open_until", "0009"),
        (relays, "circuits", "0010"),
        (relays, "features_at", "0013"),
        # The batch outcomes' fence reads it (relay/db/queries/batches.sql).
        (batches, "snapshot_xmax", "0016"),
    )
    for table, column, migration in added:
        if missing:
            break
        if not await call("fetchval", queries.COLUMN_EXISTS, table, column):
            missing.append(f"{table}.{column} (migration {migration})")
    if not missing:
        # The claim's lanes: without them it would read the whole table, claim after claim.
        for index, holds in LANES.items():
            name = queries.qualified_table(schema, index)
            predicate = await call("fetchval", queries.INDEX_VALID, name)
            if predicate is None:
                missing.append(f"{name} (migration 0012)")
            elif holds not in predicate:
                # Built by a first version of 0012 (on main for a day, never released),
                # which `migrate` does not run again.
                missing.append(
                    f"{name} as migration 0012 builds it now (it holds {predicate}): "
                    f"DROP INDEX CONCURRENTLY {name}; then run its CREATE INDEX from "
                    "migrations/0012_claim_lanes.sql"
                )
        # The delivery claim's lanes: without them its cost grew with every delivery made
        # while a snapshot was held.
        for index in ("outbox_deliveries_fresh_idx", "outbox_deliveries_waiting_idx"):
            name = queries.qualified_table(schema, index)
            if await call("fetchval", queries.INDEX_VALID, name) is None:
                missing.append(f"{name} (migration 0018)")
        # The owner's claim of an ordered destination reads the failed rows by it.
        failed = queries.qualified_table(schema, "outbox_failed_key_idx")
        if await call("fetchval", queries.INDEX_VALID, failed) is None:
            missing.append(f"{failed} (migration 0014)")
    return missing


async def missing_privileges(call: Call, schema: str) -> list[str]:
    """What the relay's role may not do on the endpoint tables and the batch leases (a role
    granted before migration 0006/0007/0015: deploy/sql/relay_role.sql must run again).
    Retention reads the endpoint tables for every destination."""
    endpoints, deliveries, attempts, batches = _tables(schema)[3:]
    wanted = [
        (endpoints, "SELECT"),
        (deliveries, "SELECT"),
        (deliveries, "INSERT"),
        (deliveries, "UPDATE"),
        (deliveries, "DELETE"),
        (attempts, "SELECT"),
        (attempts, "INSERT"),
        (attempts, "DELETE"),
        # Every statement recording an outcome reads it (migration 0015).
        (batches, "SELECT"),
        (batches, "INSERT"),
        (batches, "UPDATE"),
        (batches, "DELETE"),
    ]
    return [
        f"{what} on {table}"
        for table, what in wanted
        if not await call("fetchval", queries.TABLE_PRIVILEGE, table, what)
    ]
