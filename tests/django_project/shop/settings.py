"""Settings of the test project: a shop whose orders app enqueues an event with each order.

One PostgreSQL database, from ``OUTBOX_DJANGO_DATABASE_URL``: tests/test_django.py sets it to
a fresh database of the test's own. Django drives it with psycopg 3.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

URL = os.environ.get("OUTBOX_DJANGO_DATABASE_URL")
if not URL:
    raise ImproperlyConfigured(
        "set OUTBOX_DJANGO_DATABASE_URL to the postgresql:// URL of the project's database "
        "(tests/test_django.py does)"
    )


def database(url: str, **options: Any) -> dict[str, Any]:
    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": parts.port or "",
        "OPTIONS": options,
    }


DATABASES = {
    "default": database(URL),
    # The same database through psycopg 3's server-side binding (Django's default is
    # client-side binding): enqueue must work with either cursor.
    "server_binding": database(URL, server_side_binding=True),
}

INSTALLED_APPS = ["outbox.django", "orders"]

SECRET_KEY = "not a secret: the test project only"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
