"""The catalog seen from the relay: the AsyncAPI document of a catalog's event types as the
relay's configuration delivers them (:func:`build`, :func:`render`)."""

from __future__ import annotations

from relay.catalog.asyncapi import build, render

__all__ = ["build", "render"]
