"""Every statement the relay runs, a ``.sql`` file per domain (claim.sql, ordered.sql, …), each
a name of this package (``queries.CLAIM``).

The domains: the claim (claim, ordered), outcomes, leases, the registry, retention, gauges,
the start-up checks and the endpoints' deliveries. Each module names the statements of the
``.sql`` file beside it (claim.py those of claim.sql), where their text is, with why each is
written so (outbox/sql.py reads them). The commands' statements (status, retry, purge, …) are
in relay/ops/queries.py.

Statements name the outbox table ``{table}``, outbox_paused ``{paused}`` and outbox_relays
``{relays}``; :func:`render_ops` fills them in for a schema once, when the store is created.
Values are always bound parameters, never formatted in.
"""

from __future__ import annotations

# Statements of the outbox library the relay runs too.
from outbox.queries import NOTIFY as NOTIFY
from outbox.queries import SERVER_ENCODING as SERVER_ENCODING
from outbox.queries import TABLE_EXISTS as TABLE_EXISTS
from outbox.queries import qualified_table as qualified_table
from relay.db.queries.batches import CLAIM_BATCH as CLAIM_BATCH
from relay.db.queries.batches import CLAIM_PAST_FENCE as CLAIM_PAST_FENCE
from relay.db.queries.batches import EXPIRED_BATCHES as EXPIRED_BATCHES
from relay.db.queries.batches import FORGET_BATCHES as FORGET_BATCHES
from relay.db.queries.batches import HEARTBEAT_BATCHES as HEARTBEAT_BATCHES
from relay.db.queries.batches import REAP_BATCHES as REAP_BATCHES
from relay.db.queries.batches import RECORD_BATCH as RECORD_BATCH
from relay.db.queries.batches import RECORD_BATCH_DELETING as RECORD_BATCH_DELETING
from relay.db.queries.batches import RECORD_BATCH_DELIVERED as RECORD_BATCH_DELIVERED
from relay.db.queries.batches import (
    RECORD_BATCH_DELIVERED_DELETING as RECORD_BATCH_DELIVERED_DELETING,
)
from relay.db.queries.batches import RELEASE_BATCH as RELEASE_BATCH
from relay.db.queries.batches import SWEEP_BATCHES as SWEEP_BATCHES
from relay.db.queries.checks import COLUMN_EXISTS as COLUMN_EXISTS
from relay.db.queries.checks import INDEX_VALID as INDEX_VALID
from relay.db.queries.checks import PING as PING
from relay.db.queries.checks import TABLE_PRIVILEGE as TABLE_PRIVILEGE
from relay.db.queries.claim import CLAIM as CLAIM
from relay.db.queries.claim import CLAIM_FRESH as CLAIM_FRESH
from relay.db.queries.claim import FENCE as FENCE
from relay.db.queries.claim import FRESH_BELOW as FRESH_BELOW
from relay.db.queries.deliveries import DELIVERY_CLAIM as DELIVERY_CLAIM
from relay.db.queries.deliveries import DELIVERY_CLAIM_LOCK as DELIVERY_CLAIM_LOCK
from relay.db.queries.deliveries import DELIVERY_FLOORS as DELIVERY_FLOORS
from relay.db.queries.deliveries import DELIVERY_HEARTBEAT as DELIVERY_HEARTBEAT
from relay.db.queries.deliveries import DELIVERY_LOOK as DELIVERY_LOOK
from relay.db.queries.deliveries import DELIVERY_REAP as DELIVERY_REAP
from relay.db.queries.deliveries import DELIVERY_RECORD as DELIVERY_RECORD
from relay.db.queries.deliveries import DELIVERY_RELEASE as DELIVERY_RELEASE
from relay.db.queries.deliveries import ENDPOINT_CIRCUIT as ENDPOINT_CIRCUIT
from relay.db.queries.deliveries import ENDPOINT_DISABLE as ENDPOINT_DISABLE
from relay.db.queries.deliveries import ENDPOINT_HEALTH as ENDPOINT_HEALTH
from relay.db.queries.deliveries import ENDPOINTS_AHEAD as ENDPOINTS_AHEAD
from relay.db.queries.deliveries import ENDPOINTS_ENABLED as ENDPOINTS_ENABLED
from relay.db.queries.deliveries import FAN_OUT as FAN_OUT
from relay.db.queries.deliveries import FAN_OUT_LOCK as FAN_OUT_LOCK
from relay.db.queries.deliveries import FAN_OUT_SETTLE as FAN_OUT_SETTLE
from relay.db.queries.deliveries import begin_locked as begin_locked
from relay.db.queries.deliveries import serial_key as serial_key
from relay.db.queries.gauges import PENDING_BY_DESTINATION as PENDING_BY_DESTINATION
from relay.db.queries.gauges import SNAPSHOT_HOLDER as SNAPSHOT_HOLDER
from relay.db.queries.leases import EXPIRED as EXPIRED
from relay.db.queries.leases import HEARTBEAT as HEARTBEAT
from relay.db.queries.leases import REAP as REAP
from relay.db.queries.leases import RELEASE as RELEASE
from relay.db.queries.leases import SETTLED as SETTLED
from relay.db.queries.ordered import BLOCKED_KEYS as BLOCKED_KEYS
from relay.db.queries.ordered import CLAIM_ORDERED as CLAIM_ORDERED
from relay.db.queries.ordered import CLAIM_OWNED as CLAIM_OWNED
from relay.db.queries.ordered import OWN_ORDERED as OWN_ORDERED
from relay.db.queries.ordered import RUNNING_KEYED as RUNNING_KEYED
from relay.db.queries.ordered import STILL_RUNNING as STILL_RUNNING
from relay.db.queries.ordered import UNOWNED_PEERS as UNOWNED_PEERS
from relay.db.queries.outcomes import RECORD as RECORD
from relay.db.queries.outcomes import RECORD_DELETING as RECORD_DELETING
from relay.db.queries.outcomes import RECORD_DELIVERED as RECORD_DELIVERED
from relay.db.queries.outcomes import RECORD_DELIVERED_DELETING as RECORD_DELIVERED_DELETING
from relay.db.queries.registry import FAIL_UNKNOWN_DESTINATIONS as FAIL_UNKNOWN_DESTINATIONS
from relay.db.queries.registry import FORGET_RELAYS as FORGET_RELAYS
from relay.db.queries.registry import MIXED_CLAIMS as MIXED_CLAIMS
from relay.db.queries.registry import PAUSED as PAUSED
from relay.db.queries.registry import REGISTER as REGISTER
from relay.db.queries.registry import SETTLING_HOLDER as SETTLING_HOLDER
from relay.db.queries.registry import SETTLING_LOCK as SETTLING_LOCK
from relay.db.queries.registry import TRY_JOB_LOCK as TRY_JOB_LOCK
from relay.db.queries.registry import UNKNOWN_DESTINATIONS as UNKNOWN_DESTINATIONS
from relay.db.queries.registry import UNREGISTER as UNREGISTER
from relay.db.queries.render import BATCHES_TABLE as BATCHES_TABLE
from relay.db.queries.render import PAUSED_TABLE as PAUSED_TABLE
from relay.db.queries.render import RELAYS_TABLE as RELAYS_TABLE
from relay.db.queries.render import render_ops as render_ops
from relay.db.queries.retention import DELETE_LOCKED as DELETE_LOCKED
from relay.db.queries.retention import PURGE_ATTEMPTS as PURGE_ATTEMPTS
from relay.db.queries.retention import PURGE_DELIVERED as PURGE_DELIVERED
from relay.db.queries.retention import PURGE_DELIVERIES as PURGE_DELIVERIES
from relay.db.queries.retention import PURGE_FINISHED as PURGE_FINISHED
from relay.db.queries.retention import RETENTION_DELIVERED as RETENTION_DELIVERED
