"""outbox: write events in the same transaction as your business change.

    async with session.begin():
        session.add(order)
        await outbox.enqueue(session, destination="orders", key=str(order.id),
                             payload={"type": "order.created", "id": order.id})

The relay (``outbox-relay run``) delivers them afterwards, at least once, each carrying its
row id (``outbox-id`` / ``webhook-id``) so consumers can deduplicate.

The names below load on first use: the relay and its commands import parts of this package
(URLs, SQL, statuses) without paying for SQLAlchemy.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox import catalog as catalog
    from outbox import django as django
    from outbox import endpoints as endpoints
    from outbox import inbox as inbox
    from outbox.errors import EventSchemaError, OutboxError, OutboxValidationError
    from outbox.message import DEFAULT_MAX_PAYLOAD_BYTES
    from outbox.schema import (
        define_outbox_table,
        define_paused_table,
        define_relays_table,
        metadata,
        outbox_table,
        paused_table,
        relays_table,
    )
    from outbox.status import Status
    from outbox.writer import (
        EventSpec,
        Outbox,
        enqueue,
        enqueue_many,
        enqueue_many_sync,
        enqueue_sync,
    )

# Each public name, and the module that defines it.
_HOMES = {
    "DEFAULT_MAX_PAYLOAD_BYTES": "outbox.message",
    "EventSchemaError": "outbox.errors",
    "EventSpec": "outbox.writer",
    "Outbox": "outbox.writer",
    "OutboxError": "outbox.errors",
    "OutboxValidationError": "outbox.errors",
    "Status": "outbox.status",
    "define_outbox_table": "outbox.schema",
    "define_paused_table": "outbox.schema",
    "define_relays_table": "outbox.schema",
    "enqueue": "outbox.writer",
    "enqueue_many": "outbox.writer",
    "enqueue_many_sync": "outbox.writer",
    "enqueue_sync": "outbox.writer",
    "metadata": "outbox.schema",
    "outbox_table": "outbox.schema",
    "paused_table": "outbox.schema",
    "relays_table": "outbox.schema",
}

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "EventSchemaError",
    "EventSpec",
    "Outbox",
    "OutboxError",
    "OutboxValidationError",
    "Status",
    "define_outbox_table",
    "define_paused_table",
    "define_relays_table",
    "enqueue",
    "enqueue_many",
    "enqueue_many_sync",
    "enqueue_sync",
    "metadata",
    "outbox_table",
    "paused_table",
    "relays_table",
]
assert sorted(__all__) == sorted(_HOMES)

# Modules reached as attributes: outbox.endpoints.create(...), outbox.inbox.mark(...),
# outbox.catalog.use(...) (its validator, jsonschema-rs, loads only when a type checks).
_SUBMODULES = frozenset({"catalog", "endpoints", "inbox", "django"})

# Those that need an optional extra (outbox.django: Django). Without it they are no attribute,
# so dir() and inspect, which try every name, keep working; the message names the extra.
_EXTRAS = {"django": "django"}


if not TYPE_CHECKING:
    # Hidden from type checkers, which then see only the imports above: a misspelt name
    # (outbox.enqeue) stays an error for them instead of becoming Any.

    def __getattr__(name: str) -> Any:
        if name in _SUBMODULES:
            try:
                return importlib.import_module(f"outbox.{name}")
            except ModuleNotFoundError as exc:
                if name not in _EXTRAS or exc.name != _EXTRAS[name]:
                    raise
                raise AttributeError(
                    f"outbox.{name} needs {exc.name}: pip install 'outbox-relay[{name}]'"
                ) from exc
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module 'outbox' has no attribute {name!r}")
        module = importlib.import_module(home)
        # Every name of that module, found directly from now on.
        for other, where in _HOMES.items():
            if where == home:
                globals()[other] = getattr(module, other)
        return globals()[name]

    def __dir__() -> list[str]:
        loaded = {k for k, v in globals().items() if isinstance(v, ModuleType)}
        return sorted({*__all__, *_SUBMODULES, *(k for k in loaded if k not in ("importlib",))})
