"""A row's way through the relay: woken by a NOTIFY (listener), claimed (claimer; ordered
destinations by their owner, ordered), sent to its sink (sending), its outcome decided
(outcomes, backoff) and recorded (completer), held under a lease until then (leases), along
the routes built at start-up (routes)."""
