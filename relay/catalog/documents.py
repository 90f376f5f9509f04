"""What ``catalog check --against`` compares with: the previous release's AsyncAPI document (as
``catalog asyncapi`` wrote it) or its export (as ``catalog export`` wrote it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relay.catalog.asyncapi import CATALOG_EXTENSION

EXPORT_FORMAT = "outbox-catalog/1"
# A previous release's document or export larger than this is not one of ours.
MAX_BYTES = 64 * 1024 * 1024


def read_previous(path: Path) -> dict[str, Any]:
    """The catalog export held by ``path``: the file itself, or the ``x-outbox-catalog`` of an
    AsyncAPI document of ours. ValueError naming what the file is instead."""
    try:
        if path.stat().st_size > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES:,} bytes")
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    if isinstance(data, dict) and "asyncapi" in data:
        try:
            found = json.loads(data.get(CATALOG_EXTENSION) or "null")
        except (TypeError, ValueError, RecursionError):
            found = None
        if isinstance(found, dict) and isinstance(found.get("types"), list):
            # The document leaves out where each type was declared and its validation mode
            # (relay.catalog.asyncapi._PRIVATE): neither is compared.
            for t in found["types"]:
                if isinstance(t, dict):
                    t.setdefault("origin", f"asyncapi:{path.name}")
                    t.setdefault("validate", None)
        if not isinstance(found, dict):
            raise ValueError(
                f"{path}: an AsyncAPI document without {CATALOG_EXTENSION}: not written by "
                "`outbox-relay catalog asyncapi` (give that, or a `catalog export`)"
            )
        data = found
    if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
        raise ValueError(
            f"{path}: neither an AsyncAPI document of `outbox-relay catalog asyncapi` nor a "
            f"catalog export (format {EXPORT_FORMAT!r})"
        )
    if not isinstance(data.get("types"), list):
        raise ValueError(f"{path}: a catalog export without its list of types")
    from outbox.catalog import Catalog
    from outbox.errors import CatalogError

    try:  # every type as an export holds it, or compare() would judge garbage
        return Catalog.load(data).export()
    except (CatalogError, RecursionError) as exc:
        raise ValueError(f"{path}: {exc}") from None
