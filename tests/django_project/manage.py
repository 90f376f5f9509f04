#!/usr/bin/env python
"""The test project's manage.py: ``python tests/django_project/manage.py outbox_migrate``.

The database is ``OUTBOX_DJANGO_DATABASE_URL`` (see shop/settings.py)."""

from __future__ import annotations

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
