"""PostgreSQL for tests: a migrated template database, copied per test."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlsplit, urlunsplit

import psycopg

from outbox.migrate import migrate

DEFAULT_ADMIN_URL = "postgresql://root@127.0.0.1:5432/postgres"


def admin_url() -> str:
    return os.environ.get("OUTBOX_TEST_DATABASE_URL", DEFAULT_ADMIN_URL)


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def admin_connect(url: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(url, autocommit=True)


def check_server(url: str) -> None:
    try:
        with admin_connect(url) as c:
            c.execute("SELECT 1")
    except psycopg.OperationalError as exc:
        raise RuntimeError(
            f"PostgreSQL is not reachable at {url}: {exc}\n"
            "Start it with: pg_ctlcluster --skip-systemctl-redirect "
            "$(ls /etc/postgresql) main start, or set OUTBOX_TEST_DATABASE_URL."
        ) from exc


def create_template(url: str) -> str:
    name = f"outbox_tmpl_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with admin_connect(url) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    asyncio.run(migrate(with_database(url, name)))
    return name


def create_from_template(url: str, template: str) -> str:
    name = f"outbox_t_{uuid.uuid4().hex[:12]}"
    with admin_connect(url) as c:
        c.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return name


def drop_database(url: str, name: str) -> None:
    with admin_connect(url) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class DatabasePool:
    """Copies of the template made ahead of need, in a thread: a test then does not wait for
    its CREATE DATABASE (a quarter of a second on a 2-core machine, some 800 times a run)."""

    def __init__(self, url: str, template: str, ahead: int = 2) -> None:
        self.url = url
        self.template = template
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="test-databases")
        self._next: deque[Future[str]] = deque(self._make() for _ in range(ahead))

    def _make(self) -> Future[str]:
        return self._thread.submit(create_from_template, self.url, self.template)

    def take(self) -> str:
        made = self._next.popleft()
        self._next.append(self._make())
        try:
            return made.result()
        except Exception:
            # Made while a test had the server refuse it (connections killed, say): again.
            return create_from_template(self.url, self.template)

    def close(self) -> None:
        for made in self._next:
            with contextlib.suppress(Exception):  # one that was never made
                drop_database(self.url, made.result())
        self._thread.shutdown()


# Advisory locks belong to a database, but pg_locks shows every database's: tests that run
# side by side (pytest-xdist) must count only their own.
UNGRANTED_ADVISORY = """
SELECT count(*) FROM pg_locks
WHERE locktype = 'advisory' AND NOT granted
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""
