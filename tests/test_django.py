"""outbox.django in the real Django project of tests/django_project.

Django's settings are global to a process, and pytest-django (installed for this) acts on
every test of a process whose settings are configured. So nothing here imports Django: the
project's own tests (tests/django_project/orders/tests.py, with pytest-django) run in a
pytest of their own, and ``manage.py`` runs as the command it is, each against a database
made for the test. The rest of the suite never sees DJANGO_SETTINGS_MODULE.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import psycopg

from outbox.migrate import load_migrations
from tests.support import pg

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "tests" / "django_project"
SUITE = PROJECT / "orders" / "tests.py"


def project_env(database_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(
        OUTBOX_DJANGO_DATABASE_URL=database_url,
        DJANGO_SETTINGS_MODULE="shop.settings",
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


def manage(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PROJECT / "manage.py"), *args],
        cwd=ROOT,
        env=project_env(database_url),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_django_project_suite(db_url: str, tmp_path: Path) -> None:
    """Every test of the project passes: an order and its event relayed together, a block
    that raises leaving neither, enqueue refused outside atomic(), TestCase transactions,
    savepoints, both psycopg cursor kinds, ``outbox_migrate`` and OUTBOX_SCHEMA."""
    report = tmp_path / "report.xml"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(SUITE.relative_to(ROOT)),
            "--ds=shop.settings",
            f"--junitxml={report}",
            "-p",
            "no:cacheprovider",
            "-o",
            "timeout=60",
            "-q",
        ],
        cwd=ROOT,
        env=project_env(db_url),
        capture_output=True,
        text=True,
        timeout=100,
    )
    output = done.stdout[-6000:] + done.stderr[-3000:]
    assert done.returncode == 0, output
    cases = ET.parse(report).getroot().iter("testcase")
    outcomes = {c.get("name", ""): [child.tag for child in c] for c in cases}
    assert all(not tags for tags in outcomes.values()), outcomes  # no failure, error or skip
    declared = set(re.findall(r"^def (test_\w+)", SUITE.read_text(), re.M))
    ran = {name.partition("[")[0] for name in outcomes}
    assert declared and ran == declared, (declared, ran)


def test_outbox_migrate_migrates_an_empty_database(empty_db_url: str) -> None:
    first = manage(empty_db_url, "outbox_migrate")
    assert first.returncode == 0, first.stderr
    versions = [m.version for m in load_migrations()]
    assert first.stdout.count("applied ") == len(versions), first.stdout
    with psycopg.connect(empty_db_url) as c:
        applied = [r[0] for r in c.execute("SELECT version FROM outbox_migrations ORDER BY 1")]
        assert applied == versions
        assert c.execute("SELECT to_regclass('public.outbox') IS NOT NULL").fetchone() == (True,)

    again = manage(empty_db_url, "outbox_migrate")
    assert again.returncode == 0 and "schema 'public' is up to date" in again.stdout

    dry = manage(empty_db_url, "outbox_migrate", "--schema", "events", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "-- 0001_" in dry.stdout and "CREATE TABLE" in dry.stdout
    with psycopg.connect(empty_db_url) as c:  # a dry run changes nothing
        assert c.execute("SELECT to_regnamespace('events')").fetchone() == (None,)


def test_outbox_migrate_says_what_is_wrong(pg_admin_url: str) -> None:
    url = pg.with_database(pg_admin_url, "outbox_no_such_database")
    url = url.replace("://root@", "://root:hunter2@")  # trust auth: the password is not used
    done = manage(url, "outbox_migrate")
    assert done.returncode == 1
    assert "cannot migrate database 'default'" in done.stderr
    assert "outbox_no_such_database" in done.stderr and "hunter2" not in done.stderr
