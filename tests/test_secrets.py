"""Nothing secret is ever printed: database URLs in every shape, config errors whatever the
input's shape, environment values, logs, and every command's error output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import tomli_w
from click.testing import CliRunner
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from outbox.dburl import redact, to_asyncpg_dsn
from relay import cli
from relay.config import ConfigError
from relay.obs import scrub as relay_secrets
from relay.settings import load_settings

MARK = "Mk5e3c7a91d0"


@pytest.fixture(autouse=True)
def no_secret_known() -> Iterator[None]:
    """Commands run in-process here register secrets; leave none behind for other tests."""
    relay_secrets.reset()
    yield
    relay_secrets.reset()


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


def test_config_errors_still_show_what_is_not_secret(tmp_path: Path) -> None:
    """Scrubbing hides secrets, not the rest: a URL without a password, a wrong value of a
    plain setting, and words that also occur in a URL or a header stay readable."""
    message = load_error(
        tmp_path,
        'database_url = "mysql://relay@db/app?application_name=relay"\n'
        '[relay]\nbatch_size = "many"\n[kafka]\nsasl_plain_password = "user=relay"\n'
        '[destinations.h]\nkind = "webhook"\nurl = "https://h.example.com/hooks?format=json"\n'
        f'secrets = ["{WHSEC}"]\nheaders = {{ X-Env = "prod" }}\ntimeout = "soon"\n',
    )
    assert "mysql://relay@db/app?application_name=relay" in message
    assert "relay.batch_size:" in message and "(got 'many')" in message
    assert "destinations.h.webhook.timeout:" in message and "(got 'soon')" in message
    assert "***" not in message


def test_loading_a_configuration_changes_nothing_global(tmp_path: Path) -> None:
    """Tests and tools load many configurations in one process: registering their values
    (arbitrary text in the property tests) made later, unrelated messages lose words."""
    relay_secrets.reset()
    path = tmp_path / "relay.toml"
    path.write_text(f'database_url = "postgresql://u:{MARK}@h/db"\n[destinations.h]\n{HOOK}')
    load_settings(path)
    load_error(tmp_path, f'database_url = "postgresql://u:{MARK}@h/db"\nlog_level = 3\n')
    assert relay_secrets.scrub(f"x {MARK} y") == f"x {MARK} y"


def test_a_command_forgets_its_secrets_and_config_errors_ignore_others(tmp_path: Path) -> None:
    """An operations command run in-process registered its password ("secret" in a test)
    for good: later config errors lost every word "secret" ("needs a signing ***")."""
    res = CliRunner().invoke(
        cli.main, ["status", "--database-url", "postgresql://root:secret@127.0.0.1:1/x"]
    )
    assert res.exit_code == 1 and "secret" not in res.output
    assert relay_secrets.scrub("secret") == "secret"
    relay_secrets.register(["secret"])  # as if a command were still running
    message = load_error(
        tmp_path,
        'database_url = "postgresql://u@h/db"\n[destinations.h]\nkind = "webhook"\n'
        'url = "https://h.example.com/"\n',
    )
    assert "needs a signing secret" in message


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
        from relay.obs import scrub
        from relay.obs.logs import configure
        scrub.register(["{MARK}", 'q"uo\\\\te-é-{MARK}'])
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
        from relay import cli
        from relay.ops import status as ops
        async def status(conn, schema, **options):
            raise RuntimeError("bug while connected to " + sys.argv[-1])
        ops.status = status
        sys.argv = ["outbox-relay", "status", "--database-url",
                    "postgresql://root:{MARK}@127.0.0.1/postgres"]
        cli.main()
        """
    )
    assert res.returncode == 1
    assert "RuntimeError: bug while connected to" in res.stderr
    assert MARK not in res.stdout + res.stderr


# --- property: a marker secret in every position, through every command ----------------------

HEX = "0123456789abcdef"
CLOSED_PORT = 1  # 127.0.0.1:1: nothing listens there (binding it needs root)


@dataclass
class Scenario:
    """A config file and environment with the marker in every place a secret can be, some
    breakage, and the database URL the operations commands get."""

    mark: str
    toml: str
    env: dict[str, str]
    db_url: str
    url_in_env: bool
    valid: bool
    notes: list[str] = field(default_factory=list)


def whsec(mark: str) -> str:
    """A valid Standard Webhooks secret whose base64 holds the marker."""
    return f"whsec_{mark}" + "A" * (-(len(mark)) % 4 + 24)


# (template, valid as database_url): {u} user, {m} marker, {h} host, {p} port, {d} database.
DB_URLS = [
    ("postgresql://{u}:{m}@{h}:{p}/{d}", True),
    ("postgresql+asyncpg://{u}:{m}@{h}:{p}/{d}", True),
    ("postgresql://{u}@{h}:{p}/{d}?password={m}", True),
    ("postgresql://{u}@{h}:{p}/{d}?sslmode=disable&sslpassword={m}", True),
    ("postgresql://{u}:p%2F%3F%23%40{m}@{h}:{p}/{d}", True),  # percent-encoded specials
    ("host={h} port={p} dbname={d} user={u} password={m}", False),
    ("host={h} password='two words {m}' dbname={d}", False),
    ("postgresql://{u}:pa/ss{m}@{h}:{p}/{d}", False),
    ("postgresql://{u}:?{m}@{h}:{p}/{d}", False),
    ("postgresql://{u}:{m}#x@{h}:{p}/{d}", False),
    ("postgresql://{u}:{m}@[::1:{p}/{d}", False),
    ("mysql://{u}:{m}@{h}:{p}/{d}", False),
    ("{m}", False),
]
HOOK_URLS = [
    ("http://127.0.0.1:1/hooks/{m}?token={m}", True),
    ("https://hooks.example.com/services/T0/{m}", True),
    ("http://user:{m}@127.0.0.1/x", False),
    ("http://127.0.0.1:{m}/x", False),
    ("ftp://127.0.0.1/{m}", False),
]
BREAKAGE = [
    "wrong_type",  # relay.batch_size = "many"
    "unknown_key",  # relay.batch_sz
    "unknown_secret_key",  # destinations.hook.secret = marker
    "array_destinations",  # [[destinations]]
    "array_destination",  # [[destinations.hook]]
    "bare_url_destination",  # destinations.other = "https://…/marker"
    "broken_toml",
    "bad_json_env",  # OUTBOX_DESTINATIONS with JSON cut short
    "missing_database_url",
]
HARMLESS = ["json_env", "env_database_url", "env_sasl"]  # valid, from the environment


@st.composite
def scenarios(draw: st.DrawFn, server: tuple[str, int, str, str]) -> Scenario:
    host, port, user, db = server
    m = "Mk" + draw(st.text(HEX, min_size=12, max_size=12))
    # Half the scenarios aim at a valid configuration, so that `run` gets as far as its logs.
    aim_valid = draw(st.booleans())

    def pick(options: list[Any], valid: list[Any]) -> Any:
        return draw(st.sampled_from(valid if aim_valid else options))

    reachable = draw(st.booleans())
    h, p = (host, port) if reachable else ("127.0.0.1", CLOSED_PORT)
    template, url_ok = pick(DB_URLS, [u for u in DB_URLS if u[1]])
    db_url = template.format(u=user, m=m, h=h, p=p, d=db)
    hook_url, hook_ok = pick(HOOK_URLS, [u for u in HOOK_URLS if u[1]])
    hook: dict[str, Any] = {
        "kind": "webhook",
        "url": hook_url.format(m=m),
        "allow_private_networks": True,
    }
    env: dict[str, str] = {}
    secret_kind = pick(
        ["valid", "not_base64", "no_prefix", "short", "as_string", "env", "env_bad"],
        ["valid", "env"],
    )
    secret_ok = secret_kind in ("valid", "env")
    if secret_kind == "valid":
        hook["secrets"] = [whsec(m)]
    elif secret_kind == "not_base64":
        hook["secrets"] = [f"whsec_{m}!!"]
    elif secret_kind == "no_prefix":
        hook["secrets"] = [m]
    elif secret_kind == "short":
        hook["secrets"] = [f"whsec_{m}"]
    elif secret_kind == "as_string":
        hook["secrets"] = whsec(m)
    else:
        hook["secret_env"] = "HOOK_SECRET"
        env["HOOK_SECRET"] = whsec(m) if secret_kind == "env" else f"{m} whsec_{m}"
    header_kind = pick(["valid", "line_break", "as_list", "value_list"], ["valid"])
    hook["headers"] = {
        "valid": {"Authorization": f"Bearer {m}", "X-Api-Key": m},
        "line_break": {"Authorization": f"Bearer {m}\n"},
        "as_list": [f"Bearer {m}"],
        "value_list": {"Authorization": [m]},
    }[header_kind]
    sasl_kind = pick(["valid", "as_list", "as_table"], ["valid"])
    kafka: dict[str, Any] = {
        "bootstrap_servers": "127.0.0.1:1",
        "enable_idempotence": False,
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": "relay",
        "sasl_plain_password": {"valid": m, "as_list": [m], "as_table": {"v": m}}[sasl_kind],
    }
    destinations: dict[str, Any] = {
        "hook": hook,
        "orders": {"kind": "kafka", "topic": "orders"},
    }
    cfg: dict[str, Any] = {
        "database_url": db_url,
        "log_format": "json",
        "log_level": "debug",
        "relay": {"startup_timeout": 1, "shutdown_timeout": 1},
        "http": {"enabled": False},
        "kafka": kafka,
        "destinations": destinations,
    }
    pool = HARMLESS if aim_valid else BREAKAGE + HARMLESS
    broken = set(draw(st.lists(st.sampled_from(pool), max_size=3, unique=True)))
    suffix = ""
    if "wrong_type" in broken:
        cfg["relay"]["batch_size"] = "many"
    if "unknown_key" in broken:
        cfg["relay"]["batch_sz"] = 3
    if "unknown_secret_key" in broken:
        hook["secret"] = m
    if "bare_url_destination" in broken:
        destinations["other"] = f"https://hooks.example.com/{m}"
    if "array_destination" in broken:
        destinations["hook"] = [hook]
    if "array_destinations" in broken:
        cfg["destinations"] = list(destinations.values())
    if "broken_toml" in broken:
        suffix = draw(st.sampled_from(["\n[relay\n", f'\nkey = "{m}\n', f"\n= '{m}'\n", "\n[[]]"]))
    if "json_env" in broken or "bad_json_env" in broken:
        text = json.dumps(cfg.pop("destinations"))
        env["OUTBOX_DESTINATIONS"] = text[:-3] if "bad_json_env" in broken else text
    if "env_database_url" in broken or "missing_database_url" in broken:
        url = cfg.pop("database_url")
        if "missing_database_url" not in broken:
            env["OUTBOX_DATABASE_URL"] = url
    if "env_sasl" in broken:
        env["OUTBOX_KAFKA_SASL_PLAIN_PASSWORD"] = m
    valid = (
        url_ok
        and hook_ok
        and secret_ok
        and header_kind == "valid"
        and (sasl_kind == "valid" or "env_sasl" in broken)  # the environment wins
        and broken <= set(HARMLESS)
    )
    return Scenario(
        mark=m,
        toml=tomli_w.dumps(cfg) + suffix,
        env=env,
        db_url=db_url,
        url_in_env=draw(st.booleans()),
        valid=valid,
        notes=[template, hook_url, secret_kind, header_kind, sasl_kind, *sorted(broken)],
    )


OPERATIONS = [
    ["migrate", "--dry-run"],
    ["status"],
    ["show", "1"],
    ["retry", "--all"],
    ["purge", "--older-than", "1d"],
    ["pause", "hook"],
    ["resume", "hook"],
    ["skip", "1"],
]


def commands(
    s: Scenario, config: Path, *, with_run: bool
) -> list[tuple[list[str], dict[str, str]]]:
    """Every command with its arguments and environment, for one scenario."""
    out = [(["run", "--check", "--config", str(config)], s.env)]
    if with_run:
        out.append((["run", "--config", str(config)], s.env))
    for op in OPERATIONS:
        if s.url_in_env:
            out.append((op, {**s.env, "OUTBOX_DATABASE_URL": s.db_url}))
        else:
            out.append(([*op, "--database-url", s.db_url], s.env))
    return out


def check_outcome(s: Scenario, args: list[str], status: int, output: str) -> None:
    where = f"{' '.join(args)} ({', '.join(s.notes)}):\n{output[-3000:]}"
    assert s.mark not in output, where
    assert "Traceback" not in output, where
    if args[:2] == ["run", "--check"]:
        assert status == (0 if s.valid else 2), where
    else:
        assert status in (0, 1, 2), where


@pytest.fixture
def server(empty_db_url: str) -> tuple[str, int, str, str]:
    """Host, port, user and database of a reachable database without the outbox tables: the
    operations commands fail on it after connecting, and `run` exits at start-up."""
    parts = urlsplit(empty_db_url)
    return (
        parts.hostname or "127.0.0.1",
        parts.port or 5432,
        parts.username or "root",
        parts.path.lstrip("/"),
    )


@pytest.mark.slow
def test_no_command_prints_a_secret_property(
    server: tuple[str, int, str, str], tmp_path: Path, long_run: bool
) -> None:
    """Generated configs and environments with a marker secret in every place one can be
    (URL password, URL query, libpq string, webhook secret valid or not, header value,
    webhook URL path and query, SASL password), broken in generated ways (wrong types,
    unknown keys, [[destinations]], broken TOML, bad JSON in OUTBOX_DESTINATIONS, an
    unreachable database): `run --check` and every operations command, in-process, never
    print the marker and never a traceback."""
    runner = CliRunner()
    clear = {name: None for name in os.environ if name.startswith("OUTBOX_")}

    @settings(
        max_examples=300 if long_run else 25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(s=scenarios(server))
    def check(s: Scenario) -> None:
        config = tmp_path / "relay.toml"
        config.write_text(s.toml)
        for args, env in commands(s, config, with_run=False):
            relay_secrets.reset()  # each command runs in a fresh process in real life
            result = runner.invoke(cli.main, args, env={**clear, **env})
            check_outcome(s, args, result.exit_code, result.output)

    check()


@pytest.mark.slow
def test_no_command_prints_a_secret_as_a_process(
    server: tuple[str, int, str, str], tmp_path: Path, long_run: bool
) -> None:
    """The same as real `outbox-relay` processes, `run` included (it exits at start-up: the
    database is unreachable or has no outbox tables), its logs at debug level."""

    # In CI only the explicit example runs (ten processes take a few seconds each).
    @settings(
        max_examples=20,
        phases=list(Phase) if long_run else [Phase.explicit],
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(s=scenarios(server))
    @example(
        s=Scenario(
            mark=MARK,
            toml=tomli_w.dumps(
                {
                    "database_url": f"postgresql://{server[2]}:{MARK}@127.0.0.1:{CLOSED_PORT}/x",
                    "log_format": "json",
                    "log_level": "debug",
                    "relay": {"startup_timeout": 1},
                    "http": {"enabled": False},
                    "destinations": {
                        "hook": {
                            "kind": "webhook",
                            "url": f"https://hooks.example.com/services/{MARK}?token={MARK}",
                            "secrets": [whsec(MARK)],
                            "headers": {"Authorization": f"Bearer {MARK}"},
                        }
                    },
                }
            ),
            env={},
            db_url=f"postgresql://{server[2]}:?{MARK}@{server[0]}:{server[1]}/{server[3]}",
            url_in_env=False,
            valid=True,
            notes=["explicit: unreachable database, ':?' in the operations URL"],
        )
    )
    def check(s: Scenario) -> None:
        config = tmp_path / "relay.toml"
        config.write_text(s.toml)
        jobs = commands(s, config, with_run=True)

        def one(job: tuple[list[str], dict[str, str]]) -> tuple[list[str], int, str]:
            res = run_cli(*job[0], env=job[1])
            return job[0], res.returncode, res.stdout + res.stderr

        with ThreadPoolExecutor(max_workers=2) as pool:
            for args, status, output in pool.map(one, jobs):
                check_outcome(s, args, status, output)

    check()
