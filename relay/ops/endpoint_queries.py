"""The statements of `endpoints show` and `endpoints delete`'s question, by name: an endpoint's
deliveries and newest attempts. Their text is in relay/ops/endpoints.sql; loaded as
relay/ops/queries.py says. The endpoints themselves are read and changed by outbox.endpoints'
own statements."""

from __future__ import annotations

from outbox.sql import load

_q = load("relay.ops", "endpoints.sql", binds="numbered")

ENDPOINT_DELIVERIES = _q["endpoint_deliveries"]
ENDPOINT_RECENT_ATTEMPTS = _q["endpoint_recent_attempts"]
