"""Endpoints (kind = "endpoints"): the fan-out of events to one delivery per (event, endpoint),
then the deliveries' claim, outcomes, heartbeat, release and reap, and the endpoints' health.

Their text, and why each is written so, is in relay/db/queries/deliveries.sql."""

from __future__ import annotations

import zlib

from outbox.sql import load

_q = load("relay.db.queries", "deliveries.sql", binds="numbered")


def serial_key(schema: str) -> int:
    """The key of the transaction lock that orders fan-outs into ``schema``'s deliveries (see
    fan_out): one per schema, a signed 32-bit int. Another schema's key may be the same; its
    fan-outs then wait for these, and nothing else changes."""
    return int.from_bytes(zlib.crc32(schema.encode()).to_bytes(4, "big"), "big", signed=True)


def begin_locked(lock: str, serial: int) -> str:
    """BEGIN, then ``lock`` (FAN_OUT_LOCK or DELIVERY_CLAIM_LOCK, rendered) with its key
    written in: one simple query (pool.transaction), which takes no parameters. The key is
    the schema's (serial_key), a constant of the deployment rendered as its table names
    are, never a value from a row. In parentheses: ``-2147483648::int`` is read
    ``-(2147483648::int)``, out of range."""
    if "$2" in lock or "$1" not in lock:
        raise ValueError("a lock statement takes one parameter, the serial")
    return "BEGIN; " + lock.replace("$1", f"({int(serial)})")


FAN_OUT = _q["fan_out"]
FAN_OUT_LOCK = _q["fan_out_lock"]
FAN_OUT_SETTLE = _q["fan_out_settle"]
ENDPOINTS_ENABLED = _q["endpoints_enabled"]
ENDPOINTS_AHEAD = _q["endpoints_ahead"]
DELIVERY_CLAIM_LOCK = _q["delivery_claim_lock"]
DELIVERY_CLAIM = _q["delivery_claim"]
DELIVERY_FLOORS = _q["delivery_floors"]
DELIVERY_LOOK = _q["delivery_look"]
DELIVERY_RECORD = _q["delivery_record"]
DELIVERY_HEARTBEAT = _q["delivery_heartbeat"]
DELIVERY_RELEASE = _q["delivery_release"]
DELIVERY_REAP = _q["delivery_reap"]
ENDPOINT_HEALTH = _q["endpoint_health"]
ENDPOINT_DISABLE = _q["endpoint_disable"]
ENDPOINT_CIRCUIT = _q["endpoint_circuit"]
