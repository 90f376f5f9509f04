"""``python manage.py outbox_migrate``: the outbox's migrations, applied to a Django database.

A command, not a Django migration: the outbox's migrations are forward-only SQL files shared
with services that do not use Django and with the relay (``outbox-relay migrate`` runs the
same files). Their runner records them in ``outbox_migrations``, takes an advisory lock so
that concurrent runs queue up, waits a bounded time for table locks, and runs some files
outside a transaction (``CREATE INDEX CONCURRENTLY``). A Django migration wrapping the SQL
would keep a second record of what is applied (``django_migrations``), could not follow new
versions without a new Django migration for each, and would apply them in Django's order
rather than under that lock. So this command calls the one runner, ``outbox.migrate``, with
the connection settings of ``DATABASES[--database]`` (as a URL: outbox.django.dburl).
"""

from __future__ import annotations

import asyncio
from typing import Any

from django.conf import settings  # type: ignore[import-untyped]
from django.core.management.base import BaseCommand, CommandError  # type: ignore[import-untyped]
from django.db import DEFAULT_DB_ALIAS, connections  # type: ignore[import-untyped]

from outbox.dburl import redact
from outbox.django.dburl import UnusableDatabaseSettings, database_url
from outbox.errors import describe
from outbox.migrate import UNREACHABLE, MigrationError, migrate

__all__ = ["Command", "database_url"]


class Command(BaseCommand):  # type: ignore[misc]  # Django has no type information here
    help = (
        "Apply outbox-relay's pending migrations (the outbox table and what goes with it) "
        "to a database: the SQL files and the runner of `outbox-relay migrate`. Safe to run "
        "repeatedly and concurrently."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--database",
            default=DEFAULT_DB_ALIAS,
            help='The DATABASES alias to migrate (default: "default").',
        )
        parser.add_argument(
            "--schema",
            default=None,
            help='The schema of the outbox (default: settings.OUTBOX_SCHEMA, else "public").',
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Print the SQL that would run (psql can run it as it is); change nothing.",
        )
        parser.add_argument(
            "--wait",
            type=float,
            default=600.0,
            metavar="SECONDS",
            help="How long to wait, in all, for another migrate and for the table's locks.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        alias = options["database"]
        if alias not in connections:
            raise CommandError(f"no database {alias!r} in DATABASES")
        connection = connections[alias]
        if connection.vendor != "postgresql":
            raise CommandError(
                f"the outbox lives in PostgreSQL, but DATABASES[{alias!r}] is {connection.vendor}"
            )
        schema = options["schema"] or getattr(settings, "OUTBOX_SCHEMA", "public")
        try:
            # What the driver cannot carry is refused, not left out (see outbox.django.dburl).
            url = database_url(connection.settings_dict, alias)
        except UnusableDatabaseSettings as exc:
            raise CommandError(str(exc)) from None
        dry_run = bool(options["dry_run"])

        def notify(message: str) -> None:
            self.stderr.write(f"outbox_migrate: {message}")

        try:
            result = asyncio.run(
                migrate(url, schema=schema, dry_run=dry_run, wait=options["wait"], notify=notify)
            )
        except MigrationError as exc:
            raise CommandError(str(exc)) from exc
        except UNREACHABLE as exc:
            raise CommandError(
                f"cannot migrate database {alias!r} ({redact(url)}): {describe(exc)}"
            ) from exc
        if not result.applied:
            self.stdout.write(
                f"schema {schema!r} is up to date (versions {result.already or 'none'})"
            )
            return
        for m in result.applied:
            if dry_run:
                self.stdout.write(
                    f"-- {m.version:04d}_{m.name}.sql (would apply to schema {schema!r})"
                )
                self.stdout.write(m.script(schema))
            else:
                self.stdout.write(f"applied {m.version:04d}_{m.name} to schema {schema!r}")
