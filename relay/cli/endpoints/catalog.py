"""The event catalog's word on `endpoints add|update --event-type`: warnings on stderr, never a
refusal (an endpoint may be registered ahead of the release that declares its type)."""

from __future__ import annotations

import contextlib
import sys

from relay.cli.render import echo_lines
from relay.obs import scrub


def warn_event_types(
    spec: str | None, destination: str | None, event_types: tuple[str, ...]
) -> None:
    """Say on stderr which of ``event_types`` the catalog ``spec`` names does not declare for
    ``destination`` (relay.catalog.checks.type_warnings); nothing without a catalog or a type.
    A catalog that cannot be loaded is a warning too: the endpoint is still registered."""
    if spec is None or not event_types:
        return
    from outbox.catalog import load_catalog
    from relay.catalog.checks import type_warnings

    try:
        # What the application's module prints at import must not reach --json's stdout.
        with contextlib.redirect_stdout(sys.stderr):
            exported = load_catalog(spec).export()
    except Exception as exc:  # the application's module may raise anything
        echo_lines(
            f"outbox-relay: warning: cannot load the catalog {spec!r} ({type(exc).__name__}: "
            f"{scrub.scrub(str(exc))}); event types not checked",
            err=True,
        )
        return
    for text in type_warnings(exported, destination, event_types):
        echo_lines(
            f"outbox-relay: warning: {text} ({spec}); the endpoint takes it anyway", err=True
        )
