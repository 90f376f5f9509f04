"""The statements of ordered destinations: the claim that walks their keys, the owner's claim
and its session lock (relay/pipeline/ordered.py), and the keys held up by a failed row.

Their text, and why each is written so, is in relay/db/queries/ordered.sql."""

from __future__ import annotations

from outbox.sql import load

_q = load("relay.db.queries", "ordered.sql", binds="numbered")

CLAIM_ORDERED = _q["claim_ordered"]
OWN_ORDERED = _q["own_ordered"]
RUNNING_KEYED = _q["running_keyed"]
STILL_RUNNING = _q["still_running"]
UNOWNED_PEERS = _q["unowned_peers"]
CLAIM_OWNED = _q["claim_owned"]
BLOCKED_KEYS = _q["blocked_keys"]
