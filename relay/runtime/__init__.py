"""What runs the relay as a process: start-up checks (startup), the HTTP listener for probes
and metrics (server, probes), the event loop (loop), and the shutdown within its budget
(shutdown)."""
