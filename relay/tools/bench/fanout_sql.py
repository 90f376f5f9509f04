"""The fan-out benchmark's own statements, by name: events, endpoints and a dead endpoint's
backlog inserted in one statement each, and what a run reads back of its deliveries. Their
text, and why each is written so, is in fanout.sql beside this module."""

from __future__ import annotations

from outbox.sql import load

_q = load("relay.tools.bench", "fanout.sql", binds="numbered")

# What a run inserts (fanout_setup.py, fanout.py).
EVENTS = _q["events"]
ENDPOINTS = _q["endpoints"]
FILLER = _q["filler"]
DEAD_BACKLOG = _q["dead_backlog"]
ANALYZE_ENDPOINTS = _q["analyze_endpoints"]
COUNT_ENDPOINTS = _q["count_endpoints"]

# What a run reads back (fanout_load.py).
HEALTHY_DELIVERED = _q["healthy_delivered"]
RECORDED_LATENCY = _q["recorded_latency"]
FANNED_OUT = _q["fanned_out"]
LAST_HEALTHY = _q["last_healthy"]
RELAY_BACKENDS = _q["relay_backends"]
COUNT_EVENTS = _q["count_events"]
DELIVERIES_BY_STATUS = _q["deliveries_by_status"]
COUNT_ATTEMPTS = _q["count_attempts"]
TABLE_VERSIONS = _q["table_versions"]

# The scale scenario's statement probe (fanout.py).
PROBE_CLAIM_ALL = _q["probe_claim_all"]
TRUNCATE_PROBE = _q["truncate_probe"]
