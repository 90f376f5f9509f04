"""The Django app ``outbox.django``: it has no models, only the ``outbox_migrate`` command."""

from __future__ import annotations

from django.apps import AppConfig  # type: ignore[import-untyped]


class OutboxConfig(AppConfig):  # type: ignore[misc]  # Django has no type information here
    name = "outbox.django"
    # Not "django" (the package's last name), nor "outbox", which an application may use.
    label = "outbox_relay"
    verbose_name = "outbox-relay"
