"""Real services for the tests: PostgreSQL, a Kafka-protocol broker, an HTTP receiver."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable, Generator, Iterator

import asyncpg
import pytest

from outbox.dburl import to_asyncpg_dsn
from relay.tools.localbroker import LocalBroker
from tests.support import pg
from tests.support.receiver import Receiver


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    url = pg.admin_url()
    pg.check_server(url)
    return url


@pytest.fixture(scope="session")
def template_db(pg_admin_url: str) -> Iterator[str]:
    name = pg.create_template(pg_admin_url)
    yield name
    pg.drop_database(pg_admin_url, name)


@pytest.fixture(scope="session")
def database_pool(pg_admin_url: str, template_db: str) -> Iterator[pg.DatabasePool]:
    pool = pg.DatabasePool(pg_admin_url, template_db)
    yield pool
    pool.close()


@pytest.fixture
def db_url(pg_admin_url: str, database_pool: pg.DatabasePool) -> Iterator[str]:
    """A fresh, migrated database of this test's own."""
    name = database_pool.take()
    yield pg.with_database(pg_admin_url, name)
    pg.drop_database(pg_admin_url, name)


@pytest.fixture
async def admin(db_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to this test's database of its own, outside any relay's pool."""
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def pool(db_url: str) -> AsyncIterator[asyncpg.Pool]:
    """An asyncpg pool on this test's database (a test module may define its own)."""
    p = await asyncpg.create_pool(to_asyncpg_dsn(db_url), min_size=1, max_size=4)
    assert p is not None
    try:
        yield p
    finally:
        await p.close()


@pytest.fixture
def empty_db_url(pg_admin_url: str) -> Iterator[str]:
    """A fresh database with no schema at all (for migration tests)."""
    name = pg.create_from_template(pg_admin_url, "template0")
    yield pg.with_database(pg_admin_url, name)
    pg.drop_database(pg_admin_url, name)


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    existing = os.environ.get("OUTBOX_TEST_KAFKA_BOOTSTRAP")
    if existing:
        yield existing
        return
    with LocalBroker() as broker:
        yield broker.bootstrap


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
def make_receiver() -> Iterator[Callable[..., Receiver]]:
    """More receivers for one test (several endpoints, a chosen port); all stopped at the end."""
    made: list[Receiver] = []

    def make(port: int = 0) -> Receiver:
        r = Receiver(port)
        r.start()
        made.append(r)
        return r

    try:
        yield make
    finally:
        for r in made:
            r.stop()


# --- fault suite: --long, and the figures each fault test publishes -------------------------

FAULT_REPORT_PROPERTY = "outbox_fault_report"
# Filled in the main process, from every worker's reports.
_fault_reports: list[dict[str, object]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="fault suite at full size (e.g. 50k events, 5 relay kills) instead of CI size",
    )


@pytest.fixture
def long_run(request: pytest.FixtureRequest) -> bool:
    """True under ``--long``: fault tests scale their counts up."""
    return bool(request.config.getoption("--long"))


def _soak_seconds() -> float:
    return float(os.environ.get("OUTBOX_FAULT_SOAK_S", "1800"))


@pytest.fixture
def soak_seconds() -> float:
    """How long a test marked ``soak`` runs under ``--long``: 30 minutes, or
    ``$OUTBOX_FAULT_SOAK_S`` seconds (to try one out)."""
    return _soak_seconds()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Under --long a soak's timeout grows with it (pytest-timeout reads the first marker).
    if config.getoption("--long"):
        for item in items:
            if item.get_closest_marker("soak"):
                item.add_marker(pytest.mark.timeout(_soak_seconds() + 900), append=False)


@pytest.fixture
def fault_report(request: pytest.FixtureRequest) -> Iterator[dict[str, object]]:
    """A dict the test fills with its figures; published in the terminal summary and in
    ``fault-report.json`` (path printed there) once the test has passed."""
    report: dict[str, object] = {}
    yield report
    rep = getattr(request.node, "rep_call", None)
    if report and rep is not None and rep.passed:
        # Carried on the teardown report, which pytest-xdist's workers send to the main process
        # (a worker's terminal summary is never shown).
        figures = json.dumps({"test": request.node.name, **report}, default=str)
        request.node.user_properties.append((FAULT_REPORT_PROPERTY, figures))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "teardown":
        return
    for name, value in report.user_properties:
        if name == FAULT_REPORT_PROPERTY:
            _fault_reports.append(json.loads(value))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    # Keep each phase's report on the item so fixtures can tell whether the test passed.
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    reports = _fault_reports
    if not reports or hasattr(config, "workerinput"):  # a pytest-xdist worker: the main one writes
        return
    import tempfile
    from pathlib import Path

    mode = "long" if config.getoption("--long") else "ci"
    path = Path(
        os.environ.get("OUTBOX_FAULT_REPORT")
        or Path(tempfile.gettempdir()) / "outbox-fault-report.json"
    )
    path.write_text(json.dumps({"mode": mode, "results": reports}, indent=2) + "\n")
    terminalreporter.section(f"fault suite figures ({mode})")
    for r in reports:
        figures = ", ".join(f"{k}={v}" for k, v in r.items() if k != "test")
        terminalreporter.write_line(f"{r['test']}: {figures}")
    terminalreporter.write_line(f"written to {path}")
