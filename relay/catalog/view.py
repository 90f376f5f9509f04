"""The event catalog as the operator console and the tenant portal show it: a
:class:`CatalogView` holds the catalog's export (loaded once, at start) and builds the AsyncAPI
document from the relay's configuration on first request.

:func:`load_view` never raises: the catalog is the application's code or a file beside it,
and a catalog that cannot be loaded must not stop the relay's delivery. It is logged
(``relay.catalog.unavailable``) and the view says why on the pages.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import structlog

from relay.config.settings import Settings
from relay.obs import scrub

log = structlog.get_logger("relay.catalog")

# How long the relay's start waits for the application's catalog module to load.
LOAD_SECONDS = 10.0

Json = dict[str, Any]


@dataclass
class CatalogView:
    """The catalog named by ``spec``: its export (``outbox.catalog`` ``Catalog.export()``),
    or, when it could not be loaded, ``error`` saying why and no type."""

    spec: str
    export: Mapping[str, Any]
    settings: Settings | None = field(default=None, repr=False)
    error: str | None = None
    _document: str | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def available(self) -> bool:
        return self.error is None

    @property
    def types(self) -> list[Json]:
        """The declared types, by name (the export's order)."""
        return list(self.export.get("types") or [])

    def names(self) -> frozenset[str]:
        return frozenset(str(t["name"]) for t in self.types)

    def for_destinations(self, destinations: Iterable[str]) -> list[Json]:
        """The types carried by any of ``destinations``."""
        wanted = set(destinations)
        return [t for t in self.types if wanted & set(t["destinations"])]

    def declared(self) -> dict[str, frozenset[str]]:
        """For each destination the catalog names, the names of the types declared for it."""
        found: dict[str, set[str]] = {}
        for t in self.types:
            for d in t["destinations"]:
                found.setdefault(str(d), set()).add(str(t["name"]))
        return {d: frozenset(names) for d, names in found.items()}

    def channel(self, destination: str) -> str:
        """How ``destination`` carries its types, in a few words (from the configuration)."""
        if self.settings is None:
            return ""
        d = self.settings.destinations.get(destination)
        if d is None:
            return "not a destination of this relay"
        kind = str(getattr(d, "kind", "?"))
        if kind == "kafka":
            return f"Kafka topic {getattr(d, 'topic', '?')}"
        if kind == "webhook":
            return f"webhook to {_origin(str(getattr(d, 'url', '')))}"
        if kind == "endpoints":
            return "endpoints (webhooks registered per tenant)"
        return kind

    def asyncapi(self) -> str | None:
        """The AsyncAPI document, as ``outbox-relay catalog asyncapi`` prints it for the same
        configuration and catalog; None without the configuration (its destinations are the
        document's channels). Built on first use, then kept."""
        if self.settings is None or not self.available:
            return None
        with self._lock:
            if self._document is None:
                from relay.catalog.asyncapi import build, render

                options = self.settings.catalog
                try:
                    self._document = render(
                        build(
                            self.export,
                            self.settings,
                            kafka_host=options.kafka_host,
                            webhook_paths=options.webhook_paths,
                        )
                    )
                except ValueError as exc:  # a hand-edited export the document cannot say
                    self.error = f"no AsyncAPI document: {exc}"
                    return None
            return self._document


def load_view(spec: str | None, settings: Settings | None) -> CatalogView | None:
    """The catalog ``spec`` names (``module:attr`` or a ``.json`` export), else the
    ``[catalog] source`` of ``settings``; None when neither names one. A catalog that fails
    to load is logged and given as a view holding the reason, never raised."""
    if spec is None and settings is not None:
        spec = settings.catalog.source
    if spec is None:
        return None
    try:
        export = _load_within(spec, LOAD_SECONDS)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the application's module may raise anything, exit too
        reason = scrub.scrub(_reason(exc))
        log.error(
            "relay.catalog.unavailable",
            spec=spec,
            error=reason,
            action="the console and the portal show no event type until the relay restarts "
            "with a catalog that loads; delivery goes on",
        )
        return CatalogView(spec, {"types": []}, settings, error=reason)
    return CatalogView(spec, export, settings)


def _load_within(spec: str, seconds: float) -> Mapping[str, Any]:
    """The export of the catalog ``spec`` names, loaded in a thread of its own: a module that
    hangs at import (a connection without a timeout) holds the relay's start ``seconds`` at
    most, then is left behind (a daemon thread: it never holds the relay's exit either)."""
    from outbox.catalog import load_catalog

    done: list[Mapping[str, Any]] = []
    failed: list[BaseException] = []

    def load() -> None:
        try:
            done.append(load_catalog(spec).export())
        except BaseException as exc:  # given to the caller, which says what it was
            failed.append(exc)

    thread = threading.Thread(target=load, name="outbox-relay-catalog", daemon=True)
    thread.start()
    thread.join(seconds)
    if failed:
        raise failed[0]
    if not done:
        raise TimeoutError(f"the catalog did not load within {seconds:g} s (its module hangs?)")
    return done[0]


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, ValueError | LookupError | OSError):
        return text
    return f"{type(exc).__name__}: {text}"


def _origin(url: str) -> str:
    """``scheme://host[:port]``: never the path, query or credentials (a token may be there)."""
    try:
        parts = urlsplit(url)
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "(unreadable URL)"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}{port}"
