-- The xmax of each batch claim's snapshot (relay.claims = "batch"): the first transaction id
-- the claim did not see. Every row the claim took was written by a transaction it saw
-- committed, so older than this; a row written by a later transaction is no row of the batch
-- but one that was given an id of its range again (a setval over rows in flight deleted by
-- hand), and its relay's outcome must not land on it (relay/db/queries/batches.sql). The
-- batch's own xmin cannot say it: every heartbeat writes a new version of the batch row.
-- NULL for batches claimed before this migration or by a relay of an earlier release (which
-- never reads it): their outcomes are fenced as before. A column without a default: nothing
-- is rewritten, and the lock on outbox_batches is held for an instant.
ALTER TABLE outbox_batches ADD COLUMN IF NOT EXISTS snapshot_xmax xid;
