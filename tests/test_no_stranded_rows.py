"""No claimed row is ever stranded: whatever raises while a batch is delivered, claimed or
recorded, every row ends recorded or back in pending, and the relay keeps delivering the rest.

The faults are injected into the relay's own steps (an exception where a bug would raise);
PostgreSQL is real, and refusals that PostgreSQL itself makes come from triggers on the table.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

import asyncpg
import pytest
from structlog.testing import capture_logs

import outbox
import relay.backoff
import relay.obs.tracing
import relay.pipeline.sending
import relay.runtime.shutdown
from outbox.dburl import to_asyncpg_dsn
from relay.app import Relay
from relay.config import ConfigError
from relay.model import Envelope, Outcome
from relay.pipeline.completer import Completer
from relay.pipeline.sending import Sending
from tests.support import pg
from tests.support.faults import HELD_IDS
from tests.support.relays import running, settings, wait_until
from tests.support.sinks import MemorySink

LEASE = 4.0


class Sink(MemorySink):
    """Delivers everything, or fails each row's first attempt; counts what it was given."""

    def __init__(self, *, fail_first: bool = False, raise_once: bool = False) -> None:
        self.fail_first = fail_first
        self.raise_once = raise_once
        self.calls: dict[int, int] = {}

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
        if self.raise_once:
            self.raise_once = False
            raise RuntimeError("injected at sink")
        out = []
        for env in batch:
            n = self.calls[env.id] = self.calls.get(env.id, 0) + 1
            if self.fail_first and n == 1:
                out.append(Outcome.retry(env.id, "first attempt fails"))
            else:
                out.append(Outcome.delivered(env.id))
        return out


def relay_settings(db_url: str, **relay: Any) -> Any:
    return settings(
        db_url,
        "127.0.0.1:1",
        relay={
            "lease": LEASE,
            "poll_interval": 0.05,
            "backoff": {"base": 0.05, "factor": 1, "jitter": 0},
            **relay,
        },
    )


async def enqueue(db_url: str, n: int, destination: str = "orders") -> list[int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            return await outbox.enqueue_many(
                conn,
                [
                    {"destination": destination, "payload": {"i": i}, "headers": {"n": str(i)}}
                    for i in range(n)
                ],
            )
    finally:
        await conn.close()


async def rows(db_url: str, ids: list[int] | None = None) -> dict[int, asyncpg.Record]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        # Not created_at: one test stores a time beyond what Python can read.
        found = await conn.fetch(
            "SELECT id, status, attempts, last_error, claims FROM outbox ORDER BY id"
        )
    finally:
        await conn.close()
    return {r["id"]: r for r in found if ids is None or r["id"] in ids}


async def delivered(db_url: str, ids: list[int]) -> bool:
    got = await rows(db_url, ids)
    return len(got) == len(ids) and all(r["status"] == "delivered" for r in got.values())


def fail_once(monkeypatch: pytest.MonkeyPatch, target: object, name: str, label: str) -> list[int]:
    """Make ``target.name`` raise the first time it is called; returns a list that holds one
    item once the fault has fired."""
    real: Callable[..., Any] = getattr(target, name)
    fired: list[int] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not fired:
            fired.append(1)
            raise RuntimeError(f"injected at {label}")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapper)
    return fired


def sample(relay: Relay, name: str) -> float:
    return relay.metrics.registry.get_sample_value(name) or 0.0


# Each step of a delivery, and where a bug there would raise.
STEPS: dict[str, tuple[object, str]] = {
    "span start": (relay.obs.tracing, "start_delivery_spans"),
    "header check": (relay.pipeline.sending, "header_problem"),
    "outcome mapping": (Sending, "_records"),
    "backoff": (relay.backoff, "delay"),
    "metrics": (Sending, "_observe"),
    "completer hand-off": (Completer, "add"),
}


@pytest.mark.parametrize("step", [*STEPS, "sink"])
async def test_an_exception_at_any_step_of_delivery_strands_no_row(
    db_url: str, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    sink = Sink(fail_first=step == "backoff", raise_once=step == "sink")
    fired = [1] if step == "sink" else fail_once(monkeypatch, *STEPS[step], step)
    ids = await enqueue(db_url, 5)
    with capture_logs() as logs:
        async with running(relay_settings(db_url), sinks={"orders": sink}) as r:
            # Well within one lease: a stranded row would stay running (its lease renewed)
            # for ever, and one left to the reaper would take a whole lease.
            await wait_until(lambda: delivered(db_url, ids), timeout=LEASE, what=step)
            assert fired, "the fault never fired"
            later = await enqueue(db_url, 5)
            await wait_until(lambda: delivered(db_url, later), timeout=LEASE, what="the rest")
            assert r.in_flight == 0
            assert sample(r, "outbox_leases_expired_total") == 0
            crashes = sample(r, "outbox_delivery_errors_total")
    assert not [e for e in logs if e["event"] == "relay.task.crashed"]
    got = await rows(db_url, ids)
    if step == "completer hand-off":
        # The outcomes were written directly instead: delivered at the first attempt.
        assert any(e["event"] == "relay.record.handoff_failed" for e in logs)
        assert all(x["attempts"] == 1 for x in got.values())
        return
    if step == "metrics":
        # Once the rows are sent, a failure to log or count them changes nothing recorded:
        # delivered at the first attempt, not sent again.
        assert any(e["event"] == "relay.delivery.report_failed" for e in logs)
        assert all(x["attempts"] == 1 and x["status"] == "delivered" for x in got.values())
        return
    if step == "sink":
        assert all(
            "sink error: RuntimeError: injected at sink" in x["last_error"] for x in got.values()
        )
        return
    crashed = [e for e in logs if e["event"] == "relay.delivery.crashed"]
    assert len(crashed) == 1 and crashes == 1
    assert set(crashed[0]["ids"]) == set(ids)
    assert "injected at" in crashed[0]["error"]
    for x in got.values():
        # The crash counted as an attempt, with the error kept for the operator.
        assert x["attempts"] == 2, x
        assert f"RuntimeError: injected at {step}" in x["last_error"]


async def test_rows_whose_sink_returns_no_outcome_are_retried(db_url: str) -> None:
    class Forgetful(MemorySink):
        def __init__(self) -> None:
            self.calls = 0

        async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
            self.calls += 1
            keep = batch if self.calls > 1 else batch[::2]  # forgets every other row once
            return [Outcome.delivered(e.id) for e in keep]

    ids = await enqueue(db_url, 6)
    async with running(relay_settings(db_url), sinks={"orders": Forgetful()}):
        await wait_until(lambda: delivered(db_url, ids), timeout=LEASE, what="all delivered")
    got = await rows(db_url, ids)
    forgotten = [x for x in got.values() if x["attempts"] == 2]
    assert len(forgotten) == 3
    assert all(x["last_error"] == "sink returned no outcome" for x in forgotten)


@pytest.mark.parametrize("headers", ['{"traceparent": 5}', '"traceparent"', "[1, 2]"])
async def test_rows_with_headers_tracing_cannot_read_fail_alone(db_url: str, headers: str) -> None:
    """With OpenTelemetry installed, a row written with plain SQL whose headers are not a
    map of strings fails alone; the rows around it are delivered."""
    assert relay.obs.tracing.tracing.AVAILABLE
    good = await enqueue(db_url, 3)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        bad = await conn.fetchval(
            "INSERT INTO outbox (destination, payload, headers) VALUES ('orders', 'x', $1::jsonb) "
            "RETURNING id",
            headers,
        )
    finally:
        await conn.close()
    async with running(relay_settings(db_url), sinks={"orders": Sink()}):
        await wait_until(lambda: delivered(db_url, good), timeout=LEASE, what="good rows")
        await wait_until(
            lambda: _status(db_url, bad, "failed"), timeout=LEASE, what="bad row failed"
        )
    got = await rows(db_url, [bad])
    assert "header" in got[bad]["last_error"]


async def _status(db_url: str, row_id: int, status: str) -> bool:
    got = await rows(db_url, [row_id])
    return row_id in got and got[row_id]["status"] == status


async def test_a_claim_that_fails_half_way_delivers_what_it_claimed(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows committed as running by the first destination's claim are delivered at once,
    even though the second destination's claim in the same round raised."""
    from relay.db.store import Store

    real = Store.claim
    # The second claim of the first round raises, whichever destination it is for: the
    # first claim's rows are committed as running by then.
    state: dict[str, Any] = {"calls": 0, "claimed_before": None}

    async def claim(self: Store, destination: str, limit: int) -> list[Envelope]:
        state["calls"] += 1
        if state["calls"] == 2:
            raise OSError("injected: connection lost during the second claim")
        got = await real(self, destination, limit)
        if state["calls"] == 1:
            state["claimed_before"] = len(got)
        return got

    monkeypatch.setattr(Store, "claim", claim)
    s = settings(
        db_url,
        "127.0.0.1:1",
        relay={"lease": 30, "poll_interval": 0.05},
        destinations={"a": {"kind": "kafka", "topic": "a"}, "b": {"kind": "kafka", "topic": "b"}},
    )
    a_ids = await enqueue(db_url, 5, "a")
    b_ids = await enqueue(db_url, 5, "b")

    sink = Sink()
    async with running(s, sinks={"a": sink, "b": sink}):
        # Long before the 30 s lease: the claimed rows were not left for the reaper.
        await wait_until(lambda: delivered(db_url, a_ids + b_ids), timeout=10, what="all")
    assert state["claimed_before"] == 5  # the failure came after a claim that took rows
    got = await rows(db_url, a_ids + b_ids)
    assert all(x["attempts"] == 1 and x["last_error"] is None for x in got.values())


# --- recording -------------------------------------------------------------------------------

REFUSE_RETRY_OF = """
CREATE FUNCTION refuse_retry() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id = {id} AND NEW.status = 'pending' AND OLD.status = 'running' THEN
        RAISE EXCEPTION 'value out of range for row {id}' USING ERRCODE = '{code}';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_retry BEFORE UPDATE ON outbox FOR EACH ROW EXECUTE FUNCTION refuse_retry();
"""


# A data error, a business rule raised by a trigger, a program limit: whatever PostgreSQL
# says about one record, short of "I take no writes now".
@pytest.mark.parametrize("code", ["22003", "P0001", "54000"])
async def test_an_outcome_postgres_refuses_fails_its_row_and_the_rest_are_recorded(
    db_url: str, code: str
) -> None:
    ids = await enqueue(db_url, 8)
    bad = ids[3]
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(REFUSE_RETRY_OF.replace("{id}", str(bad)).replace("{code}", code))
    finally:
        await conn.close()

    class OneRetries(MemorySink):
        async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
            return [
                Outcome.retry(e.id, "try later") if e.id == bad else Outcome.delivered(e.id)
                for e in batch
            ]

    with capture_logs() as logs:
        async with running(relay_settings(db_url), sinks={"orders": OneRetries()}) as r:
            others = [i for i in ids if i != bad]
            await wait_until(lambda: delivered(db_url, others), timeout=LEASE, what="the rest")
            await wait_until(lambda: _status(db_url, bad, "failed"), timeout=LEASE, what="bad")
            later = await enqueue(db_url, 3)
            await wait_until(lambda: delivered(db_url, later), timeout=LEASE, what="later")
            ready, checks = await r.readiness()
    assert ready and checks["recording"] == "ok"
    got = await rows(db_url, [bad])
    assert "could not record this row's outcome" in got[bad]["last_error"]
    assert "value out of range" in got[bad]["last_error"]
    rejected = [e for e in logs if e["event"] == "relay.record.rejected"]
    assert [e["id"] for e in rejected] == [bad]


async def test_huge_retry_delays_are_bounded_not_refused(db_url: str) -> None:
    """A sink may ask for any delay (a Retry-After of years, inf, nan): the row waits at most
    relay.config.MAX_SECONDS and the rows around it are recorded."""
    from relay.config import MAX_SECONDS

    ids = await enqueue(db_url, 4)
    asks = dict(zip(ids, (1e13, float("inf"), float("nan"), None), strict=True))

    class Asks(MemorySink):
        async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
            return [Outcome.retry(e.id, "later", asks[e.id]) for e in batch]

    s = relay_settings(db_url, backoff={"base": 30, "jitter": 0})
    async with running(s, sinks={"orders": Asks()}):
        await wait_until(
            lambda: _all(db_url, ids, lambda x: x["attempts"] == 1), timeout=LEASE, what="recorded"
        )
    got = await rows(db_url, ids)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        waits = {
            i: await conn.fetchval(
                "SELECT extract(epoch FROM run_after - now())::float8 FROM outbox WHERE id = $1", i
            )
            for i in ids
        }
    finally:
        await conn.close()
    assert all(x["status"] == "pending" for x in got.values())
    assert MAX_SECONDS - 60 < waits[ids[0]] <= MAX_SECONDS
    assert MAX_SECONDS - 60 < waits[ids[1]] <= MAX_SECONDS
    assert 25 < waits[ids[2]] <= 30 and 25 < waits[ids[3]] <= 30  # nan, None: the backoff


async def _all(db_url: str, ids: list[int], check: Callable[[asyncpg.Record], bool]) -> bool:
    got = await rows(db_url, ids)
    return len(got) == len(ids) and all(check(x) for x in got.values())


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"backoff": {"max": float("inf")}}, "relay.backoff.max"),
        ({"backoff": {"max": float("nan")}}, "relay.backoff.max"),
        ({"backoff": {"base": 1e13}}, "relay.backoff.base"),
        ({"backoff": {"schedule": [1.0, 1e13]}}, "relay.backoff.schedule.1"),
        ({"lease": 1e13}, "relay.lease"),
        ({"lease": float("inf")}, "relay.lease"),
        ({"shutdown_timeout": float("inf")}, "relay.shutdown_timeout"),
        ({"retention": "99999999w"}, "relay.retention"),
    ],
)
def test_config_refuses_durations_postgres_or_timers_cannot_hold(
    override: dict[str, Any], key: str
) -> None:
    with pytest.raises(ConfigError) as err:
        settings("postgresql://x@127.0.0.1/x", "127.0.0.1:1", relay=override)
    assert key in str(err.value)


def test_config_refuses_huge_webhook_durations() -> None:
    dest = {"kind": "webhook", "url": "https://example.com/h", "secrets": ["whsec_" + "A" * 44]}
    for field, value in (("retry_after_max", 1e13), ("retry_after_max", float("inf"))):
        with pytest.raises(ConfigError) as err:
            settings(
                "postgresql://x@127.0.0.1/x",
                "127.0.0.1:1",
                destinations={"h": {**dest, field: value}},
            )
        assert f"destinations.h.webhook.{field}" in str(err.value)
    with pytest.raises(ConfigError) as err:
        settings(
            "postgresql://x@127.0.0.1/x",
            "127.0.0.1:1",
            destinations={"h": {**dest, "circuit": {"cooldown": float("inf")}}},
        )
    assert "circuit.cooldown" in str(err.value)


REFUSE_DELIVERED = """
CREATE FUNCTION refuse_delivered() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'delivered' THEN
        RAISE EXCEPTION 'cannot execute UPDATE in a read-only transaction'
            USING ERRCODE = '25006';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_delivered BEFORE UPDATE ON outbox
    FOR EACH ROW EXECUTE FUNCTION refuse_delivered();
"""


async def test_readiness_fails_while_outcomes_cannot_be_recorded(db_url: str) -> None:
    """The database answers, but refuses to record outcomes: the relay keeps them, says it is
    not ready, and records them once it can."""
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(REFUSE_DELIVERED)
        ids = await enqueue(db_url, 3)
        async with running(relay_settings(db_url), sinks={"orders": Sink()}) as r:

            async def not_ready() -> bool:
                ok, checks = await r.readiness()
                return not ok and "failing" in checks["recording"]

            await wait_until(not_ready, timeout=LEASE, what="not ready")
            ok, checks = await r.readiness()
            assert not ok and checks["database"] == "ok"
            assert "read-only" in checks["recording"]
            # Still held by the relay (running, or in flight in its batch lease).
            assert sorted(r["id"] for r in await conn.fetch(HELD_IDS, None)) == sorted(ids)
            await conn.execute("DROP TRIGGER refuse_delivered ON outbox")
            await wait_until(lambda: delivered(db_url, ids), timeout=10, what="recorded")

            async def ready() -> bool:
                return (await r.readiness())[0]

            await wait_until(ready, timeout=5, what="ready again")
    finally:
        await conn.close()
    got = await rows(db_url, ids)
    assert all(x["attempts"] == 1 for x in got.values())  # recorded, not re-sent


# --- shutdown ---------------------------------------------------------------------------------


# Recording "delivered" waits for an advisory lock the test holds: a slow outcome write.
SLOW_DELIVERED = """
CREATE FUNCTION slow_delivered() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'delivered' THEN
        PERFORM nextval('deliveries_seen');
        PERFORM pg_advisory_xact_lock(4242);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER slow_delivered BEFORE UPDATE ON outbox
    FOR EACH ROW EXECUTE FUNCTION slow_delivered();
"""


async def test_shutdown_waits_for_the_outcome_write_in_progress(db_url: str) -> None:
    """A stop while the completer writes: the write finishes and is recorded, so nothing the
    sink delivered is released and sent again, and the write is not cut short and redone
    (each row's "delivered" reaches the table once: a sequence counts, and sequences do not
    roll back with a cancelled statement)."""
    ids = await enqueue(db_url, 5)
    blocker = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await blocker.execute("CREATE SEQUENCE deliveries_seen")
        await blocker.execute(SLOW_DELIVERED)
        # The server gives up a statement whose client went away (as it does when asyncpg
        # closes a connection whose query was cancelled) instead of finishing it unseen.
        await blocker.execute(
            "SELECT set_config('client_connection_check_interval', '100ms', false)"
        )
        await blocker.execute(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET client_connection_check_interval"
            " = 100', current_database()); END $$"
        )
        await blocker.execute("SELECT pg_advisory_lock(4242)")
        sink = Sink()
        s = relay_settings(db_url, shutdown_timeout=10)
        async with running(s, sinks={"orders": sink}) as r:
            await wait_until(lambda: len(sink.calls) == 5, timeout=LEASE, what="delivered")
            await wait_until(
                lambda: _waiting_on_lock(blocker), timeout=LEASE, what="the write waits"
            )
            r.stop()
            await asyncio.sleep(0.5)  # the shutdown has begun and reached the completer
            await blocker.execute("SELECT pg_advisory_unlock(4242)")
    finally:
        await blocker.close()
    got = await rows(db_url, ids)
    assert all(x["status"] == "delivered" for x in got.values()), [
        (x["id"], x["status"]) for x in got.values()
    ]
    assert all(n == 1 for n in sink.calls.values())
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        assert await conn.fetchval("SELECT last_value FROM deliveries_seen") == len(ids)
    finally:
        await conn.close()


async def _waiting_on_lock(conn: asyncpg.Connection) -> bool:
    return bool(await conn.fetchval(pg.UNGRANTED_ADVISORY))


def test_records_carry_json_safe_errors() -> None:
    """Errors kept in last_error never carry what PostgreSQL text cannot hold."""
    from relay.model import truncate_error

    assert "\x00" not in truncate_error("a\x00b")
    json.dumps(truncate_error("x" * 10_000))


async def test_a_row_python_cannot_read_fails_alone_and_the_relay_stays_up(db_url: str) -> None:
    """Rows written with plain SQL: headers nested deeper than Python's JSON parser goes, a
    created_at beyond Python's year 9999. Claimed (committed as running) with their
    neighbours, they must fail alone, not crash the relay and strand the batch."""
    good = await enqueue(db_url, 3)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        deep = await conn.fetchval(
            "INSERT INTO outbox (destination, payload, headers) "
            "VALUES ('orders', 'x', (repeat('{\"a\":', 5000) || '1' || repeat('}', 5000))::jsonb) "
            "RETURNING id"
        )
        future = await conn.fetchval(
            "INSERT INTO outbox (destination, payload, created_at) "
            "VALUES ('orders', 'y', '12000-01-01'::timestamptz) RETURNING id"
        )
    finally:
        await conn.close()
    with capture_logs() as logs:
        async with running(relay_settings(db_url), sinks={"orders": Sink()}):
            await wait_until(lambda: delivered(db_url, [*good, future]), timeout=LEASE, what="ok")
            await wait_until(lambda: _status(db_url, deep, "failed"), timeout=LEASE, what="deep")
    assert not [e for e in logs if e["event"] in ("relay.task.crashed", "relay.claim.crashed")]
    got = await rows(db_url, [deep])
    assert "headers cannot be read" in got[deep]["last_error"]


async def test_a_row_the_database_refuses_to_reap_does_not_keep_the_others(db_url: str) -> None:
    """Expired leases of a dead relay; a trigger refuses to put one of those rows back.
    The others are reaped all the same (one by one), the refused one is named."""
    ids = await enqueue(db_url, 4)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await conn.execute(
            "UPDATE outbox SET status = 'running', locked_by = 'dead', claims = 1, "
            "locked_until = now() - interval '1 s'"
        )
        await conn.execute(REFUSE_RETRY_OF.replace("{id}", str(ids[1])).replace("{code}", "P0001"))
    finally:
        await conn.close()
    with capture_logs() as logs:
        async with running(relay_settings(db_url), sinks={"orders": Sink()}):
            others = [i for i in ids if i != ids[1]]
            await wait_until(lambda: delivered(db_url, others), timeout=LEASE, what="reaped")
    refused = [e for e in logs if e["event"] == "relay.reap.refused"]
    assert refused and refused[0]["ids"] == [ids[1]]
    got = await rows(db_url, [ids[1]])
    assert got[ids[1]]["status"] == "running"  # the database keeps it so; nothing else can


async def test_a_stalled_database_cannot_hang_the_shutdown(db_url: str) -> None:
    """Stop while every connection of the relay hangs (a partition, a frozen server): the
    relay gives up on the statements it cannot finish and exits; the reaper takes back what
    it could not release."""
    from tests.support.proxy import StallProxy

    proxy = await StallProxy.for_url(db_url).start()
    try:
        ids = await enqueue(db_url, 3)

        class Stuck(MemorySink):
            async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
                await asyncio.Event().wait()
                return []

        s = relay_settings(proxy.url(db_url), shutdown_timeout=1)
        r = Relay(s, sinks={"orders": Stuck()})
        task = asyncio.create_task(r.run())
        await asyncio.wait_for(r.started.wait(), 30)
        await wait_until(lambda: r.in_flight == len(ids), timeout=LEASE, what="held")
        proxy.stall()
        loop = asyncio.get_running_loop()
        stopped = loop.time()
        r.stop()
        status = await asyncio.wait_for(task, 60)
        took = loop.time() - stopped
    finally:
        await proxy.close()
    assert status == 0
    # The drain (shutdown_timeout), then a bounded wait per statement that cannot finish.
    assert took < 1 + relay.runtime.shutdown.FINAL_BUDGET + 2, took


async def test_error_text_the_database_cannot_store_is_escaped_not_fatal(db_url: str) -> None:
    """An endpoint's answer decoded with surrogateescape leaves lone surrogates in the error
    text, which no UTF-8 database stores: the outcome is recorded with its text escaped (a
    transient failure stays transient), not failed."""
    ids = await enqueue(db_url, 2)

    class Garbled(MemorySink):
        async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
            text = b"HTTP 503: \xff\xfe down".decode("utf-8", "surrogateescape")
            return [Outcome.retry(e.id, text) for e in batch]

    s = relay_settings(db_url, backoff={"base": 60, "jitter": 0})
    async with running(s, sinks={"orders": Garbled()}):
        await wait_until(
            lambda: _all(db_url, ids, lambda x: x["attempts"] == 1), timeout=LEASE, what="kept"
        )
    got = await rows(db_url, ids)
    assert all(x["status"] == "pending" for x in got.values())
    assert all("HTTP 503: \\udcff\\udcfe down" in x["last_error"] for x in got.values())


async def test_a_database_that_is_not_utf8_is_refused_at_once(pg_admin_url: str) -> None:
    """Events carry any Unicode text, which a LATIN1 database cannot store (an enqueue would
    abort the caller's transaction): migrate and the relay refuse such a database."""
    import uuid

    import psycopg

    from outbox.migrate import MigrationError, migrate
    from relay.app import RelayStartupError
    from tests.support import pg

    name = f"outbox_latin1_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_admin_url, autocommit=True) as c:
        c.execute(
            f"CREATE DATABASE \"{name}\" ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' "
            "TEMPLATE template0"
        )
    url = pg.with_database(pg_admin_url, name)
    try:
        with pytest.raises(MigrationError, match="encoding is LATIN1: the outbox needs a UTF8"):
            await migrate(url)
        with pytest.raises(RelayStartupError, match="needs a UTF8 database"):
            await Relay(relay_settings(url), sinks={"orders": Sink()}).run()
    finally:
        pg.drop_database(pg_admin_url, name)


async def test_a_database_made_read_only_then_writable_again_is_recovered_from(
    db_url: str,
) -> None:
    """Connections opened while the database defaulted to read-only keep that default: they
    are replaced on that error, so the relay delivers again once writes are allowed, and it
    says it is not ready meanwhile."""
    admin = await asyncpg.connect(to_asyncpg_dsn(db_url))

    async def set_read_only(on: bool) -> None:
        value = "on" if on else "off"
        await admin.execute(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET default_transaction_read_only = "
            + value
            + "', current_database()); END $$"
        )

    try:
        async with running(relay_settings(db_url, relay_id="ro"), sinks={"orders": Sink()}) as r:
            await set_read_only(True)
            # The relay's connections are replaced (a restart, a failover) while it is so.
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = 'outbox-relay:ro'"
            )
            ids = await _enqueue_writable(admin)

            async def not_ready() -> bool:
                ok, checks = await r.readiness()
                return not ok and "read-only" in str(checks.get("claiming"))

            await wait_until(not_ready, timeout=LEASE, what="not ready while read-only")
            await set_read_only(False)
            await wait_until(lambda: delivered(db_url, ids), timeout=10, what="recovered")
            assert (await r.readiness())[0]
    finally:
        await set_read_only(False)
        await admin.close()


async def _enqueue_writable(conn: asyncpg.Connection) -> list[int]:
    """The application writes on a connection of its own, opened before (still writable)."""
    async with conn.transaction():
        return await outbox.enqueue_many(
            conn, [{"destination": "orders", "payload": {"i": i}} for i in range(5)]
        )


async def test_times_out_of_range_stay_out_of_the_latency_metric(db_url: str) -> None:
    """A row whose created_at Python cannot hold ('infinity', '-infinity', plain SQL) is
    delivered like any other, but its commit-to-ack latency is not observed: one such value
    would turn the histogram's sum into nonsense for as long as the relay runs."""
    good = await enqueue(db_url, 2)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        odd = [
            await conn.fetchval(
                "INSERT INTO outbox (destination, payload, created_at) "
                f"VALUES ('orders', 'y', '{when}'::timestamptz) RETURNING id"
            )
            for when in ("infinity", "-infinity", "12000-01-01", "0001-01-01 BC")
        ]
    finally:
        await conn.close()
    async with running(relay_settings(db_url), sinks={"orders": Sink()}) as r:
        await wait_until(lambda: delivered(db_url, [*good, *odd]), timeout=LEASE, what="all")
        histogram = r.metrics.latency
        assert histogram.count("orders") == len(good)
        total = histogram._series["orders"][1][0]
        assert 0 <= total < 3600, total
