"""What operators run against the outbox tables, relay running or not: status, show, retry,
purge, pause/resume and skip (the CLI's commands, relay/cli/ops.py, call these)."""
