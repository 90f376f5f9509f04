-- outbox-relay: no transaction
-- The failed rows of ordered keys, by destination: the owner of an ordered destination reads
-- them at each claim when failed rows block their keys (poison_policy = "block"). Failed rows
-- are few and rarely change, so the index stays small and its reads flat while a snapshot is
-- held, where outbox_key_idx would walk every pending entry of the destination too.
-- Built CONCURRENTLY (inserts are never blocked); an interrupted run leaves at most an invalid
-- index, dropped and built again by the next run. Runs with search_path set to the target
-- schema.
DROP INDEX CONCURRENTLY IF EXISTS outbox_failed_key_idx;
CREATE INDEX CONCURRENTLY outbox_failed_key_idx ON outbox (destination, key, id)
    WHERE status = 'failed' AND key IS NOT NULL;
