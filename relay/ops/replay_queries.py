"""The statements of `replay`, by name: an event's deliveries put back to pending (or one
added), an endpoint's deliveries of a window, and the selection that confirms a preview of
them. Their text, and why each is written so, is in relay/ops/replay.sql; loaded as
relay/ops/queries.py says."""

from __future__ import annotations

from outbox.sql import load

_q = load("relay.ops", "replay.sql", binds="numbered")

REPLAY_EVENT_ROW = _q["replay_event_row"]
REPLAY_ENDPOINT_ROW = _q["replay_endpoint_row"]
REPLAY_EVENT = _q["replay_event"]
REPLAY_EVENT_INSERT = _q["replay_event_insert"]
REPLAY_ENDPOINT_SELECTION = _q["replay_endpoint_selection"]
REPLAY_ENDPOINT_PREVIEW = _q["replay_endpoint_preview"]
REPLAY_ENDPOINT = _q["replay_endpoint"]
REPLAY_ENDPOINT_WITHIN = _q["replay_endpoint_within"]
