-- What ends a holder of the database's xmin horizon, as `status`, the console and the relay's
-- warning print it (SnapshotHolder.action in relay/db/snapshots.py, which names them): commands
-- for an operator to run once they know the holder is not needed, never run by the relay.
-- {slot} and {gid} are filled in with the slot's name or the prepared transaction's gid as an
-- SQL string literal (single quotes doubled), {pid} with the backend's pid.

-- name: drop_replication_slot
-- A standby's hot_standby_feedback holds the horizon through its slot: for a standby gone.
SELECT pg_drop_replication_slot({slot})

-- name: commit_prepared
-- A prepared transaction: committed or rolled back, as its transaction manager wants (in its
-- own database).
COMMIT PREPARED {gid}

-- name: rollback_prepared
ROLLBACK PREPARED {gid}

-- name: terminate_backend
-- A backend: its snapshot or its transaction.
SELECT pg_terminate_backend({pid})
