"""The SQL of the outbox library and its migrations, by name: enqueue, the migration runner's
bookkeeping, the endpoints API, the consumer's inbox. Their text, and why each is written so,
is in the .sql files beside this module (outbox/enqueue_sqlalchemy.sql, enqueue_asyncpg.sql,
migrate.sql, endpoints.sql, endpoint_secrets.sql, inbox.sql, inbox_sqlalchemy.sql,
inbox_asyncpg.sql; the schema's triggers are outbox/schema.py's, in schema.sql). The relay's
statements are in relay/db/queries/, the commands' in relay/ops/.

Statements name the table as ``{table}``; :func:`render` fills in the quoted, schema-qualified
name once, when an :class:`~outbox.Outbox` is created. Values are always bound parameters,
never formatted in: ``:name`` for SQLAlchemy's text() (the ``_SA`` statements and the
endpoints API's), asyncpg's ``$1 … $n`` (the ``_PG`` statements and the migrations'), psycopg's
``%s`` (derived from asyncpg's). Each statement is a name of this module, assigned from its
file one by one, so importers and mypy see every name as the ``str`` it is.
"""

from __future__ import annotations

import re

from outbox.sql import load


def quote_ident(name: str) -> str:
    """Quote an SQL identifier the way PostgreSQL's quote_ident() does, always."""
    if not name or "\x00" in name:
        raise ValueError(f"invalid SQL identifier {name!r}")
    return '"' + name.replace('"', '""') + '"'


# PostgreSQL cuts identifiers at 63 bytes, and the wake-up channel "<schema>.outbox" is one:
# a longer schema name would make every insert fail in the NOTIFY trigger.
MAX_SCHEMA_BYTES = 63 - len(".outbox")

SCHEMA_CLASHES = ":\\%{}"


def check_schema(name: object) -> str:
    """``name`` if it can name the outbox's schema, else ValueError saying why. Any name
    PostgreSQL takes as a quoted identifier works (upper case, spaces, dots, quotes)."""
    if not isinstance(name, str) or not name:
        raise ValueError("the schema name must be a non-empty string")
    if "\x00" in name:
        raise ValueError("the schema name contains a NUL character")
    clash = sorted(set(name) & set(SCHEMA_CLASHES))
    if clash:
        raise ValueError(
            f"the schema name {name!r} contains {', '.join(map(repr, clash))}: drivers read "
            "these in SQL "
            "text as parameters or escapes (SQLAlchemy's :name, psycopg's %), so they are "
            "not taken in outbox schema names; choose another name"
        )
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        raise ValueError("the schema name is not valid Unicode (a lone surrogate)") from None
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(
            f"the schema name {name!r} is {size} bytes; at most {MAX_SCHEMA_BYTES} fit "
            "(PostgreSQL names are 63 bytes, and the relay's wake-up channel is "
            "'<schema>.outbox')"
        )
    return name


def qualified_table(schema: str, table: str = "outbox") -> str:
    return f"{quote_ident(check_schema(schema))}.{quote_ident(table)}"


def render(sql: str, table: str) -> str:
    return sql.replace("{table}", table)


def render_schema(sql: str, schema: str) -> str:
    return sql.replace("{schema}", quote_ident(schema))


def render_database(sql: str, name: str) -> str:
    return sql.replace("{database}", quote_ident(name))


# --- enqueue --------------------------------------------------------------------------------

_enqueue_sa = load("outbox", "enqueue_sqlalchemy.sql", binds="named")
_enqueue_pg = load("outbox", "enqueue_asyncpg.sql", binds="numbered")

# SQLAlchemy text() forms (named binds); work for every SQLAlchemy PostgreSQL driver.
ENQUEUE_SA = _enqueue_sa["enqueue_sa"]
ENQUEUE_LABELLED_SA = _enqueue_sa["enqueue_labelled_sa"]
ENQUEUE_MANY_SA = _enqueue_sa["enqueue_many_sa"]
ENQUEUE_MANY_LABELLED_SA = _enqueue_sa["enqueue_many_labelled_sa"]

# asyncpg's ($n).
ENQUEUE_PG = _enqueue_pg["enqueue_pg"]
ENQUEUE_LABELLED_PG = _enqueue_pg["enqueue_labelled_pg"]
ENQUEUE_MANY_PG = _enqueue_pg["enqueue_many_pg"]
ENQUEUE_MANY_LABELLED_PG = _enqueue_pg["enqueue_many_labelled_pg"]


# psycopg 3 (and Django's cursor, whichever driver it runs on) takes %s placeholders: the
# asyncpg statements above, with each $n written %s. Derived here, once, so the two forms
# cannot drift apart; the arguments are the same tuple, in the same order.
_PLACEHOLDER = re.compile(r"\$(\d+)")


def to_psycopg(sql: str) -> str:
    """``sql`` (asyncpg's ``$1 … $n``, each once and in order) with ``%s`` placeholders."""
    numbers = [int(n) for n in _PLACEHOLDER.findall(sql)]
    if numbers != list(range(1, len(numbers) + 1)):
        raise ValueError(f"placeholders must be $1 … $n, each once and in order: {numbers}")
    return _PLACEHOLDER.sub("%s", sql.replace("%", "%%"))


ENQUEUE_PSYCOPG = to_psycopg(ENQUEUE_PG)

ENQUEUE_LABELLED_PSYCOPG = to_psycopg(ENQUEUE_LABELLED_PG)

ENQUEUE_MANY_PSYCOPG = to_psycopg(ENQUEUE_MANY_PG)

ENQUEUE_MANY_LABELLED_PSYCOPG = to_psycopg(ENQUEUE_MANY_LABELLED_PG)


# --- migrations -----------------------------------------------------------------------------

_migrate = load("outbox", "migrate.sql", binds="numbered")

MIGRATIONS_TABLE = _migrate["migrations_table"]
SCHEMA_EXISTS = _migrate["schema_exists"]
OUTBOX_TABLE_EXISTS = _migrate["outbox_table_exists"]
MIGRATIONS_TABLE_EXISTS = _migrate["migrations_table_exists"]
APPLIED_MIGRATIONS = _migrate["applied_migrations"]
CREATE_SCHEMA = _migrate["create_schema"]
USE_SCHEMA = _migrate["use_schema"]
USE_SCHEMA_SESSION = _migrate["use_schema_session"]
RESET_SEARCH_PATH = _migrate["reset_search_path"]
RECORD_MIGRATION = _migrate["record_migration"]
RECORD_MIGRATION_SCRIPT = _migrate["record_migration_script"]
MIGRATE_LOCK = _migrate["migrate_lock"]
MIGRATE_UNLOCK = _migrate["migrate_unlock"]
MIGRATE_LOCK_HOLDER = _migrate["migrate_lock_holder"]
MIGRATION_LOCK_TIMEOUT = _migrate["migration_lock_timeout"]
TABLE_EXISTS = _migrate["table_exists"]
SERVER_ENCODING = _migrate["server_encoding"]
NOTIFY = _migrate["notify"]

# Scratch databases of the demo and the benchmark.
CREATE_DATABASE = _migrate["create_database"]
DROP_DATABASE = _migrate["drop_database"]


# --- endpoints (webhooks for many receivers) ------------------------------------------------
# SQLAlchemy text() forms; {endpoints} and {deliveries} are the schema's tables.

_endpoints = load("outbox", "endpoints.sql", binds="named")

ENDPOINT_CREATE = _endpoints["endpoint_create"]
ENDPOINT_HOLDS_SEALED = _endpoints["endpoint_holds_sealed"]
ENDPOINT_GET = _endpoints["endpoint_get"]
ENDPOINT_LIST = _endpoints["endpoint_list"]
ENDPOINT_UPDATE = _endpoints["endpoint_update"]
ENDPOINT_DISABLE = _endpoints["endpoint_disable"]
ENDPOINT_ENABLE = _endpoints["endpoint_enable"]
ENDPOINT_ROTATE = _endpoints["endpoint_rotate"]
ENDPOINT_SEAL_PREVIOUS = _endpoints["endpoint_seal_previous"]
ENDPOINT_REENCRYPT_READ = _endpoints["endpoint_reencrypt_read"]
ENDPOINT_REENCRYPT_WRITE = _endpoints["endpoint_reencrypt_write"]
ENDPOINT_DELETE = _endpoints["endpoint_delete"]

# The relay's statements about secrets at rest (asyncpg's, $n; relay/sinks/endpoints/
# at_rest.py).
_secrets = load("outbox", "endpoint_secrets.sql", binds="numbered")

ENDPOINT_UNENCRYPTED_PG = _secrets["endpoint_unencrypted_pg"]
ENDPOINT_EXPIRED_PREVIOUS_PG = _secrets["endpoint_expired_previous_pg"]
ENDPOINT_CLEAR_PREVIOUS_PG = _secrets["endpoint_clear_previous_pg"]


def render_endpoints(sql: str, schema: str) -> str:
    """Fill in ``{endpoints}``, ``{deliveries}`` and ``{attempts}`` of ``schema``."""
    for name in ("endpoints", "deliveries", "attempts"):
        sql = sql.replace("{" + name + "}", qualified_table(schema, f"outbox_{name}"))
    return sql


# --- the consumer's inbox (outbox.inbox) ----------------------------------------------------
# {table} is the schema's outbox_inbox.

# inbox.sql's statements are alike for SQLAlchemy and asyncpg but for their binds: the file
# is loaded for each. The purges differ in their casts, one file each.
_inbox_sa = load("outbox", "inbox.sql", binds="named")
_inbox_pg = load("outbox", "inbox.sql", binds="numbered")
_inbox_purge_sa = load("outbox", "inbox_sqlalchemy.sql", binds="named")
_inbox_purge_pg = load("outbox", "inbox_asyncpg.sql", binds="numbered")

INBOX_MARK_SA = _inbox_sa["inbox_mark"]
INBOX_MARK_PG = _inbox_pg["inbox_mark"]
INBOX_CAN_COMMIT = _inbox_sa["inbox_can_commit"]
INBOX_PURGE_SA = _inbox_purge_sa["inbox_purge_sa"]
INBOX_PURGE_PG = _inbox_purge_pg["inbox_purge_pg"]
