"""Endpoints (kind = "endpoints"): the fan-out of events to one delivery per (event, endpoint),
then the deliveries' claim, outcomes, heartbeat, release and reap, and the endpoints' health.

Their text, and why each is written so, is in relay/db/queries/deliveries.sql."""

from __future__ import annotations

from outbox.sql import load

_q = load("relay.db.queries", "deliveries.sql", binds="numbered")

FAN_OUT = _q["fan_out"]
DELIVERY_CLAIM = _q["delivery_claim"]
DELIVERY_RECORD = _q["delivery_record"]
DELIVERY_HEARTBEAT = _q["delivery_heartbeat"]
DELIVERY_RELEASE = _q["delivery_release"]
DELIVERY_REAP = _q["delivery_reap"]
ENDPOINT_HEALTH = _q["endpoint_health"]
ENDPOINT_DISABLE = _q["endpoint_disable"]
ENDPOINT_CIRCUIT = _q["endpoint_circuit"]
