-- The consumer's inbox: which events each consumer has applied. Delivery is at-least-once, so
-- a consumer records (consumer, event id) in the transaction of its own effect, with
-- INSERT ... ON CONFLICT DO NOTHING RETURNING: a row back means the event is new and the
-- effect is applied; none means it was applied before, and the redelivery changes nothing.
-- The effect and the mark commit together or not at all (outbox.inbox). Runs with
-- search_path set to the target schema, so names stay unqualified here.

-- Ids are text: a Kafka `outbox-id` and a `webhook-id` are decimal strings, a CloudEvents id
-- any string. They are unique per outbox (or per CloudEvents source), not across them: a
-- consumer of several sources uses one consumer name per source.
CREATE TABLE outbox_inbox (
    consumer    text        NOT NULL CHECK (consumer <> ''),
    event_id    text        NOT NULL CHECK (event_id <> ''),
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- Retention (outbox.inbox.purge_inbox) deletes the oldest marks in bounded batches.
CREATE INDEX outbox_inbox_received_idx ON outbox_inbox (received_at);
