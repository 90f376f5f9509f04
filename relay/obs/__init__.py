"""What the relay says about itself: metrics, logs, traces, and the scrubbing of secrets out
of everything it prints (scrub)."""
