"""The relay's checks of the database at start: that it answers, and that the columns, indexes
and privileges it needs are there.

Their text, and why each is written so, is in relay/db/queries/checks.sql."""

from __future__ import annotations

from outbox.sql import load

_q = load("relay.db.queries", "checks.sql", binds="numbered")

PING = _q["ping"]
COLUMN_EXISTS = _q["column_exists"]
INDEX_VALID = _q["index_valid"]
TABLE_PRIVILEGE = _q["table_privilege"]
