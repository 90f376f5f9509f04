-- What a relay can do, beside what it serves: a relay that claims ordered destinations as their
-- owner (one relay at a time per destination, see relay/ordered.py) registers 'ordered-owner',
-- and features_at = seen_at at each registration. A relay of an earlier release writes no
-- feature (the default), and one rolled back under the same relay_id updates seen_at but not
-- features_at; while one such relay serves an ordered destination its owner claims the way
-- those relays do (CLAIM_ORDERED), because only that way does each see the other's rows in
-- flight. Adding columns with a constant default rewrites nothing (PostgreSQL 11+); the table
-- is a row per relay.
ALTER TABLE outbox_relays ADD COLUMN IF NOT EXISTS features text[] NOT NULL DEFAULT '{}';
ALTER TABLE outbox_relays ADD COLUMN IF NOT EXISTS features_at timestamptz;
