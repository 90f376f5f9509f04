"""Nothing secret is ever printed: database URLs in every shape, config errors whatever the
input's shape, environment values, logs, and every command's error output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from outbox.dburl import redact, to_asyncpg_dsn
from relay.config import ConfigError, load_settings

MARK = "Mk5e3c7a91d0"


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay.cli", *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        timeout=60,
    )


# --- redact ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"postgresql://app:{MARK}@db:5432/app", "postgresql://app:***@db:5432/app"),
        (f"postgresql://:{MARK}@db/app", "postgresql://:***@db/app"),
        (f"postgresql://app@db/app?password={MARK}", "postgresql://app@db/app?password=***"),
        (
            f"postgresql://db/app?sslmode=require&sslpassword={MARK}&application_name=x",
            "postgresql://db/app?sslmode=require&sslpassword=***&application_name=x",
        ),
        (f"postgresql://db/app?api_token={MARK}", "postgresql://db/app?api_token=***"),
        (f"postgresql://db/app?PassWord={MARK}", "postgresql://db/app?PassWord=***"),
        # Characters that end the URL's authority early: the password is still hidden whole.
        (f"postgresql://app:pa/ss{MARK}@db/app", "postgresql://app:***@db/app"),
        (f"postgresql://app:pa#ss{MARK}@db/app", "postgresql://app:***@db/app"),
        (f"postgresql://app:?{MARK}@db/app", "postgresql://app:***@db/app"),
        (f"postgresql://app:p@ss{MARK}@db/app", "postgresql://app:***@db/app"),
        (f"postgresql://app:{MARK}@[::1/app", "postgresql://app:***@[::1/app"),
        (f"mysql://root:{MARK}@h/x", "mysql://root:***@h/x"),
        (f"host=db password={MARK}", "host=db password=***"),
        (f"host=db   password = {MARK} dbname=app", "host=db password=*** dbname=app"),
        (f"host=db password='two words {MARK}' user=app", "host=db password=*** user=app"),
        (f"password='it\\'s {MARK}' host=db", "password=*** host=db"),
        (f"host=db sslpassword={MARK}", "host=db sslpassword=***"),
        ("host=db dbname='my db'", "host=db dbname='my db'"),
        ("postgresql://app@db/app", "postgresql://app@db/app"),
        ("", ""),
    ],
)
def test_redact_hides_the_password_in_every_shape(url: str, shown: str) -> None:
    assert redact(url) == shown
    assert MARK not in redact(url)


@pytest.mark.parametrize(
    "url",
    [
        MARK,  # a password pasted where the URL goes
        f"host=db password='{MARK}",  # unterminated quote
        f"host=db {MARK}",  # a word without a value
        f"{MARK}:",
        f"db:5432 {MARK}",
    ],
)
def test_redact_never_echoes_what_it_cannot_parse(url: str) -> None:
    assert MARK not in redact(url)
    assert redact(url)  # says something


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (f"host=db password={MARK}", "postgresql://"),
        (f"mysql://root:{MARK}@h/x", "postgresql://"),
        (MARK, "postgresql://"),
        # asyncpg would report a piece of the password as a bad port or a bad query field.
        (f"postgresql://root:pa/ss{MARK}@127.0.0.1/db", "percent-encode"),
        (f"postgresql://root:pa#ss{MARK}@127.0.0.1/db", "percent-encode"),
        (f"postgresql://root:?{MARK}@127.0.0.1/db", "percent-encode"),
        (f"postgresql://root:{MARK}@127.0.0.1:5o32/db", "port is not a number"),
        (f"postgresql://root:{MARK}@[::1/db", "not a valid URL"),
    ],
)
def test_bad_database_urls_are_refused_without_echoing_the_password(
    url: str, expected: str
) -> None:
    with pytest.raises(ValueError, match=expected) as info:
        to_asyncpg_dsn(url)
    assert MARK not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://root@127.0.0.1:5432/db",
        "postgresql+asyncpg://root:p%2Fw@127.0.0.1/db",
        "postgresql://h1:5432,h2:5433/db",
        "postgresql://[::1]:5432/db",
        "postgresql:///db?host=/var/run/postgresql",
        "postgresql://u@db/app?application_name=me@host",
        "postgres://db",
    ],
)
def test_good_database_urls_still_pass(url: str) -> None:
    assert to_asyncpg_dsn(url).startswith("postgresql://")


def test_status_with_a_keyword_dsn_does_not_echo_its_password() -> None:
    """`status --database-url "host=db password=X"` printed X in its error."""
    res = run_cli("status", "--database-url", f"host=127.0.0.1 password={MARK}")
    assert res.returncode == 1
    assert "postgresql://" in res.stderr
    assert MARK not in res.stdout + res.stderr


# --- config errors ---------------------------------------------------------------------------

WHSEC = f"whsec_{MARK}" + "A" * (36 - len(MARK))  # valid: base64 of 27 bytes


def load_error(tmp_path: Path, toml: str, **env: str) -> str:
    """The ConfigError message for ``toml`` (with ``env`` set), as `run --check` prints it."""
    path = tmp_path / "relay.toml"
    path.write_text(toml)
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("OUTBOX_")]:
            mp.delenv(name)
        for name, value in env.items():
            mp.setenv(name, value)
        with pytest.raises(ConfigError) as info:
            load_settings(path)
    return str(info.value)


HOOK = (
    f'kind = "webhook"\nurl = "https://hooks.example.com/services/{MARK}?token={MARK}"\n'
    f'secrets = ["{WHSEC}"]\nheaders = {{ Authorization = "Bearer {MARK}" }}\n'
)


@pytest.mark.parametrize(
    ("toml", "named"),
    [
        # An array of tables instead of a table: the whole list was the input.
        (f'database_url = "postgresql://u@h/db"\n[[destinations]]\n{HOOK}', "destinations"),
        (
            f'database_url = "postgresql://u@h/db"\n[[destinations.hook]]\n{HOOK}',
            "destinations.hook",
        ),
        # A destination that is a string (a URL with its token) instead of a table.
        (
            f'database_url = "postgresql://u@h/db"\n[destinations]\n'
            f'hook = "https://h.example.com/{MARK}"\n',
            "destinations.hook",
        ),
        # A secret pasted into a field that is not secret-bearing.
        (
            f'database_url = "postgresql://u:{MARK}@h/db"\n[relay]\nrelay_id = 5\n'
            f'schema = ["{MARK}"]\n',
            "relay.schema",
        ),
        (
            f'database_url = "postgresql://u:{MARK}@h/db"\n[relay]\nunknown_destinations = '
            f'"{MARK}"\n',
            "relay.unknown_destinations",
        ),
        (
            f'database_url = "postgresql://u@h/db"\n[kafka]\nsasl_plain_password = "{MARK}"\n'
            f'client_id = "{MARK}"\nacks = "{MARK}"\n',
            "kafka.acks",
        ),
        (
            f'database_url = "postgresql://u:{MARK}@h/db"\n[destinations.h]\nkind = "{MARK}"\n',
            "destinations.h",
        ),
        # The URL's port is a piece of the credentials: httpx quoted it.
        (
            f'database_url = "postgresql://u@h/db"\n[destinations.h]\nkind = "webhook"\n'
            f'url = "https://user:{MARK}/x@h.example.com/"\nsecrets = ["{WHSEC}"]\n',
            "destinations.h.webhook.url",
        ),
        (f'database_url = "host=db password={MARK}"\n', "database_url"),
        (f'database_url = {{ password = "{MARK}" }}\n', "database_url"),
    ],
)
def test_config_errors_never_echo_secrets(tmp_path: Path, toml: str, named: str) -> None:
    message = load_error(tmp_path, toml)
    assert f"{named}:" in message
    assert MARK not in message


def test_destinations_as_an_array_of_tables_says_what_to_write(tmp_path: Path) -> None:
    message = load_error(
        tmp_path, f'database_url = "postgresql://u@h/db"\n[[destinations]]\n{HOOK}'
    )
    assert "[destinations.NAME]" in message


@pytest.mark.parametrize(
    "env",
    [
        {"OUTBOX_DESTINATIONS": f'{{"h": {{"kind": "webhook", "secrets": ["{WHSEC}"'},
        {"OUTBOX_DESTINATIONS": f'[{{"kind": "webhook", "secrets": ["{WHSEC}"]}}]'},
        {"OUTBOX_DESTINATIONS": f'{{"h": "https://h.example.com/{MARK}"}}'},
        {"OUTBOX_DATABASE_URL": f"host=db password='a {MARK}'"},
        {"OUTBOX_DATABASE_URL": f"postgresql://u:pa/ss{MARK}@h/db"},
        {"OUTBOX_KAFKA_SASL_PLAIN_PASSWORD": MARK, "OUTBOX_KAFKA_ACKS": MARK},
        {"OUTBOX_KAFKA": f'{{"sasl_plain_password": "{MARK}", "client_id": ["{MARK}"]}}'},
    ],
)
def test_environment_errors_never_echo_secrets(tmp_path: Path, env: dict[str, str]) -> None:
    toml = "" if "OUTBOX_DATABASE_URL" in env else 'database_url = "postgresql://u@h/db"\n'
    message = load_error(tmp_path, toml, **env)
    assert MARK not in message


# --- logs and command errors -----------------------------------------------------------------


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        timeout=60,
    )


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_log_events_are_scrubbed_of_registered_secrets(fmt: str) -> None:
    """The relay's log set-up scrubs every secret the configuration registered, wherever it
    sits in an event: a message, a nested value, an exception's text and traceback."""
    res = run_python(
        f"""
        import logging, structlog
        from relay import secrets
        from relay.logging import configure
        secrets.register(["{MARK}", 'q"uo\\\\te-é-{MARK}'])
        configure("debug", "{fmt}")
        log = structlog.get_logger("t")
        log.info("relay.test", error="refused: {MARK}", nested={{"a": ["x{MARK}y"]}})
        log.info("relay.test.escaped", error='q"uo\\\\te-é-{MARK}')
        try:
            raise ValueError("bad {MARK}")
        except ValueError:
            log.exception("relay.test.crashed")
        logging.getLogger("aiokafka").warning("cannot connect: %s", "{MARK}")
        """
    )
    assert res.returncode == 0, res.stderr
    assert "relay.test.crashed" in res.stdout and "cannot connect" in res.stderr
    assert MARK not in res.stdout + res.stderr
    assert "uo" not in res.stdout  # the escaped form is hidden whole
    if fmt == "json":
        for line in res.stdout.splitlines():
            json.loads(line)  # still valid JSON


def test_migrate_errors_are_one_clean_message() -> None:
    """A database that does not exist made `migrate` print a traceback."""
    res = run_cli(
        "migrate", "--database-url", f"postgresql://root:{MARK}@127.0.0.1/no_such_db_{MARK}"
    )
    assert res.returncode == 1
    assert "Traceback" not in res.stderr and "does not exist" in res.stderr
    assert MARK not in res.stdout + res.stderr


def test_unexpected_errors_are_scrubbed() -> None:
    """A bug that lets an exception through prints its traceback without the secret."""
    res = run_python(
        f"""
        import sys
        from relay import admin, cli
        async def status(conn, schema):
            raise RuntimeError("bug while connected to " + sys.argv[-1])
        admin.status = status
        sys.argv = ["outbox-relay", "status", "--database-url",
                    "postgresql://root:{MARK}@127.0.0.1/postgres"]
        cli.main()
        """
    )
    assert res.returncode == 1
    assert "RuntimeError: bug while connected to" in res.stderr
    assert MARK not in res.stdout + res.stderr
