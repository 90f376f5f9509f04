"""The operations commands: status, show, list, retry, replay, purge, pause, resume, skip. Each
calls the typed operations of relay/ops and prints their result, as text (relay/cli/render.py)
or ``--json``. Those that change many rows or lose them (retry by filter, purge, skip) show
what they will touch and ask first, on a terminal; elsewhere they need --yes."""
