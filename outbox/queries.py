"""Every SQL statement of outbox-relay, in one place.

Statements name the table as ``{table}``; :func:`render` fills in the quoted, schema-qualified
name once, when an :class:`~outbox.Outbox` or a relay is created. Values are always bound
parameters, never formatted in.
"""

from __future__ import annotations


def quote_ident(name: str) -> str:
    """Quote an SQL identifier the way PostgreSQL's quote_ident() does, always."""
    if not name or "\x00" in name:
        raise ValueError(f"invalid SQL identifier {name!r}")
    return '"' + name.replace('"', '""') + '"'


def qualified_table(schema: str, table: str = "outbox") -> str:
    return f"{quote_ident(schema)}.{quote_ident(table)}"


def render(sql: str, table: str) -> str:
    return sql.replace("{table}", table)


def render_schema(sql: str, schema: str) -> str:
    return sql.replace("{schema}", quote_ident(schema))


# --- enqueue --------------------------------------------------------------------------------

# SQLAlchemy text() form (named binds); works for every SQLAlchemy PostgreSQL driver.
ENQUEUE_SA = """
INSERT INTO {table} (destination, key, payload, content_type, headers, run_after)
VALUES (:destination, :key, :payload, :content_type, CAST(:headers AS jsonb),
        COALESCE(CAST(:run_after AS timestamptz), now()))
RETURNING id
"""

ENQUEUE_PG = """
INSERT INTO {table} (destination, key, payload, content_type, headers, run_after)
VALUES ($1, $2, $3, $4, $5::jsonb, COALESCE($6::timestamptz, now()))
RETURNING id
"""

# Many rows in one statement. Identity values are drawn in the order unnest yields rows, so
# the ascending ids correspond to the input order.
ENQUEUE_MANY_SA = """
INSERT INTO {table} (destination, key, payload, content_type, headers, run_after)
SELECT d, k, p, c, h::jsonb, COALESCE(r, now())
FROM unnest(CAST(:destinations AS text[]), CAST(:keys AS text[]), CAST(:payloads AS bytea[]),
            CAST(:content_types AS text[]), CAST(:headers AS text[]),
            CAST(:run_afters AS timestamptz[])) AS u(d, k, p, c, h, r)
RETURNING id
"""

ENQUEUE_MANY_PG = """
INSERT INTO {table} (destination, key, payload, content_type, headers, run_after)
SELECT d, k, p, c, h::jsonb, COALESCE(r, now())
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[], $5::text[], $6::timestamptz[])
     AS u(d, k, p, c, h, r)
RETURNING id
"""

# --- migrations -----------------------------------------------------------------------------

MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS outbox_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""

SCHEMA_EXISTS = "SELECT to_regnamespace($1) IS NOT NULL"
MIGRATIONS_TABLE_EXISTS = "SELECT to_regclass($1 || '.outbox_migrations') IS NOT NULL"
APPLIED_MIGRATIONS = "SELECT version FROM {schema}.outbox_migrations ORDER BY version"
CREATE_SCHEMA = "CREATE SCHEMA IF NOT EXISTS {schema}"
# SET LOCAL keeps the connection's own search_path once the migration's transaction ends.
USE_SCHEMA = "SET LOCAL search_path TO {schema}"

RECORD_MIGRATION = "INSERT INTO outbox_migrations (version, name) VALUES ($1, $2)"

# A fixed key so concurrent `migrate` runs on one database queue up instead of racing.
MIGRATE_LOCK = "SELECT pg_advisory_lock(hashtextextended('outbox-relay:migrate:' || $1, 0))"
MIGRATE_UNLOCK = "SELECT pg_advisory_unlock(hashtextextended('outbox-relay:migrate:' || $1, 0))"
