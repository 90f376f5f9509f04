-- The consumer's inbox (outbox.inbox): the statements SQLAlchemy's text() and asyncpg run
-- alike. outbox/queries.py loads this file twice, with binds="named" for SQLAlchemy (its
-- INBOX_MARK_SA) and binds="numbered" for asyncpg (INBOX_MARK_PG, each :name handed out as
-- $1, $2, … in its params' order). The purge differs in its casts: SQLAlchemy's is in
-- inbox_sqlalchemy.sql, asyncpg's in inbox_asyncpg.sql. {table} is the schema's outbox_inbox.

-- name: inbox_mark
-- A row back: the event is new to this consumer. None: it was marked before (or is being
-- marked by a transaction still open, which this insert waits for, then sees committed).
-- params: consumer, event_id

INSERT INTO {table} (consumer, event_id) VALUES (:consumer, :event_id)
ON CONFLICT (consumer, event_id) DO NOTHING
RETURNING true

-- name: inbox_can_commit
-- Whether the consumer's transaction can still commit, asked after its handler and before its
-- COMMIT. A statement that failed in it (a unique violation the handler caught) aborted it:
-- then every statement fails with SQLSTATE 25P02, and COMMIT answers ROLLBACK without an
-- error, losing the effect and the mark. Any statement tells; this one reads nothing. The
-- drivers give no state to read instead (asyncpg's is private), so it is asked of the server.
SELECT 1
