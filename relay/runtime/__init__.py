"""What runs the relay as a process: start-up checks (startup), the HTTP listener for probes
and metrics (server, probes), the event loop (loop), what is kept per source of claimable rows
(pipes), and the shutdown within its budget (shutdown)."""
