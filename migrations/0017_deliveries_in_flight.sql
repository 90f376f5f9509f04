-- outbox-relay: no transaction
-- An endpoint's deliveries in flight, by when their leases end. The delivery claim counts
-- them at every claim (max_concurrency across relays: live leases only), and read from the
-- running index by endpoint alone that count passed the dead running version of every
-- delivery recorded since a held snapshot (a pg_dump, a report, an idle transaction) was
-- taken: 8,000 per endpoint after 64,000 deliveries, a third of the claim's reads. Read from
-- now() on, it passes only those whose lease would not yet have ended: a lease's worth of
-- them, whatever the snapshot's age. It replaces outbox_deliveries_running_idx (its first
-- column, for any reader counting by endpoint alone).
-- Built CONCURRENTLY under a name of its own (fan-outs and claims are never blocked), then
-- given its name by one DO statement, and the replaced index dropped last, as migration 0011
-- does: a run interrupted anywhere and run again never leaves the deliveries without a valid
-- index of running ones by endpoint (*_next_idx is only ever a build in progress, *_old_idx
-- only ever an index replaced). Runs with search_path set to the target schema.
DROP INDEX CONCURRENTLY IF EXISTS outbox_deliveries_in_flight_old_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_deliveries_in_flight_next_idx;
CREATE INDEX CONCURRENTLY outbox_deliveries_in_flight_next_idx ON outbox_deliveries (endpoint_id, locked_until)
    WHERE status = 'running';
DO $$ BEGIN IF to_regclass('outbox_deliveries_in_flight_idx') IS NOT NULL THEN ALTER INDEX outbox_deliveries_in_flight_idx RENAME TO outbox_deliveries_in_flight_old_idx; END IF; ALTER INDEX outbox_deliveries_in_flight_next_idx RENAME TO outbox_deliveries_in_flight_idx; END $$;
DROP INDEX CONCURRENTLY IF EXISTS outbox_deliveries_in_flight_old_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_deliveries_running_idx;
