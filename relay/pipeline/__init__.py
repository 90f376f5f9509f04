"""A row's way through the relay: woken by a NOTIFY (listener), claimed (claimer; ordered
destinations by their owner, ordered), sent to its sink (sending), its outcome decided
(relay/outcomes.py, relay/backoff.py, shared with the endpoints sink) and recorded
(completer), held under a lease until then (leases), along the routes built at start-up
(routes)."""
