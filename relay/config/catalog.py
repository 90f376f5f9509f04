"""``[catalog]``: where the relay and its commands find the application's event catalog
(``outbox.catalog``, docs/catalog.md), and what the AsyncAPI document built from it names."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from relay.config.base import Section

# module.path:attr.path, or a file ending in .json (an export): checked here so that a typo is
# a configuration error naming the key, not an import error at the first page.
_MODULE_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def check_spec(spec: str) -> str:
    """``spec`` if it is ``module:attr`` or a path ending in ``.json``; ValueError otherwise."""
    if spec.endswith(".json") or _MODULE_SPEC.fullmatch(spec):
        return spec
    raise ValueError(
        f"catalog source {spec!r}: give module:attr (shop.events:catalog) or the path of a "
        "file written by `outbox-relay catalog export` (catalog.json)"
    )


class CatalogSettings(Section):
    """The event catalog (issue #31): the types the application declares, shown by the
    console and the portal and published as an AsyncAPI document."""

    source: str | None = Field(
        None,
        description="the catalog: `module:attr` (imported, the working directory first on the "
        "path) or a `.json` file written by `outbox-relay catalog export`",
    )
    kafka_host: str | None = Field(
        None,
        description="the Kafka server the AsyncAPI document names (default: the first of "
        "kafka.bootstrap_servers)",
    )
    webhook_paths: bool = Field(
        False,
        description="name a webhook destination's URL path in the AsyncAPI document (off: its "
        "origin only; a path may hold a token)",
    )

    @field_validator("source")
    @classmethod
    def _spec(cls, v: str | None) -> str | None:
        return None if v is None else check_spec(v)

    @field_validator("kafka_host")
    @classmethod
    def _host(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9.\-\[\]:]+", v):
            raise ValueError(f"kafka_host {v!r}: give host[:port], nothing more")
        return v
