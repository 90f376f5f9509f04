-- outbox-relay: no transaction
-- An endpoint's deliveries in flight, by when their leases end. The delivery claim counts
-- them at every claim (max_concurrency across relays: live leases only), and read from the
-- running index by endpoint alone that count passed the dead running version of every
-- delivery recorded since a held snapshot (a pg_dump, a report, an idle transaction) was
-- taken: 8,000 per endpoint after 64,000 deliveries, a third of the claim's reads. Read from
-- now() on, it passes only those whose lease would not yet have ended: a lease's worth of
-- them, whatever the snapshot's age. It replaces outbox_deliveries_running_idx (its first
-- column, for any reader counting by endpoint alone). Built CONCURRENTLY (fan-outs and claims
-- are never blocked); an interrupted run leaves at most an invalid index, dropped and built
-- again by the next run. Runs with search_path set to the target schema.
DROP INDEX CONCURRENTLY IF EXISTS outbox_deliveries_in_flight_idx;
CREATE INDEX CONCURRENTLY outbox_deliveries_in_flight_idx ON outbox_deliveries (endpoint_id, locked_until)
    WHERE status = 'running';
DROP INDEX CONCURRENTLY IF EXISTS outbox_deliveries_running_idx;
