"""The console's own statements (what it shows beyond the operations commands' functions), by
name: their text is in relay/ui/queries.sql; loaded as relay/ops/queries.py says.

Placeholders as in relay/db/queries/ (``{table}``, ``{endpoints}``, …), filled by
``relay.db.queries.render_ops``.
"""

from __future__ import annotations

from outbox.sql import load

# Whether a table is there: the library's statement.
from relay.db.queries import TABLE_EXISTS as TABLE_EXISTS

_q = load("relay.ui", "queries.sql", binds="numbered")

SERIES = _q["series"]
ENDPOINTS = _q["endpoints"]
ENDPOINT_ROW = _q["endpoint_row"]
ENDPOINT_DESTINATION = _q["endpoint_destination"]
SERVER_NOW = _q["server_now"]
CATALOG_ENDPOINTS = _q["catalog_endpoints"]
