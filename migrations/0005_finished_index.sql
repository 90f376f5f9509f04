-- outbox-relay: no transaction
-- Purging failed and skipped rows by when they ended (migration 0004's finished_at, or
-- created_at for rows without one) reads this index. It is built CONCURRENTLY, which cannot
-- run in a transaction, so that the application's inserts are never blocked while a large
-- table is indexed. An interrupted run may leave an invalid index behind: it is dropped and
-- built again. Runs with search_path set to the target schema.
DROP INDEX CONCURRENTLY IF EXISTS outbox_finished_idx;
CREATE INDEX CONCURRENTLY outbox_finished_idx ON outbox ((coalesce(finished_at, created_at)))
    WHERE status IN ('failed', 'skipped');
