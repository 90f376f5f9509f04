-- Each relay's circuit breakers that are not closed, by destination ({"billing": "open"}),
-- written with its registration every few seconds: `status` and the console show a
-- destination's circuit across relays without asking each one. A constant default: adding
-- the column rewrites nothing.
ALTER TABLE outbox_relays ADD COLUMN circuits jsonb NOT NULL DEFAULT '{}'::jsonb;
