"""Tools of the fault suite: a paced writer, a sampler of stuck rows, relay fleets, and the
checks every fault test ends with (nothing lost, duplicates only where a fault allows them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import tomli_w
from sqlalchemy.ext.asyncio import create_async_engine

import outbox
from outbox.dburl import to_asyncpg_dsn, to_sqlalchemy_async_url
from tests.support.kafka import consume, outbox_id
from tests.support.receiver import Receiver, Recorded
from tests.support.relays import RelayProcess
from tests.webhook_helpers import verify


def relay_config(
    db_url: str,
    bootstrap: str,
    topic: str,
    *,
    relay_id: str | None = None,
    **relay: Any,
) -> dict[str, Any]:
    """A relay.toml for fault tests: short lease and poll so recovery is quick to observe."""
    rs: dict[str, Any] = {
        "lease": 4,
        "poll_interval": 0.25,
        "shutdown_timeout": 10,
        "batch_size": 200,
        "max_in_flight": 1000,
        "backoff": {"base": 0.2, "factor": 2, "max": 2, "jitter": 0.2},
        **relay,
    }
    if relay_id is not None:
        rs["relay_id"] = relay_id
    return {
        "database_url": db_url,
        "log_format": "json",
        # A free port each: several relays run at once (and the default 9090 may be taken).
        "http": {"host": "127.0.0.1", "port": 0},
        "relay": rs,
        "kafka": {
            "bootstrap_servers": bootstrap,
            "enable_idempotence": False,  # the test broker rejects aiokafka's idempotent producer
            "request_timeout_ms": 5000,
        },
        "destinations": {"orders": {"kind": "kafka", "topic": topic}},
    }


# --- endpoints destinations: one (event, endpoint) pair per delivery ------------------------

ENDPOINTS = "customer-events"


def endpoints_config(db_url: str, *, relay_id: str, **relay: Any) -> dict[str, Any]:
    """A relay.toml for fault tests whose one destination, ENDPOINTS, fans its events out to
    the endpoints registered for it (receivers on loopback). Attempts enough that no kill fails
    a delivery (each reap of a dead relay's delivery counts one)."""
    cfg = relay_config(db_url, "127.0.0.1:9", "unused", relay_id=relay_id, **relay)
    del cfg["kafka"]
    cfg["destinations"] = {
        ENDPOINTS: {
            "kind": "endpoints",
            "allow_private_networks": True,
            "max_concurrency": 32,
            "max_attempts": 100,
            "backoff": {"schedule": [0.2], "jitter": 0},
        }
    }
    return cfg


async def register_endpoints(db_url: str, urls: list[str]) -> list[outbox.endpoints.Endpoint]:
    """An endpoint of ENDPOINTS for each URL, taking every event (no tenant, no type)."""
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    try:
        async with engine.begin() as conn:
            return [
                await outbox.endpoints.create(
                    conn, destination=ENDPOINTS, url=url, allow_private_networks=True
                )
                for url in urls
            ]
    finally:
        await engine.dispose()


# The deliveries a relay holds ($1), running under its lease; and whether it holds any.
HELD_DELIVERIES = """
SELECT event_id, endpoint_id FROM outbox_deliveries WHERE status = 'running' AND locked_by = $1
"""
HOLDS_DELIVERIES = f"SELECT EXISTS ({HELD_DELIVERIES})"


@dataclass
class Pairs:
    """What the endpoints received: the requests of each (event id, endpoint id) pair, every
    request that reached its receiver (answered or not: a relay killed mid-request never reads
    the answer)."""

    per_pair: dict[tuple[int, int], list[Recorded]]
    # Requests whose body never arrived whole (their relay was killed while sending them):
    # no endpoint would take one, so they count as received by none.
    cut: int = 0

    @property
    def duplicates(self) -> int:
        return sum(len(r) - 1 for r in self.per_pair.values())

    @property
    def duplicated(self) -> set[tuple[int, int]]:
        return {p for p, r in self.per_pair.items() if len(r) > 1}


def read_pairs(
    receivers: list[Receiver], endpoints: list[outbox.endpoints.Endpoint], ids: list[int]
) -> Pairs:
    """Every request each endpoint received, by pair, checked as a receiver relies on them:
    the event is known from the body (the writer's ``n``, not from the headers), every request
    is signed with the endpoint's secret (the reference library checks it) and carries the
    event's id as ``webhook-id``, so a redelivery is the same message under the same id; and
    every (event, endpoint) pair arrived."""
    per_pair: defaultdict[tuple[int, int], list[Recorded]] = defaultdict(list)
    cut = 0
    for receiver, ep in zip(receivers, endpoints, strict=True):
        assert ep.secret is not None, "an endpoint created here shows its secret"
        for r in list(receiver.requests):
            if len(r.body) < int(r.headers.get("content-length", len(r.body))):
                cut += 1
                continue
            event = ids[json.loads(r.body)["n"]]
            verify(ep.secret, r.body, r.headers)
            assert r.headers["webhook-id"] == str(event), (r.headers["webhook-id"], event)
            per_pair[(event, ep.id)].append(r)
    for pair, copies in per_pair.items():
        assert len({c.body for c in copies}) == 1, f"{pair} arrived with other content"
    want = {(i, ep.id) for i in ids for ep in endpoints}
    missing = want - set(per_pair)
    assert not missing, f"{len(missing)} pairs never reached their endpoint: {sorted(missing)[:5]}"
    return Pairs(dict(per_pair), cut)


def requested(
    receivers: list[Receiver], endpoints: list[outbox.endpoints.Endpoint]
) -> set[tuple[int, int]]:
    """The (event, endpoint) pairs whose request has reached its receiver so far."""
    return {
        (int(r.headers["webhook-id"]), ep.id)
        for receiver, ep in zip(receivers, endpoints, strict=True)
        for r in list(receiver.requests)
    }


# Delivered deliveries with no row in the message log: each was recorded by an outcome, which
# logs its attempt in the same statement.
UNLOGGED = """
SELECT count(*) FROM outbox_deliveries AS d
WHERE d.status = 'delivered'
  AND NOT EXISTS (SELECT FROM outbox_attempts AS a WHERE a.delivery_id = d.id)
"""
DELIVERIES = "SELECT event_id, endpoint_id, status, attempts, claims FROM outbox_deliveries"
# The pairs whose delivery was taken out of `running` after its lease expired (AUDIT).
EXPIRED_PAIRS = """
SELECT DISTINCT d.event_id, d.endpoint_id
FROM outbox_expiries AS x JOIN outbox_deliveries AS d ON d.id = x.id
WHERE x.tbl = 'outbox_deliveries'
"""


async def deliveries_done(db_url: str, n: int) -> bool:
    """All ``n`` deliveries delivered."""
    return bool(
        await fetchval(
            db_url, "SELECT count(*) = $1 FROM outbox_deliveries WHERE status = 'delivered'", n
        )
    )


class Fleet:
    """Relay subprocesses of one test; every one is killed at the end, whatever happens."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[RelayProcess] = []

    def start(
        self, cfg: dict[str, Any], name: str, env: dict[str, str] | None = None
    ) -> RelayProcess:
        # tomli-w writes tables at any depth (destinations.NAME.backoff, …).
        path = self.tmp / f"{name}.toml"
        path.write_text(tomli_w.dumps(cfg))
        proc = RelayProcess(path, env=env).start()
        self.procs.append(proc)
        return proc

    def alive(self) -> list[RelayProcess]:
        return [p for p in self.procs if p.proc is not None and p.proc.poll() is None]

    def stop_all(self) -> None:
        for p in self.procs:
            p.stop()

    def logs(self) -> str:
        return "\n".join(p.output() for p in self.procs)


@contextlib.contextmanager
def fleet(tmp: Path) -> Iterator[Fleet]:
    f = Fleet(tmp)
    try:
        yield f
    finally:
        f.stop_all()


def events(lines: str, name: str) -> list[dict[str, Any]]:
    """The JSON log lines of ``lines`` whose event is ``name``."""
    out = []
    for line in lines.splitlines():
        if f'"{name}"' not in line:
            continue
        with contextlib.suppress(ValueError):
            ev = json.loads(line)
            if ev.get("event") == name:
                out.append(ev)
    return out


@dataclass
class Writer:
    """Enqueues ``total`` events over ``keys`` keys, ``chunk`` per transaction, at about
    ``rate`` events/s: the application keeps committing while the test breaks things."""

    db_url: str
    total: int
    keys: int = 200
    chunk: int = 250
    rate: float = 2000.0
    destination: str = "orders"
    # Set: its last transaction waits for it (the test's faults are over), so the application
    # commits throughout them however long they take on a slow machine.
    last_after: asyncio.Event | None = None
    ids: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # Since when (monotonic) its last transaction has waited for last_after; None: it is not.
    waiting_for: float | None = None
    # Set: it writes no more transactions (``total`` is then the most it writes), for a test
    # that keeps the application committing until the system has recovered, however long.
    stop: asyncio.Event | None = None

    async def run(self) -> list[int]:
        conn = await asyncpg.connect(to_asyncpg_dsn(self.db_url))
        started = time.monotonic()
        try:
            n = 0
            while n < self.total and not (self.stop is not None and self.stop.is_set()):
                size = min(self.chunk, self.total - n)
                if n + size == self.total and self.last_after is not None:
                    self.waiting_for = time.monotonic()
                    await self.last_after.wait()
                    self.waiting_for = None
                batch = [
                    {
                        "destination": self.destination,
                        "key": f"key-{(n + i) % self.keys}",
                        "payload": {"n": n + i},
                        "headers": {"seq": str(n + i)},
                    }
                    for i in range(size)
                ]
                async with conn.transaction():
                    self.ids += await outbox.enqueue_many(conn, batch)  # type: ignore[arg-type]
                n += size
                # Pace against the start, not the last batch: a slow commit is caught up.
                ahead = started + n / self.rate - time.monotonic()
                if ahead > 0:
                    await asyncio.sleep(ahead)
        finally:
            await conn.close()
        return self.ids


class Sampler:
    """Polls the table and keeps the worst figures seen: how long a row stayed ``running``
    past its lease (a dead relay's row waiting for the reaper), and how many rows were
    ``running`` at once."""

    def __init__(self, db_url: str, interval: float = 0.1, table: str = "outbox") -> None:
        self.db_url = db_url
        self.interval = interval
        self.table = table  # or outbox_deliveries: the same columns
        self.max_overrun = 0.0
        self.max_running = 0
        self.samples = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        conn = await asyncpg.connect(to_asyncpg_dsn(self.db_url))
        try:
            while True:
                row = await conn.fetchrow(
                    "SELECT coalesce(extract(epoch FROM max(clock_timestamp() - locked_until)"
                    "), 0)::float8 AS overrun, count(*) AS running "
                    f"FROM {self.table} WHERE status = 'running'"
                )
                assert row is not None
                self.max_overrun = max(self.max_overrun, row["overrun"])
                self.max_running = max(self.max_running, row["running"])
                self.samples += 1
                await asyncio.sleep(self.interval)
        finally:
            await conn.close()

    def __enter__(self) -> Sampler:
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        if self._task.done() and not self._task.cancelled() and self._task.exception():
            raise AssertionError("the sampler died") from self._task.exception()
        self._task.cancel()


# The rows a relay holds ($1; NULL: any relay), whichever way it claims (relay.claims):
# running under its lease, or in flight in one of its live batch leases (pending and fresh in
# the table until their outcome: relay/db/queries/batches.sql).
# Two index-friendly halves rather than one OR over the table: under a held snapshot a whole-
# table scan (every dead row version kept) outlasted batches that live for milliseconds.
HELD_IDS = """
SELECT o.id FROM outbox AS o
WHERE o.status = 'running' AND ($1::text IS NULL OR o.locked_by = $1)
UNION
SELECT o.id FROM outbox_batches AS b
JOIN outbox AS o ON o.destination = b.destination AND o.id > b.first_id AND o.id <= b.last_id
WHERE b.relay IS NOT NULL AND ($1::text IS NULL OR b.relay = $1)
  AND o.status = 'pending' AND o.claims = 0 AND o.run_after <= o.created_at
"""
HOLDS = f"SELECT EXISTS ({HELD_IDS})"


async def fetch(db_url: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


async def fetchval(db_url: str, sql: str, *args: Any) -> Any:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


async def all_delivered(db_url: str, n: int) -> bool:
    return bool(
        await fetchval(db_url, "SELECT count(*) = $1 FROM outbox WHERE status = 'delivered'", n)
    )


async def max_lag(db_url: str) -> float:
    """Worst commit-to-delivery time of the run, seconds."""
    lag = await fetchval(
        db_url, "SELECT extract(epoch FROM max(delivered_at - created_at))::float8 FROM outbox"
    )
    return round(float(lag or 0.0), 2)


@dataclass
class Copies:
    """What reached Kafka: how many copies of each outbox id."""

    per_id: Counter[int]

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in self.per_id.values())

    @property
    def duplicated_ids(self) -> set[int]:
        return {i for i, n in self.per_id.items() if n > 1}


async def read_copies(bootstrap: str, topic: str, ids: list[int], timeout: float = 60) -> Copies:
    """Read every copy of ``ids`` from ``topic`` and check what a consumer relies on:
    a redelivery is the same message (key, value, headers) under the same ``outbox-id``,
    and one event (the writer's ``n``) never appears under two ids."""
    want = set(ids)
    records = await consume(
        bootstrap,
        topic,
        count=len(want),
        timeout=timeout,
        done=lambda recs: want <= {outbox_id(r) for r in recs if _relayed(r)},
    )
    records = [r for r in records if _relayed(r)]  # not a test's own probe
    per_id: Counter[int] = Counter()
    first: dict[int, tuple[Any, ...]] = {}
    ids_of_event: defaultdict[int, set[int]] = defaultdict(set)
    for r in records:
        i = outbox_id(r)
        per_id[i] += 1
        shape = (r.key, r.value, tuple(sorted(r.headers)))
        assert first.setdefault(i, shape) == shape, f"outbox-id {i} arrived with other content"
        assert r.value is not None
        ids_of_event[json.loads(r.value)["n"]].add(i)
    missing = want - set(per_id)
    assert not missing, f"{len(missing)} events never reached Kafka: {sorted(missing)[:5]}…"
    assert all(len(s) == 1 for s in ids_of_event.values()), "an event arrived under two ids"
    return Copies(per_id)


# A witness of the fencing promise, independent of the relay: every change that takes a row
# (an event of outbox, or a delivery of outbox_deliveries) out of `running` must come from the
# claim that holds it. An event's outcome carries its claim's token into `claims` (RECORD writes
# it back, unchanged when all is well); a delivery's outcome is fenced on its token and leaves
# `claims` alone (DELIVERY_RECORD), so there only the session is checked. And the outcome comes
# from the session of the relay holding the row; a reap (another relay taking back an expired
# lease) is the one legitimate exception. Every row taken out of `running` after its lease
# expired (a reap, or its holder's late outcome) is kept in outbox_expiries: a row sent twice
# must be one of them. `tbl` says which table (TG_TABLE_NAME).
AUDIT = """
CREATE TABLE IF NOT EXISTS outbox_overwrites (
    tbl text, id bigint, old_claims int, new_claims int, held_by text, written_by text,
    new_status text, at timestamptz DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS outbox_expiries (
    tbl text, id bigint, held_by text, written_by text, new_status text,
    at timestamptz DEFAULT clock_timestamp()
);
CREATE OR REPLACE FUNCTION outbox_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.status = 'running' AND NEW.status <> 'running'
       AND OLD.locked_until < now() THEN
        INSERT INTO outbox_expiries (tbl, id, held_by, written_by, new_status)
        VALUES (TG_TABLE_NAME, OLD.id, OLD.locked_by, current_setting('application_name'),
                NEW.status);
    END IF;
    IF TG_OP = 'UPDATE' AND OLD.status = 'running' AND NEW.status <> 'running'
       AND (NEW.claims <> OLD.claims
            OR (current_setting('application_name') <> 'outbox-relay:' || OLD.locked_by
                AND OLD.locked_until >= now())) THEN
        INSERT INTO outbox_overwrites (tbl, id, old_claims, new_claims, held_by, written_by,
                                       new_status)
        VALUES (TG_TABLE_NAME, OLD.id, OLD.claims, NEW.claims, OLD.locked_by,
                current_setting('application_name'), NEW.status);
    END IF;
    IF TG_OP = 'DELETE' THEN
        -- retention = 0: a delivered row is deleted by the outcome that records it. A delete
        -- carries no token, so only the session is checked: the holder's, or none at all.
        IF OLD.status = 'running'
           AND current_setting('application_name') <> 'outbox-relay:' || OLD.locked_by THEN
            INSERT INTO outbox_overwrites (tbl, id, old_claims, new_claims, held_by,
                                           written_by, new_status)
            VALUES (TG_TABLE_NAME, OLD.id, OLD.claims, NULL, OLD.locked_by,
                    current_setting('application_name'), 'deleted');
        END IF;
        RETURN OLD;
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS outbox_audit ON outbox;
CREATE TRIGGER outbox_audit BEFORE UPDATE OR DELETE ON outbox
    FOR EACH ROW EXECUTE FUNCTION outbox_audit();
DROP TRIGGER IF EXISTS outbox_audit ON outbox_deliveries;
CREATE TRIGGER outbox_audit BEFORE UPDATE OR DELETE ON outbox_deliveries
    FOR EACH ROW EXECUTE FUNCTION outbox_audit();
"""


async def install_audit(db_url: str) -> None:
    """Start counting outcomes recorded over a newer claim, of events and of deliveries (see
    AUDIT)."""
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(AUDIT)
    finally:
        await conn.close()


async def end_of_run(db_url: str) -> dict[str, int]:
    """The figures every fault test ends with, all asserted to be 0: events and deliveries
    left `running` (held by nobody alive, or by a relay that lost track of them) and outcomes
    recorded over a newer claim of their row (either table)."""
    figures = {
        "rows_left_running": int(
            await fetchval(db_url, "SELECT count(*) FROM outbox WHERE status = 'running'")
        ),
        "deliveries_left_running": int(
            await fetchval(
                db_url, "SELECT count(*) FROM outbox_deliveries WHERE status = 'running'"
            )
        ),
        "outcomes_over_newer_claim": int(
            await fetchval(db_url, "SELECT count(*) FROM outbox_overwrites")
        ),
    }
    if figures["outcomes_over_newer_claim"]:
        overwrites = await fetch(db_url, "SELECT * FROM outbox_overwrites ORDER BY at LIMIT 5")
        raise AssertionError((figures, [dict(r) for r in overwrites]))
    assert figures == dict.fromkeys(figures, 0), figures
    return figures


def _relayed(record: Any) -> bool:
    return any(k == "outbox-id" for k, _ in record.headers)


def kill(proc: RelayProcess) -> None:
    proc.signal(signal.SIGKILL)
    proc.wait(10)


def jitter(lo: float, hi: float) -> float:
    return random.uniform(lo, hi)
