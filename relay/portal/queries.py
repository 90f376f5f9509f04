"""The tenant portal's statements, by name. Their text, the tenant's scope that starts each,
and why each is written so, is in relay/portal/queries.sql."""

from __future__ import annotations

from outbox.sql import load

_q = load("relay.portal", "queries.sql", binds="numbered")

ENDPOINTS = _q["endpoints"]
ENDPOINT_COUNTS = _q["endpoint_counts"]
MESSAGES = _q["messages"]
MESSAGE = _q["message"]
ATTEMPTS = _q["attempts"]
ENDPOINT_LOCK = _q["endpoint_lock"]
ENDPOINTS_COUNTED = _q["endpoints_counted"]
TEST_SEND = _q["test_send"]
