"""What operators run against the outbox tables, relay running or not: status, show and list,
retry, replay, purge, pause/resume and skip, and the webhook endpoints' registrations, each
returning a typed result (``to_json()``: what ``--json`` prints). The commands (relay/cli/ops/,
relay/cli/endpoints/) and the console (relay/ui/) both call them."""
