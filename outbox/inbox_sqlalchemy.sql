-- The inbox's purge through SQLAlchemy's text() (outbox.inbox): binds as written (:name),
-- loaded by outbox/queries.py with binds="named". asyncpg's is in inbox_asyncpg.sql (its
-- casts differ); what both drivers run alike is in inbox.sql. {table} is the schema's
-- outbox_inbox.

-- name: inbox_purge_sa
-- One bounded batch of the oldest marks, read from outbox_inbox_received_idx; rows another
-- purge is deleting are skipped rather than waited for.
-- params: older_than, batch_size

DELETE FROM {table}
WHERE (consumer, event_id) IN (
    SELECT consumer, event_id FROM {table}
    WHERE received_at < now() - make_interval(secs => CAST(:older_than AS double precision))
    ORDER BY received_at
    LIMIT CAST(:batch_size AS integer)
    FOR UPDATE SKIP LOCKED
)
