"""The oldest holder of the xmin horizon, with real held snapshots: what SNAPSHOT_HOLDER names
(and what it leaves out), what a role without pg_read_all_stats sees, and the relay's watch
of it (the gauges, relay.snapshot.held and .released).

Other sessions of the server (the fixtures creating the next tests' databases, other
checkouts) hold a transaction id for a moment, and such a holder counts (see
relay.db.queries.SNAPSHOT_HOLDER): one that began before a test's snapshot is the oldest until
it ends. So a test waits until its own holder is the oldest (from then on nothing younger
can be), and "nothing held" is asserted as "not the closed holder"."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import psycopg
import pytest
from structlog.testing import capture_logs

from outbox.dburl import to_asyncpg_dsn
from relay.db.snapshots import BACKEND, HIDDEN_HINT, PREPARED, SLOT, SnapshotHolder, oldest_holder
from relay.db.store import Store, create_pool
from relay.maintenance import every
from relay.maintenance.horizon import REPEAT_EVERY, Horizon
from relay.obs.metrics import Metrics
from tests.test_relay_role import as_user


@asynccontextmanager
async def held_snapshot(
    url: str, app: str = "nightly-report", *, xid: bool = False
) -> AsyncIterator[asyncpg.Connection]:
    """A session holding a snapshot, as a pg_dump or a long report does: a repeatable read
    transaction that has read the outbox, left open (with ``xid``: one that has written too,
    so it holds a transaction id)."""
    conn = await asyncpg.connect(to_asyncpg_dsn(url), server_settings={"application_name": app})
    try:
        await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await conn.fetchval("SELECT count(*) FROM pg_class")
        if xid:
            await conn.fetchval("SELECT pg_current_xact_id()")
        yield conn
    finally:
        await conn.close()


async def reader(url: str) -> asyncpg.Connection:
    return await asyncpg.connect(to_asyncpg_dsn(url))


async def until(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = await check()
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.05)


async def oldest_is(conn: asyncpg.Connection, pid: int) -> SnapshotHolder:
    """The oldest holder once it is ``pid`` (transactions begun before it have ended)."""

    async def named() -> SnapshotHolder | None:
        found = await oldest_holder(conn)
        return found if found is not None and found.pid == pid else None

    found = await until(named)
    assert found is not None, f"pid {pid} never became the oldest holder"
    return found


async def test_a_held_snapshot_is_named_and_ages_and_is_gone_once_closed(db_url: str) -> None:
    conn = await reader(db_url)
    try:
        async with held_snapshot(db_url) as holder:
            pid = holder.get_server_pid()
            first = await oldest_is(conn, pid)
            assert (first.kind, first.pid, first.application_name) == (
                BACKEND,
                pid,
                "nightly-report",
            )
            assert (
                first.visible
                and first.user == "root"
                and first.database == db_url.rsplit("/", 1)[1]
            )
            assert first.state == "idle in transaction" and first.command == "SELECT"
            assert first.age_s is not None and first.xact_start is not None

            async def older() -> SnapshotHolder | None:
                h = await oldest_holder(conn)
                assert h is not None and h.pid == pid
                return h if h.age_s is not None and h.age_s > first.age_s + 0.2 else None

            assert await until(older)
        gone = await oldest_holder(conn)
        assert gone is None or gone.pid != pid
    finally:
        await conn.close()


async def test_its_own_snapshot_is_not_named(db_url: str) -> None:
    """The session asking holds a snapshot too (status reads in repeatable read): not it."""
    conn = await reader(db_url)
    try:
        async with conn.transaction(isolation="repeatable_read"):
            await conn.fetchval("SELECT count(*) FROM outbox")
            await conn.fetchval("SELECT pg_current_xact_id()")
            holder = await oldest_holder(conn)
            assert holder is None or holder.pid != conn.get_server_pid()
    finally:
        await conn.close()


async def test_another_databases_snapshot_is_left_out_but_its_xid_is_not(
    db_url: str, empty_db_url: str
) -> None:
    """Since PostgreSQL 14 a snapshot in another database does not hold back this one's
    VACUUM; a transaction id held anywhere does (every snapshot here counts it running)."""
    conn = await reader(db_url)
    try:
        async with held_snapshot(empty_db_url, "elsewhere") as other:
            found = await oldest_holder(conn)
            assert found is None or found.pid != other.get_server_pid()
        async with held_snapshot(empty_db_url, "elsewhere", xid=True) as other:
            found = await oldest_is(conn, other.get_server_pid())
            assert found.database == empty_db_url.rsplit("/", 1)[1]
    finally:
        await conn.close()


async def test_a_prepared_transaction_is_named(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        allowed = int(c.execute("SHOW max_prepared_transactions").fetchone()[0])  # type: ignore[index]
    if allowed == 0:
        pytest.skip(
            "max_prepared_transactions = 0 on this server: no transaction can be prepared "
            "(the server's configuration is not the tests' to change)"
        )
    gid = f"horizon-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db_url) as c:
        c.execute("SELECT pg_current_xact_id()")
        c.execute(f"PREPARE TRANSACTION '{gid}'")
    conn = await reader(db_url)
    try:
        # (Once transactions of other databases begun before it have ended: the suite's other
        # worker may have one open.)
        async def prepared() -> SnapshotHolder | None:
            found = await oldest_holder(conn)
            return found if found is not None and found.name == gid else None

        found = await until(prepared)
        assert found is not None and (found.kind, found.name) == (PREPARED, gid)
        assert found.age_s is not None and "ROLLBACK PREPARED" in found.action()
    finally:
        await conn.execute(f"ROLLBACK PREPARED '{gid}'")
        await conn.close()


def test_what_ends_a_holder_names_it_quoted() -> None:
    """The commands an operator is given (relay/db/snapshots.sql): a slot's name and a prepared
    transaction's gid as string literals, their quotes doubled; a backend's pid as it is."""

    def holder(kind: str, pid: int | None, name: str | None) -> SnapshotHolder:
        return SnapshotHolder(
            kind, pid, name, "db", None, "u", None, None, None, None, None, None, None, 1, "7", True
        )

    assert (
        holder(SLOT, None, "it's")
        .action()
        .endswith(", or if that standby is gone, SELECT pg_drop_replication_slot('it''s')")
    )
    assert holder(PREPARED, None, "g'{gid}").action() == (
        "COMMIT PREPARED 'g''{gid}' or ROLLBACK PREPARED 'g''{gid}' (in database db), once you "
        "know which its transaction manager wants"
    )
    assert holder(BACKEND, 42, None).action() == (
        "SELECT pg_terminate_backend(42) if it is not needed"
    )


@pytest.fixture
def plain_role(db_url: str) -> Iterator[str]:
    """A login role without pg_read_all_stats (roles are cluster-wide), dropped afterwards."""
    name = f"horizon_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute(f'CREATE ROLE "{name}" LOGIN')
    yield name
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute(f'DROP ROLE IF EXISTS "{name}"')


async def test_a_role_without_pg_read_all_stats_is_told_it_cannot_see_the_holder(
    db_url: str, plain_role: str
) -> None:
    """PostgreSQL 15 shows another role's backend_xmin, pid, user and application name to
    anyone, but not its state, times or query: the holder is named as far as it can be, its
    age unknown, and the hint says which grant names it."""
    conn = await reader(as_user(db_url, plain_role))
    try:
        async with held_snapshot(db_url) as holder:
            found = await oldest_is(conn, holder.get_server_pid())
            assert (found.visible, found.age_s, found.state, found.command) == (
                False,
                None,
                None,
                None,
            )
            assert found.application_name == "nightly-report" and found.user == "root"
            assert found.as_json(1.0)["hint"] == HIDDEN_HINT
            assert not found.over(1.0)  # its age unknown, status cannot judge it
            with psycopg.connect(db_url, autocommit=True) as c:
                c.execute(f'GRANT pg_read_all_stats TO "{plain_role}"')
            # (Until it is the oldest again: a transaction of another database that was running
            # when the snapshot was taken ties with it, and the older start wins once visible.)
            seen = await oldest_is(conn, holder.get_server_pid())
            assert seen.visible and seen.age_s is not None
            assert seen.state == "idle in transaction"
    finally:
        await conn.close()


# --- the relay's watch -------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[Store]:
    pool = await create_pool(to_asyncpg_dsn(db_url), "horizon-test", 2)
    try:
        yield Store(pool, "public", "horizon-test", 30.0)
    finally:
        await pool.close()


def gauge(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None
    return value


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


async def test_the_relay_warns_once_a_minute_while_held_and_says_when_released(
    db_url: str, store: Store
) -> None:
    metrics, clock = Metrics(), Clock()
    horizon = Horizon(store, metrics, warning=2.0, clock=clock)
    async with held_snapshot(db_url) as holder:
        pid = holder.get_server_pid()
        async with store.pool.acquire() as conn:
            await oldest_is(conn, pid)
        with capture_logs() as logs:
            await horizon()  # younger than the threshold (2 s; 0.3 s went by on a busy machine)
            assert not events(logs, "relay.snapshot.held")

            async def warned() -> bool:
                await horizon()
                return bool(events(logs, "relay.snapshot.held"))

            assert await until(warned)
            (held,) = events(logs, "relay.snapshot.held")
            assert held["log_level"] == "warning"
            assert (held["kind"], held["pid"], held["application_name"]) == (
                BACKEND,
                pid,
                "nightly-report",
            )
            assert held["user"] == "root" and held["state"] == "idle in transaction"
            assert held["age_s"] >= 2.0 and held["xid_age"] >= 1 and not held["age_observed"]
            assert held["action"] == f"SELECT pg_terminate_backend({pid}) if it is not needed"
            assert gauge(metrics, "outbox_oldest_snapshot_age_seconds") > 2.0
            assert gauge(metrics, "outbox_oldest_snapshot_xid_age") >= 1

            await horizon()  # the same holder, within the minute: not again
            assert len(events(logs, "relay.snapshot.held")) == 1
            clock.now += REPEAT_EVERY
            await horizon()
            assert len(events(logs, "relay.snapshot.held")) == 2
            assert not events(logs, "relay.snapshot.released")
    with capture_logs() as logs:
        await horizon()
    (released,) = events(logs, "relay.snapshot.released")
    assert released["log_level"] == "info" and released["pid"] == pid
    assert not events(logs, "relay.snapshot.held")
    # Nothing held here any more: 0, unless another database's transaction holds an xid
    # this very moment (the other worker's tests run beside this one), whose age it then is.
    age = gauge(metrics, "outbox_oldest_snapshot_age_seconds")
    if horizon._seen is None:
        assert age == 0
    else:
        other, _ = horizon._seen
        assert other.pid != pid and other.database != held["database"]
        assert age == max(0.0, other.age_s if other.age_s is not None else 0.0)


async def test_a_new_holder_is_warned_about_at_once(db_url: str, store: Store) -> None:
    horizon = Horizon(store, Metrics(), warning=0.2)

    async def warned(n: int) -> bool:
        await horizon()
        return len(events(logs, "relay.snapshot.held")) >= n

    with capture_logs() as logs:
        async with held_snapshot(db_url, "first-report") as first:
            pid = first.get_server_pid()
            async with store.pool.acquire() as conn:
                await oldest_is(conn, pid)
            assert await until(lambda: warned(1))
        async with held_snapshot(db_url, "second-report") as second:
            async with store.pool.acquire() as conn:
                await oldest_is(conn, second.get_server_pid())
            assert await until(lambda: warned(2))
    held = events(logs, "relay.snapshot.held")
    assert [h["pid"] for h in held] == [pid, second.get_server_pid()]
    assert [h["application_name"] for h in held] == ["first-report", "second-report"]
    assert events(logs, "relay.snapshot.released")[0]["pid"] == pid


async def test_a_hidden_holder_is_aged_by_what_the_relay_saw(db_url: str, plain_role: str) -> None:
    """A role without pg_read_all_stats cannot read when a transaction began: the relay
    counts from when it first saw the same holder (a lower bound) and says so."""
    pool = await create_pool(to_asyncpg_dsn(as_user(db_url, plain_role)), "horizon-test", 2)
    try:
        metrics, clock = Metrics(), Clock()
        horizon = Horizon(Store(pool, "public", "horizon-test", 30.0), metrics, 30.0, clock)
        async with held_snapshot(db_url) as holder:
            async with pool.acquire() as conn:
                await oldest_is(conn, holder.get_server_pid())
            with capture_logs() as logs:
                await horizon()
                assert gauge(metrics, "outbox_oldest_snapshot_age_seconds") == 0
                clock.now += 31
                await horizon()
            (held,) = events(logs, "relay.snapshot.held")
            assert held["pid"] == holder.get_server_pid() and held["age_observed"]
            assert held["visible"] is False and "pg_read_all_stats" in held["hint"]
            assert held["age_s"] == 31.0
            assert gauge(metrics, "outbox_oldest_snapshot_age_seconds") == 31.0
    finally:
        await pool.close()


async def test_zero_never_warns(db_url: str, store: Store) -> None:
    metrics = Metrics()
    horizon = Horizon(store, metrics, warning=0)
    async with held_snapshot(db_url) as holder:
        async with store.pool.acquire() as conn:
            await oldest_is(conn, holder.get_server_pid())
        await asyncio.sleep(0.1)
        with capture_logs() as logs:
            await horizon()
        assert not events(logs, "relay.snapshot.held")
        assert gauge(metrics, "outbox_oldest_snapshot_age_seconds") > 0.05


async def test_a_failing_reading_is_logged_and_the_watch_goes_on(db_url: str) -> None:
    pool = await create_pool(to_asyncpg_dsn(db_url), "horizon-test", 2)
    await pool.close()  # every reading now fails, as with the database gone
    horizon = Horizon(Store(pool, "public", "horizon-test", 30.0), Metrics(), warning=1.0)
    with capture_logs() as logs:
        task = asyncio.create_task(every(0.01, horizon, "horizon"))
        try:
            failed = await until(
                lambda: asyncio.sleep(0, len(events(logs, "relay.maintenance.failed")) >= 2)
            )
            assert failed and not task.done()
        finally:
            task.cancel()
    assert events(logs, "relay.maintenance.failed")[0]["job"] == "horizon"
