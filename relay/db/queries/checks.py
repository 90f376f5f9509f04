"""The relay's checks of the database at start: that it answers, and that the columns, indexes
and privileges it needs are there."""

from __future__ import annotations

PING = "SELECT 1"

# pg_attribute, not information_schema: the latter hides columns the role has no privilege
# on, and a role granted before a migration must hear "grant", not "migrate".
COLUMN_EXISTS = """
SELECT EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = to_regclass($1) AND attname = $2 AND NOT attisdropped)
"""

# A usable index (an interrupted CREATE INDEX CONCURRENTLY leaves an invalid one behind) and
# its predicate, as PostgreSQL prints it.
INDEX_VALID = """
SELECT (SELECT pg_get_expr(indpred, indrelid) FROM pg_index
        WHERE indexrelid = to_regclass($1) AND indisvalid)
"""

TABLE_PRIVILEGE = "SELECT has_table_privilege(to_regclass($1), $2)"
