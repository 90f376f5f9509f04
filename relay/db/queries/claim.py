"""The claim of an unordered destination (its two lanes, fresh and waiting rows), the fence it
reads first, and the check for fresh rows below where its claims have seen every one.

Their text, and why each is written so, is in relay/db/queries/claim.sql."""

from __future__ import annotations

from outbox.sql import load

_q = load("relay.db.queries", "claim.sql", binds="numbered")

CLAIM = _q["claim"]
CLAIM_FRESH = _q["claim_fresh"]
FRESH_BELOW = _q["fresh_below"]
FENCE = _q["fence"]
