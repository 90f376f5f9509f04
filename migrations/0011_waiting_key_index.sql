-- outbox-relay: no transaction
-- outbox_key_idx holds a key's waiting rows only (pending and failed), no longer its running
-- ones: each claim added an entry at a random place in it and left a dead one behind, about
-- a third of the database's work on an unordered drain (docs/performance.md). The ordered
-- claim reads the keys in flight from the destination's running rows instead, which
-- outbox_lease_idx now leads with the destination for.
-- Each index is built CONCURRENTLY beside the old one (inserts are never blocked), then the
-- two names are swapped by one DO statement (one transaction, for psql too, which would send
-- two ALTERs on a line one by one) and the old index dropped last, so that a run interrupted
-- anywhere and run again never leaves the table without a valid index of either name:
-- *_next_idx is only ever a build in progress, and *_old_idx only ever the replaced index.
-- Runs with search_path set to the target schema.
DROP INDEX CONCURRENTLY IF EXISTS outbox_key_old_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_key_next_idx;
CREATE INDEX CONCURRENTLY outbox_key_next_idx ON outbox (destination, key, id)
    WHERE status IN ('pending', 'failed') AND key IS NOT NULL;
DO $$ BEGIN IF to_regclass('outbox_key_idx') IS NOT NULL THEN ALTER INDEX outbox_key_idx RENAME TO outbox_key_old_idx; END IF; ALTER INDEX outbox_key_next_idx RENAME TO outbox_key_idx; END $$;
DROP INDEX CONCURRENTLY IF EXISTS outbox_key_old_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_lease_old_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_lease_next_idx;
CREATE INDEX CONCURRENTLY outbox_lease_next_idx ON outbox (destination, locked_until)
    WHERE status = 'running';
DO $$ BEGIN IF to_regclass('outbox_lease_idx') IS NOT NULL THEN ALTER INDEX outbox_lease_idx RENAME TO outbox_lease_old_idx; END IF; ALTER INDEX outbox_lease_next_idx RENAME TO outbox_lease_idx; END $$;
DROP INDEX CONCURRENTLY IF EXISTS outbox_lease_old_idx;
