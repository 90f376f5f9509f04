-- Per-key ordered delivery (destinations with ordering = "key").
--
-- The visibility fence. Identity values are taken when a row is inserted, but transactions
-- commit in any order: a transaction holding id 10 may commit after the one holding id 11.
-- An ordered relay must not deliver 11 while 10 may still commit. Transaction-id snapshots
-- cannot tell it reliably: a snapshot's xmax is "latest completed xid + 1", so a running
-- transaction that took a lower id can be invisible to the xmin/xmax arithmetic, and xid
-- order is not id order. Instead every inserting statement first takes a shared
-- transaction-scoped advisory lock keyed by the sequence's last value *before* it draws any
-- id, and holds it until it commits or rolls back. The ordered claim reads the smallest such
-- key still held (pg_locks): every id up to it belongs to a finished transaction. Sequences
-- are not transactional, so this holds at every isolation level. Keys live at 2^62 + value so
-- they do not meet an application's own advisory locks in practice.
CREATE FUNCTION outbox_fence_lock() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
BEGIN
    -- SECURITY DEFINER: reading the sequence needs a privilege INSERT alone does not give.
    PERFORM pg_advisory_xact_lock_shared(4611686018427387904 + coalesce(pg_sequence_last_value(
        pg_get_serial_sequence(quote_ident(TG_TABLE_SCHEMA) || '.' || quote_ident(TG_TABLE_NAME),
                               'id')::regclass), 0));
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_fence_lock
    BEFORE INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_fence_lock();

-- 'skipped': an operator decided a failed row will not be delivered; its key moves on.
ALTER TABLE outbox DROP CONSTRAINT outbox_status_check;
ALTER TABLE outbox ADD CONSTRAINT outbox_status_check
    CHECK (status IN ('pending', 'running', 'delivered', 'failed', 'skipped'));

-- The ordered claim walks the keys with open rows and finds each key's first open row here.
CREATE INDEX outbox_key_idx ON outbox (destination, key, id)
    WHERE status IN ('pending', 'running', 'failed') AND key IS NOT NULL;

-- Rows without a key in an ordered destination are not ordered; the claim finds them here
-- without walking past the keyed ones.
CREATE INDEX outbox_unkeyed_idx ON outbox (destination, run_after, id)
    WHERE status = 'pending' AND key IS NULL;
