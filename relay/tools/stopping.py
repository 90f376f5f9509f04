"""Tools that start things (a scratch database, a local broker, receivers) stop cleanly on
SIGTERM as on Ctrl-C: `timeout`, a CI job cancelled, or `kill` leave nothing behind."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

import click

from relay.runtime import loop

T = TypeVar("T")

# A process ended by SIGTERM exits 128 + 15, as a shell reports it.
EXIT_SIGTERM = 143


def run_tool(main: Coroutine[Any, Any, T], choice: loop.Choice, command: str) -> T:
    """Run a tool's coroutine; on SIGTERM, cancel it (its clean-up runs) and exit 143."""
    try:
        return loop.run(main, choice, sigterm_cancels=True)
    except loop.Terminated:
        click.echo(
            f"outbox-relay {command}: stopped by SIGTERM; what it started (scratch database, "
            "local broker, receivers) was stopped and removed",
            err=True,
        )
        raise SystemExit(EXIT_SIGTERM) from None
