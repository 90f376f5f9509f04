"""Finding a catalog by a spec: ``module:attr`` (application code) or ``path.json`` (an export).

``module:attr`` names a ``Catalog`` or a callable taking no argument that returns one (``attr``
may be dotted); the working directory comes first on ``sys.path``, as for ``python -m``. A
``.json`` path (any case) is read by ``Catalog.load``, with no application code and no pydantic.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from outbox.catalog.catalog import Catalog
from outbox.errors import CatalogError


def load_catalog(spec: str) -> Catalog:
    if not isinstance(spec, str) or not spec.strip():
        raise CatalogError(f"a catalog spec is 'module:attr' or a .json path, got {spec!r}")
    if spec.lower().endswith(".json"):
        return Catalog.load(spec)
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise CatalogError(f"catalog {spec!r}: expected 'module:attr' or a path ending .json")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name or module_name.startswith(f"{exc.name}."):
            raise CatalogError(f"catalog {spec!r}: no module {exc.name!r}") from None
        # The module is there; something it imports is not.
        raise CatalogError(f"catalog {spec!r}: importing {module_name} failed ({exc})") from exc
    for part in attr.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise CatalogError(f"catalog {spec!r}: {module_name} has no {attr!r}") from None
    if isinstance(found, Catalog):
        return found
    if callable(found):
        made = found()
        if isinstance(made, Catalog):
            return made
        raise CatalogError(
            f"catalog {spec!r}: {attr}() returned {type(made).__name__}, not a Catalog"
        )
    raise CatalogError(f"catalog {spec!r}: {attr} is a {type(found).__name__}, not a Catalog")
