-- outbox-relay: no transaction
-- Two lanes for the unordered claim, so that its cost does not grow with rows already
-- delivered while a held snapshot (a pg_dump, a report, an idle transaction) keeps VACUUM from
-- removing their dead index entries (docs/performance.md, "A held snapshot").
--
-- outbox_fresh_idx holds rows never claimed and due when they were written: nearly every row.
-- The claim walks it in id order from where its previous claim ended (a cursor kept by each
-- relay and held back by the visibility fence of migrations 0003/0004, so that a transaction
-- that commits late is never passed over), so the entries of rows claimed before are not
-- walked again. outbox_waiting_idx holds the other pending rows: retried, reaped, released,
-- replayed, or enqueued with a later run_after; the claim takes them in run_after order, as
-- it took every row before. Together they hold exactly outbox_claim_idx's rows, which stays
-- for the relays of earlier releases (a rolling upgrade) and for `status` and the gauges.
--
-- Built CONCURRENTLY (inserts are never blocked); an interrupted run leaves at most an invalid
-- index, dropped and built again by the next run. Runs with search_path set to the target
-- schema.
DROP INDEX CONCURRENTLY IF EXISTS outbox_fresh_idx;
CREATE INDEX CONCURRENTLY outbox_fresh_idx ON outbox (destination, id)
    WHERE status = 'pending' AND claims = 0 AND run_after <= created_at;
DROP INDEX CONCURRENTLY IF EXISTS outbox_waiting_idx;
CREATE INDEX CONCURRENTLY outbox_waiting_idx ON outbox (destination, run_after, id)
    WHERE status = 'pending' AND (claims <> 0 OR run_after > created_at);
