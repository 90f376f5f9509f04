"""The statements of the operations commands (status, show, list, retry, purge, pause, skip),
by name: their text, and why each is written so, is in relay/ops/queries.sql (replay's in
relay/ops/replay.sql, the endpoints commands' in relay/ops/endpoints.sql); see
relay/db/queries/ for how ``{table}``, ``{paused}`` and ``{relays}`` are filled in, and
outbox.queries.render_endpoints for ``{deliveries}`` and ``{attempts}``.

Each statement is a name of this module (``queries.STATUS_COUNTS``), assigned from the file
one by one rather than looked up by a module ``__getattr__``: mypy strict sees every name as
the ``str`` it is (a misspelt one is an error), and a grep for a name finds where it is
defined. tests/test_sql_files.py checks that the file's statements and these names match."""

from __future__ import annotations

from outbox.sql import load
from relay.db.queries import BATCHES_TABLE as BATCHES_TABLE

# The relay's statements the commands run too.
from relay.db.queries import BLOCKED_KEYS as BLOCKED_KEYS
from relay.db.queries import COLUMN_EXISTS as COLUMN_EXISTS
from relay.db.queries import DELETE_LOCKED as DELETE_LOCKED
from relay.db.queries import NOTIFY as NOTIFY
from relay.db.queries import PAUSED_TABLE as PAUSED_TABLE
from relay.db.queries import PURGE_DELIVERED as PURGE_DELIVERED
from relay.db.queries import PURGE_FINISHED as PURGE_FINISHED
from relay.db.queries import RELAYS_TABLE as RELAYS_TABLE
from relay.db.queries import TABLE_EXISTS as TABLE_EXISTS
from relay.db.queries import qualified_table as qualified_table
from relay.db.queries import render_ops as render_ops

_q = load("relay.ops", "queries.sql", binds="numbered")

# status
JIT_OFF = _q["jit_off"]
PAUSED_DETAIL = _q["paused_detail"]
RELAYS = _q["relays"]
STATUS_COUNTS = _q["status_counts"]
STATUS_BATCHED = _q["status_batched"]
STATUS_ENDED = _q["status_ended"]
STATUS_DELIVERED_PROBE = _q["status_delivered_probe"]
STATUS_DELIVERED = _q["status_delivered"]
STATUS_DELIVERED_LATEST = _q["status_delivered_latest"]
STATUS_ESTIMATE = _q["status_estimate"]
STATUS_LEASES = _q["status_leases"]
STATUS_BLOCKED_KEYS = _q["status_blocked_keys"]
STATUS_ENDPOINTS = _q["status_endpoints"]

# pause, resume, skip
PAUSE = _q["pause"]
RESUME = _q["resume"]
SKIP = _q["skip"]
NOTIFY_ENDPOINTS = _q["notify_endpoints"]

# show, list
SHOW = _q["show"]
SHOW_DELIVERIES = _q["show_deliveries"]
SHOW_ATTEMPTS = _q["show_attempts"]
LIST = _q["list"]
LIST_GATHERED = _q["list_gathered"]

# retry
RETRY_SELECTION = _q["retry_selection"]
RETRY_PREVIEW = _q["retry_preview"]
RETRY = _q["retry"]

# purge
PURGE_PREVIEW = _q["purge_preview"]
PURGE_SELECTION = _q["purge_selection"]
PURGE_SELECTED_DELIVERED = _q["purge_selected_delivered"]
PURGE_SELECTED_FINISHED = _q["purge_selected_finished"]

# What the commands check first: the rows named, and whether the endpoint tables are there.
ID_STATUSES = _q["id_statuses"]
ENDPOINT_TABLES_EXIST = _q["endpoint_tables_exist"]

# The statuses `list` gathers through their partial index first (queries.sql, list_gathered).
LIST_GATHERED_STATUSES = ("running", "failed", "skipped")

# A filter of `list` and its condition, joined into the {where} of list and list_gathered; {}
# is the bound value's placeholder ($n). Conditions, not statements: they stay beside the code
# that joins them.
LIST_FILTERS = {
    "destination": "destination = {}",
    "key": "key = {}",
    "tenant": "tenant = {}",
    "event_type": "event_type = {}",
    "error_like": "last_error ILIKE {}",
    "min_id": "id >= {}",
    "max_id": "id <= {}",
    "before_id": "id < {}",
}
