-- The inbox's purge on asyncpg (outbox.inbox): loaded by outbox/queries.py with
-- binds="numbered", each :name handed out as $1, $2, … in its params' order. SQLAlchemy's is
-- in inbox_sqlalchemy.sql (its casts differ); what both drivers run alike is in inbox.sql.
-- {table} is the schema's outbox_inbox.

-- name: inbox_purge_pg
-- One bounded batch of the oldest marks, read from outbox_inbox_received_idx; rows another
-- purge is deleting are skipped rather than waited for.
-- params: older_than, batch_size

DELETE FROM {table}
WHERE (consumer, event_id) IN (
    SELECT consumer, event_id FROM {table}
    WHERE received_at < now() - make_interval(secs => :older_than::double precision)
    ORDER BY received_at
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
)
