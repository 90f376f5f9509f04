-- Operations: paused destinations, and fast retention of delivered rows.
-- Runs with search_path set to the target schema, so names stay unqualified here.

-- A destination listed here is not claimed by any relay; its rows wait as pending.
-- Relays re-read this table about once per poll interval.
CREATE TABLE outbox_paused (
    destination  text        PRIMARY KEY CHECK (destination <> ''),
    paused_at    timestamptz NOT NULL DEFAULT now(),
    paused_by    text,
    reason       text
);

-- Lets retention and `purge` find delivered rows past their retention without scanning the
-- table. With retention = 0 delivered rows are deleted at once and this index stays empty.
CREATE INDEX outbox_delivered_idx ON outbox (delivered_at) WHERE status = 'delivered';
