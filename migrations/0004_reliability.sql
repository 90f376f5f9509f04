-- Fencing tokens, end-state times, a registry of live relays, and an ordering fence of the
-- table's own. Runs with search_path set to the target schema, so names stay unqualified.

-- How many times the row was claimed. A claim increments it and the relay keeps the value it
-- got: heartbeats, outcomes and releases apply only while the row still carries that value,
-- so a relay that stalled past its lease can never write over a newer claim of the row.
-- (A constant default: no table rewrite, whatever the table's size.)
ALTER TABLE outbox ADD COLUMN claims integer NOT NULL DEFAULT 0;

-- When the row reached its end state (delivered, failed or skipped); NULL while it is still
-- pending or running. Failed and skipped rows are purged by this age, not by created_at: a row
-- that failed a minute ago is a minute old to the operator, however old the event is. Rows
-- that ended before this migration (or under a relay from before it) have none and age by
-- created_at, as before; nothing is rewritten here, so the migration holds its lock briefly
-- (the index comes in 0005, built without blocking writes).
ALTER TABLE outbox ADD COLUMN finished_at timestamptz;

-- Relays register here and refresh seen_at while they run: `outbox-relay status` lists them,
-- and unknown_destinations = "fail" spares the destinations another live relay serves.
CREATE TABLE outbox_relays (
    relay_id      text        PRIMARY KEY,
    host          text,
    pid           integer,
    version       text,
    destinations  text[]      NOT NULL DEFAULT '{}',
    started_at    timestamptz NOT NULL DEFAULT now(),
    seen_at       timestamptz NOT NULL DEFAULT now(),
    stopped_at    timestamptz
);

-- The ordering fence, keyed by table. Migration 0003 keyed the lock by the sequence value
-- alone, and the fence took the smallest such lock in the whole database, so an open insert
-- into another schema's outbox held back this one's ordered destinations. The key now also
-- carries a tag of the table (bits 48-61: 1 + oid mod 16383) and the value (bits 0-47; ids
-- up to 2^48 - 1). The fence reads only its own tag (tables whose tags collide wait for each
-- other, as every table did before: slower, never unsafe).
--
-- The trigger still takes the old, untagged key as well, so relays from before this migration,
-- which read only that one, stay safe during a rolling upgrade. A relay that reads tags ignores
-- an untagged key when the same transaction also holds a tagged one, and counts it otherwise
-- (an insert that began under the old trigger).
CREATE OR REPLACE FUNCTION outbox_fence_lock() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
DECLARE
    -- SECURITY DEFINER: reading the sequence needs a privilege INSERT alone does not give.
    last bigint := least(coalesce(pg_sequence_last_value(
        pg_get_serial_sequence(quote_ident(TG_TABLE_SCHEMA) || '.' || quote_ident(TG_TABLE_NAME),
                               'id')::regclass), 0), 281474976710655);
BEGIN
    PERFORM pg_advisory_xact_lock_shared(
        4611686018427387904 + ((1 + mod(TG_RELID::bigint, 16383)) << 48) + last);
    PERFORM pg_advisory_xact_lock_shared(4611686018427387904 + last);
    RETURN NULL;
END
$$;
