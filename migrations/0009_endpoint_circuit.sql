-- An endpoint's circuit, as the relays see it: a relay whose circuit breaker for the endpoint
-- opens writes until when it stays open, and clears it when it closes again, so that
-- `outbox-relay status` (and the console) can show it without asking each relay. NULL: no
-- relay has it open. Nullable without a default: adding it rewrites nothing. Not among the
-- columns whose change NOTIFYs the relays (migration 0006's trigger): relays write it.
ALTER TABLE outbox_endpoints ADD COLUMN circuit_open_until timestamptz;
