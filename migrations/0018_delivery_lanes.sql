-- outbox-relay: no transaction
-- Two lanes for the delivery claim, as migration 0012 gave the events', so that its cost does
-- not grow with deliveries already made while a held snapshot (a pg_dump, a report, an idle
-- transaction) keeps VACUUM from removing their dead index entries (docs/performance.md, "The
-- endpoints path under a held snapshot"): read from the start of an endpoint's range, the
-- claim index passed the dead pending version of every delivery claimed since.
--
-- outbox_deliveries_fresh_idx holds deliveries never claimed, due when they were written and
-- not replays: nearly every one, written by a fan-out. The claim reads an endpoint's from a
-- floor its relay keeps (below the first one its claims left pending), so the entries of those
-- claimed before are not read again; fan-outs take their ids in the order they commit (see
-- relay/db/queries/deliveries.sql, fan_out), so no fan-out commits below a floor.
-- outbox_deliveries_waiting_idx holds the other pending ones: retried, reaped, released,
-- replayed, or written with a later run_after; the claim takes them in run_after order, as it
-- took every delivery before. Together they hold exactly outbox_deliveries_claim_idx's rows,
-- which stays for the relays of earlier releases (a rolling upgrade), `status` and the gauges.
--
-- Built CONCURRENTLY (fan-outs and claims are never blocked); an interrupted run leaves at
-- most an invalid index, dropped and built again by the next run. Runs with search_path set
-- to the target schema.
DROP INDEX CONCURRENTLY IF EXISTS outbox_deliveries_fresh_idx;
CREATE INDEX CONCURRENTLY outbox_deliveries_fresh_idx ON outbox_deliveries (endpoint_id, id)
    WHERE status = 'pending' AND claims = 0 AND NOT replay AND run_after <= created_at;
DROP INDEX CONCURRENTLY IF EXISTS outbox_deliveries_waiting_idx;
CREATE INDEX CONCURRENTLY outbox_deliveries_waiting_idx ON outbox_deliveries (endpoint_id, run_after, id)
    WHERE status = 'pending' AND (claims <> 0 OR replay OR run_after > created_at);
-- An endpoint's deliveries in flight by when their leases end and by relay: the claim counts
-- only other relays' from the database (each relay knows its own), and an index key of
-- locked_by lets it step over its own entries, and over the dead running version of each of
-- its deliveries recorded while a snapshot is held (a lease's worth: with a 30 s lease at 800
-- deliveries/s, 24,000 read at every claim), without reading the table. It replaces
-- outbox_deliveries_in_flight_idx of migration 0017 (its first two columns, for relays of
-- that release), built under a name of its own and swapped in as 0017 does, so a run
-- interrupted anywhere and run again never leaves the deliveries without one.
DROP INDEX CONCURRENTLY IF EXISTS outbox_deliveries_in_flight_old_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_deliveries_in_flight_next_idx;
CREATE INDEX CONCURRENTLY outbox_deliveries_in_flight_next_idx ON outbox_deliveries (endpoint_id, locked_until, locked_by)
    WHERE status = 'running';
DO $$ BEGIN IF to_regclass('outbox_deliveries_in_flight_idx') IS NOT NULL THEN ALTER INDEX outbox_deliveries_in_flight_idx RENAME TO outbox_deliveries_in_flight_old_idx; END IF; ALTER INDEX outbox_deliveries_in_flight_next_idx RENAME TO outbox_deliveries_in_flight_idx; END $$;
DROP INDEX CONCURRENTLY IF EXISTS outbox_deliveries_in_flight_old_idx;
