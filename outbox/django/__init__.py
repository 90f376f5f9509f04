"""Enqueue from Django, in the ``transaction.atomic()`` block of the business change.

    # settings.py
    INSTALLED_APPS = [..., "outbox.django"]  # for `python manage.py outbox_migrate`

    # anywhere in the application
    from django.db import transaction
    from outbox.django import enqueue

    with transaction.atomic():
        order = Order.objects.create(total=10)
        enqueue(destination="orders", key=str(order.pk), payload={"id": order.pk})

The insert runs through Django's own cursor of ``connections[using]``: it belongs to the
block's transaction (to its savepoint, in a nested block), whether Django drives psycopg 3 or
psycopg2, and Django's query logging and test assertions see it. No ``on_commit`` hook is
needed: the event is a row of the transaction, invisible to the relay until it commits.

Settings: ``OUTBOX_SCHEMA`` (default ``"public"``) and ``OUTBOX_MAX_PAYLOAD_BYTES`` (default
1,000,000), as ``outbox.Outbox(schema, max_payload_bytes=...)`` takes them; ``OUTBOX_CATALOG``
(default none), the event catalog that checks typed events: a ``Catalog``, or a spec,
``"shop.events:catalog"`` or the path of a catalog's ``.json`` export (``load_catalog``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache

try:
    from django.conf import settings  # type: ignore[import-untyped]
    from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]
    from django.db import DEFAULT_DB_ALIAS, connections  # type: ignore[import-untyped]
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installation
    if exc.name != "django":
        raise
    raise ModuleNotFoundError(
        "outbox.django needs Django: pip install 'outbox-relay[django]'", name="django"
    ) from exc

from outbox.errors import OutboxError
from outbox.message import DEFAULT_MAX_PAYLOAD_BYTES, Payload
from outbox.writer import EventSpec, Outbox, _Statement

__all__ = ["enqueue", "enqueue_many"]


def enqueue(
    *,
    destination: str,
    payload: Payload,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    run_after: datetime | None = None,
    content_type: str | None = None,
    event_type: str | None = None,
    tenant: str | None = None,
    using: str | None = None,
) -> int:
    """Add one event to the open ``atomic()`` block of database ``using`` (default:
    ``"default"``) and return its id. The keywords are ``outbox.enqueue``'s."""
    statement = _outbox()._one(
        destination, payload, key, headers, run_after, content_type, event_type, tenant
    )
    [row_id] = _run(using, statement)
    return row_id


def enqueue_many(events: Iterable[EventSpec], *, using: str | None = None) -> list[int]:
    """Add many events in one statement; returns their ids in input order."""
    statement = _outbox()._many(events)
    return _run(using, statement) if statement is not None else []


def _run(using: str | None, statement: _Statement) -> list[int]:
    alias = using or DEFAULT_DB_ALIAS
    connection = connections[alias]
    if connection.vendor != "postgresql":
        raise OutboxError(
            f"the outbox lives in PostgreSQL, but DATABASES[{alias!r}] is {connection.vendor}: "
            "pass using= the alias of the PostgreSQL database"
        )
    if not connection.in_atomic_block:
        raise OutboxError(
            "enqueue must run inside the transaction of the business change, but database "
            f"{alias!r} is not in a transaction.atomic() block here (Django's autocommit): "
            "the event would commit alone. Wrap the change and the enqueue in "
            f"`with transaction.atomic(using={alias!r}):`"
        )
    with connection.cursor() as cursor:
        cursor.execute(statement.psycopg, statement.args)
        return sorted(int(row[0]) for row in cursor.fetchall())


def _outbox() -> Outbox:
    return _configured(
        getattr(settings, "OUTBOX_SCHEMA", "public"),
        getattr(settings, "OUTBOX_MAX_PAYLOAD_BYTES", DEFAULT_MAX_PAYLOAD_BYTES),
        getattr(settings, "OUTBOX_CATALOG", None),
    )


@lru_cache(maxsize=8)
def _configured(schema: str, max_payload_bytes: int, catalog: object = None) -> Outbox:
    try:
        box = Outbox(schema, max_payload_bytes=max_payload_bytes)
    except ValueError as exc:
        raise ImproperlyConfigured(f"OUTBOX_SCHEMA / OUTBOX_MAX_PAYLOAD_BYTES: {exc}") from exc
    if catalog is not None:
        # Loaded on the first enqueue, not at import: the catalog's module may import models.
        from outbox.catalog import Catalog, CatalogError, load_catalog

        try:
            box.catalog = catalog if isinstance(catalog, Catalog) else load_catalog(str(catalog))
        except CatalogError as exc:
            raise ImproperlyConfigured(f"OUTBOX_CATALOG: {exc}") from exc
    return box
