"""``outbox_migrate``'s URL of a ``DATABASES`` entry (outbox.django.dburl).

The builder is a pure function: imported here without configuring Django (pytest-django, in
this process, acts only on configured settings). The command itself runs in a process of its
own, with ``settings.configure`` and a ``DATABASES`` entry of the test's own, as
tests/test_django.py runs ``manage.py``.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import asyncpg
import psycopg
import pytest
from asyncpg import connect_utils

from outbox.dburl import to_asyncpg_dsn
from outbox.django.dburl import UnusableDatabaseSettings, database_url
from tests.support import pg

ROOT = Path(__file__).resolve().parents[1]
# Every character a URL or the parsers of one could trip on.
PASSWORD = "p@:/?#[]%20 é'\"\\"


def parse(url: str) -> tuple[list[Any], list[Any], Any]:
    """What asyncpg makes of ``url``: (hosts, ports, parameters), by its own parser (not
    public: called with the arguments this version of it takes)."""
    dsn = to_asyncpg_dsn(url)  # as outbox.migrate hands it over
    wanted = inspect.signature(connect_utils._parse_connect_dsn_and_args).parameters
    kw = {name: None for name in wanted}
    kw["dsn"] = dsn
    addrs, params = connect_utils._parse_connect_dsn_and_args(**kw)
    hosts = [a[0] if isinstance(a, tuple) else a for a in addrs]
    ports = [a[1] if isinstance(a, tuple) else None for a in addrs]
    return hosts, ports, params


def entry(**kw: Any) -> dict[str, Any]:
    return {"NAME": "app", "USER": "", "PASSWORD": "", "HOST": "", "PORT": "", **kw}


def socket_dir() -> tuple[str, str]:
    """The test server's Unix socket directory, and its port."""
    with psycopg.connect(pg.admin_url()) as c:
        row = c.execute("SHOW unix_socket_directories").fetchone()
        port = c.execute("SHOW port").fetchone()
    assert row is not None and port is not None
    for d in str(row[0]).split(","):
        d = d.strip()
        if d.startswith("/") and Path(d, f".s.PGSQL.{port[0]}").exists():
            return d, str(port[0])
    pytest.skip("the test server has no Unix socket")


# --- the URL -----------------------------------------------------------------------------


def test_a_password_of_any_characters_reaches_the_driver_as_it_is() -> None:
    user = "app user@x"
    url = database_url(entry(USER=user, PASSWORD=PASSWORD, HOST="db.internal", PORT=6432))
    assert url.startswith("postgresql://app%20user%40x:") and url.endswith("@db.internal:6432/app")
    assert PASSWORD not in url
    hosts, ports, params = parse(url)
    assert (hosts, ports) == (["db.internal"], [6432])
    assert (params.user, params.password, params.database) == (user, PASSWORD, "app")


@pytest.mark.parametrize(
    ("host", "netloc"),
    [
        ("::1", "[::1]:5433"),
        ("[::1]", "[::1]:5433"),  # already bracketed: not [[::1]]
        ("2001:db8::7", "[2001:db8::7]:5433"),
        ("10.0.0.7", "10.0.0.7:5433"),
    ],
)
def test_ip_addresses(host: str, netloc: str) -> None:
    url = database_url(entry(HOST=host, PORT="5433"))
    assert url == f"postgresql://{netloc}/app"
    hosts, ports, _ = parse(url)
    assert (hosts, ports) == ([host.strip("[]")], [5433])


def test_hosts_and_ports_as_libpq_reads_them() -> None:
    one_port = database_url(entry(HOST="a,b,::1", PORT="5433"))
    assert one_port == "postgresql://a:5433,b:5433,[::1]:5433/app"
    assert parse(one_port)[:2] == (["a", "b", "::1"], [5433, 5433, 5433])
    each = database_url(entry(HOST="a,b", PORT="5433,5434"))
    assert parse(each)[:2] == (["a", "b"], [5433, 5434])
    assert database_url(entry(HOST="a")) == "postgresql://a/app"
    # No HOST: the default (PGHOST, else the local socket), with PORT if given.
    assert database_url(entry()) == "postgresql:///app"
    assert database_url(entry(PORT=5433)) == "postgresql:///app?port=5433"
    for bad, words in (
        (entry(HOST="a,b,c", PORT="1,2"), "2 ports for 3 hosts"),
        (entry(HOST="a", PORT="54x"), "PORT must be a number"),
        (entry(HOST="a,,b"), "an empty host"),
        (entry(NAME=""), "needs a NAME"),
    ):
        with pytest.raises(UnusableDatabaseSettings, match=words):
            database_url(bad)


def test_a_socket_directory_host() -> None:
    url = database_url(entry(HOST="/var/run/postgresql", PORT="5433", PASSWORD=PASSWORD))
    assert urlsplit(url).query == "host=%2Fvar%2Frun%2Fpostgresql&port=5433"
    hosts, _, params = parse(url)  # a socket's address is its path, with the port in it
    assert [str(h) for h in hosts] == ["/var/run/postgresql/.s.PGSQL.5433"]
    assert params.password == PASSWORD


async def test_the_url_connects_through_a_socket_directory_and_carries_options() -> None:
    directory, port = socket_dir()
    db = entry(
        NAME="postgres",
        USER=urlsplit(pg.admin_url()).username or "",
        PASSWORD=PASSWORD,  # trust authentication: not checked, but must not break the URL
        HOST=directory,
        PORT=port,
        OPTIONS={"options": "-c search_path=outbox_x,public", "sslmode": "disable"},
    )
    conn = await asyncpg.connect(to_asyncpg_dsn(database_url(db)))
    try:
        assert await conn.fetchval("SELECT inet_server_addr()") is None  # a Unix socket
        assert await conn.fetchval("SELECT current_database()") == "postgres"
        assert await conn.fetchval("SHOW search_path") == "outbox_x,public"
    finally:
        await conn.close()


# --- OPTIONS -----------------------------------------------------------------------------


def test_connection_options_the_driver_takes_are_carried() -> None:
    carried = {
        "sslmode": "verify-full",
        "sslrootcert": "/etc/ssl/root ca.pem",
        "sslcert": "/etc/ssl/client.crt",
        "sslkey": "/etc/ssl/client.key",
        "sslpassword": "key secret",
        "passfile": "/run/secrets/pgpass",
        "target_session_attrs": "read-write",
    }
    url = database_url(entry(HOST="db", OPTIONS=carried))
    assert {k: v for k, [v] in parse_qs(urlsplit(url).query, strict_parsing=True).items()} == (
        carried
    )
    # What asyncpg reads from them, where no file is opened to parse the URL.
    _, _, params = parse(
        database_url(
            entry(
                HOST="db",
                OPTIONS={"sslmode": "disable", "target_session_attrs": "read-write"},
            )
        )
    )
    assert params.sslmode.name == "disable" and params.ssl is False
    assert params.target_session_attrs.value == "read-write"


def test_options_without_a_bearing_on_the_server_are_left_out() -> None:
    ignored = {
        "isolation_level": 3,
        "server_side_binding": True,
        "pool": {"min_size": 2},
        "assume_role": None,
        "connect_timeout": 5,
        "application_name": "shop",
        "client_encoding": "UTF8",
        "keepalives_idle": 30,
        "gssencmode": "disable",
        "channel_binding": "prefer",
        "prepare_threshold": 5,
        "sslmode": "",
    }
    assert database_url(entry(HOST="db", OPTIONS=ignored)) == "postgresql://db/app"


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("service", "prod-eu-7", "does not read every service file libpq does"),
        ("hostaddr", "10.1.2.3", "may change which server is reached"),
        ("host", "other-db", "may change which server is reached"),
        ("port", "6543", "may change which server is reached"),
        ("dbname", "other", "may change which server is reached"),
        ("requirepeer", "pg-owner-7", "may change which server is reached"),
        ("require_auth", "scram-sha-256", "may change which server is reached"),
        ("gssencmode", "require", "cannot do"),
        ("channel_binding", "require", "cannot do"),
        ("assume_role", "shop_app", "does not SET ROLE"),
        ("some_unknown_option", "xyz-7", "may change which server is reached"),
    ],
)
def test_options_that_cannot_be_carried_are_refused(key: str, value: str, words: str) -> None:
    db = entry(USER="app", PASSWORD=PASSWORD, OPTIONS={"sslmode": "require", key: value})
    with pytest.raises(UnusableDatabaseSettings) as err:
        database_url(db, "reports")
    text = str(err.value)
    assert f"DATABASES['reports']['OPTIONS'][{key!r}]" in text, text
    assert words in text, text
    assert "outbox-relay migrate --database-url" in text and "HOST, PORT" in text
    if value != "require":
        assert value not in text  # option values are not shown: some are secrets
    assert PASSWORD not in text and quote(PASSWORD, safe="") not in text


# --- the command, in a process of its own ------------------------------------------------

COMMAND = textwrap.dedent(
    """
    import json, sys
    import django
    from django.conf import settings
    from django.core.management import call_command
    from django.core.management.base import CommandError

    settings.configure(
        DATABASES={"default": {"ENGINE": "django.db.backends.postgresql",
                               **json.loads(sys.argv[1])}},
        INSTALLED_APPS=["outbox.django"],
        USE_TZ=True,
    )
    django.setup()
    try:
        call_command("outbox_migrate")
    except CommandError as exc:
        print(f"CommandError: {exc}", file=sys.stderr)
        sys.exit(1)
    """
)


def outbox_migrate(db: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DJANGO_"))}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run(
        [sys.executable, "-c", COMMAND, json.dumps(db)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_outbox_migrate_through_a_socket_directory(empty_db_url: str) -> None:
    name = urlsplit(empty_db_url).path.lstrip("/")
    directory, port = socket_dir()
    user = urlsplit(empty_db_url).username or ""
    db = entry(NAME=name, USER=user, PASSWORD=PASSWORD, HOST=directory, PORT=port)
    db["OPTIONS"] = {"connect_timeout": 10, "sslmode": "disable"}
    done = outbox_migrate(db)
    assert done.returncode == 0, done.stderr
    assert "applied 0001_" in done.stdout
    output = done.stdout + done.stderr
    assert PASSWORD not in output and quote(PASSWORD, safe="") not in output
    with psycopg.connect(empty_db_url) as c:
        assert c.execute("SELECT to_regclass('public.outbox') IS NOT NULL").fetchone() == (True,)


def test_outbox_migrate_refuses_a_service_it_cannot_read(empty_db_url: str) -> None:
    name = urlsplit(empty_db_url).path.lstrip("/")
    db = entry(NAME=name, USER="root", PASSWORD=PASSWORD, OPTIONS={"service": "prod"})
    done = outbox_migrate(db)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "CommandError: DATABASES['default']['OPTIONS']['service']" in done.stderr
    assert "outbox-relay migrate --database-url" in done.stderr
    output = done.stdout + done.stderr
    assert PASSWORD not in output and quote(PASSWORD, safe="") not in output
    with psycopg.connect(empty_db_url) as c:  # nothing migrated anywhere
        assert c.execute("SELECT to_regclass('public.outbox')").fetchone() == (None,)


def test_a_failed_connection_never_shows_the_password(pg_admin_url: str) -> None:
    db = entry(
        NAME="outbox_no_such_database",
        USER="root",
        PASSWORD=PASSWORD,
        HOST="127.0.0.1",
        PORT="5432",
    )
    done = outbox_migrate(db)
    assert done.returncode == 1
    assert "cannot migrate database 'default'" in done.stderr, done.stderr
    assert "outbox_no_such_database" in done.stderr
    output = done.stdout + done.stderr
    assert PASSWORD not in output and quote(PASSWORD, safe="") not in output
    assert "p@" not in output and "%20%C3%A9" not in output
