"""How the relay's statements name their tables, and :func:`render_ops`, which fills the names
in for a schema.

Statements name the outbox table ``{table}``, outbox_paused ``{paused}``, outbox_relays
``{relays}``, outbox_batches ``{batches}`` and the endpoint tables ``{endpoints}``,
``{deliveries}``, ``{attempts}``."""

from __future__ import annotations

import functools

from outbox.queries import qualified_table, render_endpoints


# Called for every statement a sink's store runs (Store.call): a few statements, one schema.
@functools.lru_cache(maxsize=512)
def render_ops(sql: str, schema: str) -> str:
    """Fill in ``{table}`` (the outbox), ``{paused}`` (outbox_paused), ``{relays}``
    (outbox_relays), ``{batches}`` (outbox_batches), and ``{endpoints}``, ``{deliveries}``,
    ``{attempts}`` of ``schema``."""
    return render_endpoints(
        sql.replace("{table}", qualified_table(schema))
        .replace("{paused}", qualified_table(schema, PAUSED_TABLE))
        .replace("{relays}", qualified_table(schema, RELAYS_TABLE))
        .replace("{batches}", qualified_table(schema, BATCHES_TABLE)),
        schema,
    )


PAUSED_TABLE = "outbox_paused"

RELAYS_TABLE = "outbox_relays"

BATCHES_TABLE = "outbox_batches"
