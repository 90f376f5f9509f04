-- Delivering to endpoints (the relay side of migration 0006): replays, the per-endpoint rate
-- limit and tenant matching need these. Runs with search_path set to the target schema.

-- A delivery put back to pending by `outbox-relay replay`: its next attempt is logged as a
-- replay. A constant default: adding the column rewrites nothing.
ALTER TABLE outbox_deliveries ADD COLUMN replay boolean NOT NULL DEFAULT false;

-- The rate limit counts an endpoint's deliveries in flight (claimed by any relay, not yet
-- attempted) as well as its attempts of the last second: this index holds only running rows.
CREATE INDEX outbox_deliveries_running_idx ON outbox_deliveries (endpoint_id)
    WHERE status = 'running';

-- Fan-out finds an event's endpoints by destination and tenant: two probes per event (the
-- tenant's own endpoints and those taking every tenant), whatever the number registered.
CREATE INDEX outbox_endpoints_match_idx ON outbox_endpoints (destination, tenant)
    WHERE enabled;
