-- Webhooks for many receivers: events may carry a tenant and an event type; endpoints are
-- registered at runtime (outbox_endpoints); an event of an `endpoints` destination fans out
-- into one delivery per matching endpoint (outbox_deliveries), each with its own attempts,
-- backoff and end state; every attempt is logged (outbox_attempts). Runs with search_path
-- set to the target schema, so names stay unqualified.

-- Nullable without a default: adding them rewrites nothing, whatever the table's size, and
-- rows of other destinations never pay for them.
ALTER TABLE outbox ADD COLUMN event_type text;
ALTER TABLE outbox ADD COLUMN tenant text;

CREATE TABLE outbox_endpoints (
    id                    bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    destination           text        NOT NULL CHECK (destination <> ''),
    url                   text        NOT NULL CHECK (url <> ''),
    -- NULL: the endpoint receives every tenant's events.
    tenant                text,
    -- Empty: every event type.
    event_types           text[]      NOT NULL DEFAULT '{}',
    -- 'whsec_…', or 'enc:' and a Fernet token when OUTBOX_ENDPOINT_SECRET_KEY is set.
    secret                text        NOT NULL,
    -- After a rotation the previous secret signs too, until previous_secret_until.
    previous_secret       text,
    previous_secret_until timestamptz,
    rate_limit            integer     CHECK (rate_limit IS NULL OR rate_limit > 0),
    description           text        NOT NULL DEFAULT '',
    enabled               boolean     NOT NULL DEFAULT true,
    disabled_reason       text,
    disabled_at           timestamptz,
    -- Health, kept by the relays: the first failure after the last success, and the last
    -- success. An endpoint failing since longer than its destination's disable_after is
    -- disabled.
    failing_since         timestamptz,
    last_success_at       timestamptz,
    created_at            timestamptz NOT NULL DEFAULT now(),
    updated_at            timestamptz NOT NULL DEFAULT now()
);

-- Fan-out reads the enabled endpoints of one destination.
CREATE INDEX outbox_endpoints_destination_idx ON outbox_endpoints (destination, id)
    WHERE enabled;

-- One row per (event, endpoint). No foreign keys: deleting or purging an outbox row of another
-- destination must not probe this table, and the log keeps the ids of deleted endpoints.
CREATE TABLE outbox_deliveries (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id      bigint      NOT NULL,
    endpoint_id   bigint      NOT NULL,
    destination   text        NOT NULL,
    status        text        NOT NULL DEFAULT 'pending'
                  CHECK (status IN ('pending', 'running', 'delivered', 'failed', 'cancelled')),
    attempts      integer     NOT NULL DEFAULT 0,
    run_after     timestamptz NOT NULL DEFAULT now(),
    locked_by     text,
    locked_until  timestamptz,
    -- The fencing token, as outbox.claims.
    claims        integer     NOT NULL DEFAULT 0,
    last_error    text,
    last_status   integer,
    created_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz,
    UNIQUE (event_id, endpoint_id)
);

-- The delivery claim walks one endpoint's due deliveries: a dead endpoint's backlog is never
-- scanned past by another endpoint's claim.
CREATE INDEX outbox_deliveries_claim_idx ON outbox_deliveries (endpoint_id, run_after, id)
    WHERE status = 'pending';

-- An endpoint's deliveries whatever their state: `endpoints show`, delete, replay.
CREATE INDEX outbox_deliveries_endpoint_idx ON outbox_deliveries (endpoint_id, id);

CREATE INDEX outbox_deliveries_lease_idx ON outbox_deliveries (locked_until)
    WHERE status = 'running';

-- Retention of finished deliveries.
CREATE INDEX outbox_deliveries_finished_idx ON outbox_deliveries (finished_at)
    WHERE status IN ('delivered', 'failed', 'cancelled');

-- The message log: one row per attempt, replays included.
CREATE TABLE outbox_attempts (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    delivery_id   bigint      NOT NULL,
    event_id      bigint      NOT NULL,
    endpoint_id   bigint      NOT NULL,
    at            timestamptz NOT NULL DEFAULT now(),
    http_status   integer,
    duration_ms   double precision,
    -- The first 1 KiB of the response body.
    response      text,
    error         text,
    replay        boolean     NOT NULL DEFAULT false
);

CREATE INDEX outbox_attempts_event_idx ON outbox_attempts (event_id, id);
CREATE INDEX outbox_attempts_endpoint_idx ON outbox_attempts (endpoint_id, at);
CREATE INDEX outbox_attempts_at_idx ON outbox_attempts (at);

-- Relays refresh their endpoint cache when this fires, and every few seconds anyway, so a
-- change made outside the library's functions is seen too. The channel is the outbox's own
-- ('<schema>.outbox', which fits PostgreSQL's 63 bytes for every schema name migrate takes);
-- the payload tells the relay what changed.
CREATE FUNCTION outbox_endpoints_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.outbox', 'endpoints');
    RETURN NULL;
END
$$;

-- Not on the health columns the relays write (failing_since, last_success_at): those would
-- wake every relay at each delivery outcome.
CREATE TRIGGER outbox_endpoints_notify
    AFTER INSERT OR DELETE OR UPDATE OF destination, url, tenant, event_types, secret,
        previous_secret, previous_secret_until, rate_limit, enabled
    ON outbox_endpoints
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_endpoints_notify();
