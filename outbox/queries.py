"""The SQL of the outbox library and its migrations, in one place: enqueue, the schema, the
migration runner. The relay's statements are in relay/db/queries/, the commands' in
relay/ops/queries.py.

Statements name the table as ``{table}``; :func:`render` fills in the quoted, schema-qualified
name once, when an :class:`~outbox.Outbox` is created. Values are always bound parameters,
never formatted in.
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

_ENDPOINT_COLUMNS = """
id, destination, url, tenant, event_types, secret, previous_secret, previous_secret_until,
rate_limit, description, enabled, disabled_reason, disabled_at, failing_since,
last_success_at, created_at, updated_at
"""

# Whether any endpoint's secret, current or previous, is encrypted: then a writer without the
# key must not store one in clear beside them (it would be a downgrade the relays never
# notice). EXISTS stops at the first such row, which where secrets are encrypted is about the
# first row read; only a table of plaintext secrets is read whole (one row per registered
# endpoint, and only by writers without a key).
_HOLDS_SEALED = """EXISTS (SELECT 1 FROM {endpoints}
        WHERE secret LIKE 'enc:%' OR previous_secret LIKE 'enc:%')"""

# A secret in clear (no key here) is inserted only where none is encrypted; the check and the
# insert are one statement in the caller's transaction, so it sees what committed before it
# and the caller's own writes. No row back: refused (the caller says why).
ENDPOINT_CREATE = (
    """
INSERT INTO {endpoints} (destination, url, tenant, event_types, secret, rate_limit, description)
SELECT CAST(:destination AS text), CAST(:url AS text), CAST(:tenant AS text),
       CAST(:event_types AS text[]), CAST(:secret AS text), CAST(:rate_limit AS integer),
       CAST(:description AS text)
WHERE CAST(:secret AS text) LIKE 'enc:%' OR NOT """
    + _HOLDS_SEALED
    + """
RETURNING"""
    + _ENDPOINT_COLUMNS
)

ENDPOINT_HOLDS_SEALED = "SELECT " + _HOLDS_SEALED

ENDPOINT_GET = "SELECT" + _ENDPOINT_COLUMNS + "FROM {endpoints} WHERE id = :id"

ENDPOINT_LIST = (
    "SELECT"
    + _ENDPOINT_COLUMNS
    + """FROM {endpoints}
WHERE (CAST(:destination AS text) IS NULL OR destination = :destination)
  AND (CAST(:tenant AS text) IS NULL OR tenant = :tenant)
ORDER BY id
"""
)

# Each :set_x says whether x is changed, so that "set to NULL" and "leave as it is" differ.
ENDPOINT_UPDATE = (
    """
UPDATE {endpoints} SET
    url = CASE WHEN :set_url THEN :url ELSE url END,
    -- A new URL starts its health afresh: the old one's failures are not its own.
    failing_since = CASE WHEN :set_url AND url IS DISTINCT FROM :url THEN NULL
                         ELSE failing_since END,
    tenant = CASE WHEN :set_tenant THEN :tenant ELSE tenant END,
    event_types = CASE WHEN :set_event_types THEN CAST(:event_types AS text[])
                       ELSE event_types END,
    rate_limit = CASE WHEN :set_rate_limit THEN CAST(:rate_limit AS integer) ELSE rate_limit END,
    description = CASE WHEN :set_description THEN :description ELSE description END,
    updated_at = now()
WHERE id = :id
RETURNING"""
    + _ENDPOINT_COLUMNS
)

ENDPOINT_DISABLE = (
    """
UPDATE {endpoints}
SET enabled = false,
    -- Disabling a disabled endpoint keeps when and why it was (an auto-disable's reason).
    disabled_reason = CASE WHEN enabled THEN CAST(:reason AS text)
                           ELSE coalesce(CAST(:reason AS text), disabled_reason) END,
    disabled_at = CASE WHEN enabled THEN now() ELSE disabled_at END,
    updated_at = now()
WHERE id = :id
RETURNING"""
    + _ENDPOINT_COLUMNS
)

# Enabling starts its health afresh: the failures before it was disabled do not count again.
# Enabling an endpoint sends everything queued for it: its pending deliveries (kept, with
# their events, while it was disabled) become due now, whatever backoff they were waiting out
# when it was disabled. Only when it was disabled: enabling an enabled endpoint changes
# nothing. One UPDATE of its backlog, through the deliveries' claim index.
ENDPOINT_ENABLE = (
    """
WITH due AS (
    UPDATE {deliveries} AS d SET run_after = now()
    WHERE d.endpoint_id = CAST(:id AS bigint) AND d.status = 'pending' AND d.run_after > now()
      AND EXISTS (SELECT 1 FROM {endpoints} AS e WHERE e.id = CAST(:id AS bigint)
                  AND NOT e.enabled)
)
UPDATE {endpoints}
SET enabled = true, disabled_reason = NULL, disabled_at = NULL, failing_since = NULL,
    updated_at = now()
WHERE id = :id
RETURNING"""
    + _ENDPOINT_COLUMNS
)

# One previous secret at a time: while it is still valid, only a rotation that drops it at
# once (keep_seconds = 0, a leaked secret) goes through. A new secret in clear goes in only
# where none is encrypted: not this row's (tested on the row itself, so that if another writer
# changes it meanwhile, the test is made again on its newest version once that commits) and
# no other row's. The others change no row, and the caller reads ENDPOINT_GET to say why.
ENDPOINT_ROTATE = (
    """
UPDATE {endpoints}
SET previous_secret = CASE WHEN :keep_seconds > 0 THEN secret END,
    previous_secret_until = CASE WHEN :keep_seconds > 0
                                 THEN now() + make_interval(secs => :keep_seconds) END,
    secret = :secret,
    updated_at = now()
WHERE id = :id
  AND (:keep_seconds = 0 OR previous_secret_until IS NULL OR previous_secret_until <= now())
  AND (CAST(:secret AS text) LIKE 'enc:%'
       OR (secret NOT LIKE 'enc:%' AND coalesce(previous_secret, '') NOT LIKE 'enc:%'
           AND NOT """
    + _HOLDS_SEALED
    + """))
RETURNING"""
    + _ENDPOINT_COLUMNS
)

# After a rotation with a key of a secret stored in clear (a table encrypted since): the
# secret that still signs for a while is stored encrypted too. The row is this transaction's
# (locked by the rotation).
ENDPOINT_SEAL_PREVIOUS = """
UPDATE {endpoints} SET previous_secret = :previous WHERE id = :id RETURNING id
"""

# Re-encryption under a new key (`outbox-relay endpoints reencrypt`), a batch per transaction
# in id order. The batch is locked: a writer rotating one of its secrets meanwhile waits, and
# then rotates what this wrote (never the other way round). A previous secret past its window
# signs nothing any more: it is reported as expired, to be cleared rather than re-encrypted.
ENDPOINT_REENCRYPT_READ = """
SELECT id, secret, previous_secret,
       previous_secret IS NOT NULL AND NOT coalesce(previous_secret_until > now(), false)
           AS previous_expired
FROM {endpoints}
WHERE id > :after_id
ORDER BY id
LIMIT :limit
FOR UPDATE
"""

# Only the rows the batch changes; a cleared previous secret takes its window with it.
ENDPOINT_REENCRYPT_WRITE = """
UPDATE {endpoints} AS e
SET secret = v.secret,
    previous_secret = v.previous_secret,
    previous_secret_until = CASE WHEN v.previous_secret IS NULL THEN NULL
                                 ELSE e.previous_secret_until END
FROM unnest(CAST(:ids AS bigint[]), CAST(:secrets AS text[]), CAST(:previous AS text[]))
         AS v(id, secret, previous_secret)
WHERE e.id = v.id
RETURNING e.id
"""

# The relay's statements about secrets at rest (asyncpg form, $n; relay/sinks/endpoints/
# at_rest.py). At start-up, where encryption is required: the endpoints with a secret in
# clear, current or previous, and the first ids ($1 of them); one read of the table.
ENDPOINT_UNENCRYPTED_PG = """
SELECT count(*), (array_agg(id ORDER BY id))[1:$1]
FROM {endpoints}
WHERE secret NOT LIKE 'enc:%' OR previous_secret NOT LIKE 'enc:%'
"""

# Previous secrets whose window has passed (or that have none: they never sign), $1 at a
# time. Read first, so that the update (which wakes every relay) runs only when one is due.
ENDPOINT_EXPIRED_PREVIOUS_PG = """
SELECT id FROM {endpoints}
WHERE previous_secret IS NOT NULL AND NOT coalesce(previous_secret_until > now(), false)
ORDER BY id
LIMIT $1
"""

# The window is tested again: a rotation since the read gave the endpoint a new previous
# secret, which stays (and a rotation waiting on the row sees the cleared one afterwards).
ENDPOINT_CLEAR_PREVIOUS_PG = """
UPDATE {endpoints} SET previous_secret = NULL, previous_secret_until = NULL
WHERE id = ANY($1::bigint[])
  AND previous_secret IS NOT NULL AND NOT coalesce(previous_secret_until > now(), false)
RETURNING id
"""

# Deleting ends the endpoint's unfinished deliveries first (same statement): they can never be
# sent, and the log says why.
ENDPOINT_DELETE = """
WITH gone AS (
    DELETE FROM {endpoints} WHERE id = CAST(:id AS bigint) RETURNING 1
),
cancelled AS (
    UPDATE {deliveries}
    SET status = 'cancelled', finished_at = now(), locked_by = NULL, locked_until = NULL,
        last_error = 'endpoint ' || CAST(:id AS bigint) || ' was deleted'
    WHERE endpoint_id = CAST(:id AS bigint) AND status IN ('pending', 'running')
      AND EXISTS (SELECT 1 FROM gone)
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS deleted, (SELECT count(*) FROM cancelled) AS cancelled
"""


def render_endpoints(sql: str, schema: str) -> str:
    """Fill in ``{endpoints}``, ``{deliveries}`` and ``{attempts}`` of ``schema``."""
    for name in ("endpoints", "deliveries", "attempts"):
        sql = sql.replace("{" + name + "}", qualified_table(schema, f"outbox_{name}"))
    return sql


# --- the consumer's inbox (outbox.inbox) ----------------------------------------------------
# {table} is the schema's outbox_inbox.

# A row back: the event is new to this consumer. None: it was marked before (or is being
# marked by a transaction still open, which this insert waits for, then sees committed).
INBOX_MARK_SA = """
INSERT INTO {table} (consumer, event_id) VALUES (:consumer, :event_id)
ON CONFLICT (consumer, event_id) DO NOTHING
RETURNING true
"""

INBOX_MARK_PG = """
INSERT INTO {table} (consumer, event_id) VALUES ($1, $2)
ON CONFLICT (consumer, event_id) DO NOTHING
RETURNING true
"""

# Whether the consumer's transaction can still commit, asked after its handler and before its
# COMMIT. A statement that failed in it (a unique violation the handler caught) aborted it:
# then every statement fails with SQLSTATE 25P02, and COMMIT answers ROLLBACK without an
# error, losing the effect and the mark. Any statement tells; this one reads nothing. The
# drivers give no state to read instead (asyncpg's is private), so it is asked of the server.
INBOX_CAN_COMMIT = "SELECT 1"

# One bounded batch of the oldest marks, read from outbox_inbox_received_idx; rows another
# purge is deleting are skipped rather than waited for.
INBOX_PURGE_SA = """
DELETE FROM {table}
WHERE (consumer, event_id) IN (
    SELECT consumer, event_id FROM {table}
    WHERE received_at < now() - make_interval(secs => CAST(:older_than AS double precision))
    ORDER BY received_at
    LIMIT CAST(:batch_size AS integer)
    FOR UPDATE SKIP LOCKED
)
"""

INBOX_PURGE_PG = """
DELETE FROM {table}
WHERE (consumer, event_id) IN (
    SELECT consumer, event_id FROM {table}
    WHERE received_at < now() - make_interval(secs => $1::double precision)
    ORDER BY received_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
"""
