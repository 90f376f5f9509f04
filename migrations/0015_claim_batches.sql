-- Batch leases (relay.claims = "batch"): a claim of an unordered destination's fresh rows writes
-- one row here instead of a new version of each row it takes. The rows stay as they were
-- written (pending, claims = 0) until their outcome is recorded, fenced by this lease: the
-- batch's id is their fencing token (negated, so it cannot be taken for a row's `claims`).
-- Under a held snapshot a delivered event then leaves one dead row version, not two.
--
-- A destination's batches form a chain in id order: each begins where the one before ended
-- (first_id, the last_id before it), so where the next claim begins is the last_id of the
-- batch with the highest first_id, and (destination, epoch, first_id) is unique: two claims
-- that read the same end of the chain (one of them on a snapshot older than the other's
-- commit) cannot both add to it; the later one takes no fresh rows. `epoch` is the table's
-- file (pg_relation_filenode): a TRUNCATE starts a new chain. `relay` is NULL once the
-- batch's lease has ended and the reaper has put back what it had not recorded.
-- A new table: nothing of the outbox is locked or rewritten.
CREATE TABLE outbox_batches (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    destination text NOT NULL,
    epoch bigint NOT NULL,
    first_id bigint NOT NULL,
    last_id bigint NOT NULL,
    relay text,
    lease_until timestamptz NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT outbox_batches_chain_key UNIQUE (destination, epoch, first_id),
    CONSTRAINT outbox_batches_range_check CHECK (last_id > first_id)
);

-- The reaper's: leases that may have expired with rows not recorded.
CREATE INDEX outbox_batches_lease_idx ON outbox_batches (lease_until)
    WHERE relay IS NOT NULL;

