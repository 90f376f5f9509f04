"""Real services for the tests: PostgreSQL, a Kafka-protocol broker, an HTTP receiver."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from relay.localbroker import LocalBroker
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


@pytest.fixture
def db_url(pg_admin_url: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database of this test's own."""
    name = pg.create_from_template(pg_admin_url, template_db)
    yield pg.with_database(pg_admin_url, name)
    pg.drop_database(pg_admin_url, name)


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
