-- The outbox table, its claim index and the enqueue wake-up.
-- Runs with search_path set to the target schema, so names stay unqualified here.

CREATE TABLE outbox (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    destination   text        NOT NULL CHECK (destination <> ''),
    key           text,
    payload       bytea       NOT NULL,
    content_type  text        NOT NULL DEFAULT 'application/octet-stream',
    headers       jsonb       NOT NULL DEFAULT '{}'::jsonb,
    status        text        NOT NULL DEFAULT 'pending'
                  CHECK (status IN ('pending', 'running', 'delivered', 'failed')),
    attempts      integer     NOT NULL DEFAULT 0,
    run_after     timestamptz NOT NULL DEFAULT now(),
    locked_by     text,
    locked_until  timestamptz,
    last_error    text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    delivered_at  timestamptz
);

-- Holds only claimable rows, so the claim stays constant-time however much delivered or
-- failed history the table keeps. Led by destination because relays claim per destination:
-- a backlog of one (paused, unknown to this relay, or ordered) is never scanned past.
CREATE INDEX outbox_claim_idx ON outbox (destination, run_after, id) WHERE status = 'pending';

-- Lets the reaper find expired leases without scanning history.
CREATE INDEX outbox_lease_idx ON outbox (locked_until) WHERE status = 'running';

-- A hot queue table: rows are inserted, updated twice and deleted quickly. Vacuum early so
-- dead tuples do not slow the claim's index scan.
ALTER TABLE outbox SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

-- One NOTIFY per committing transaction that enqueued rows: a statement-level trigger with a
-- constant payload, and PostgreSQL folds identical notifications of one transaction into one.
-- The channel is "<schema>.<table>" so relays of different outboxes do not wake each other.
CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, '');
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_notify
    AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
