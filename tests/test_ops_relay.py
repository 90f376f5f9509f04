"""Operations inside the relay: pause, retention, /metrics, /healthz, /readyz.

Real PostgreSQL, a real broker, real HTTP over loopback. One test adds a scripted sink to see
retries and HTTP status classes counted; everything else goes through the Kafka sink.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Sequence

import asyncpg
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from outbox.dburl import to_asyncpg_dsn
from relay.app import Relay, RelayStartupError
from relay.config import ConfigError
from relay.model import Envelope, Outcome
from relay.ops import admin
from relay.pipeline.routes import build_sinks
from relay.settings import load_settings
from tests.support.relays import running, settings, status_counts, wait_until
from tests.test_relay import enqueue_n, fetch_rows


def topic() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


async def execute(db_url: str, query: str, *args: object) -> str:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        return str(await conn.execute(query, *args))
    finally:
        await conn.close()


async def pause(db_url: str, destination: str) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await admin.pause(conn, "public", destination, "test", None)
    finally:
        await conn.close()


async def resume(db_url: str, destination: str) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await admin.resume(conn, "public", destination)
    finally:
        await conn.close()


def two_topics(db_url: str, bootstrap: str, **kw: object) -> object:
    return settings(
        db_url,
        bootstrap,
        destinations={
            "orders": {"kind": "kafka", "topic": topic()},
            "payments": {"kind": "kafka", "topic": topic()},
        },
        **kw,
    )


async def by_destination(db_url: str) -> dict[tuple[str, str], int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        rows = await conn.fetch("SELECT destination, status, count(*) FROM outbox GROUP BY 1, 2")
        return {(r[0], r[1]): r[2] for r in rows}
    finally:
        await conn.close()


# --- pause --------------------------------------------------------------------------------------


async def test_pause_stops_claims_across_two_relays_and_resume_restarts_them(
    db_url: str, kafka_bootstrap: str
) -> None:
    s = two_topics(db_url, kafka_bootstrap, relay={"poll_interval": 0.2})
    async with running(s) as a, running(s) as b:  # type: ignore[arg-type]
        await pause(db_url, "orders")
        await wait_until(
            lambda: "orders" in a.paused and "orders" in b.paused, what="both relays see it"
        )
        await enqueue_n(db_url, 20, destination="orders")
        await enqueue_n(db_url, 20, destination="payments")
        # The NOTIFY woke both relays: payments drain, and several claim rounds pass...
        await wait_until(
            lambda: _count(db_url, ("payments", "delivered"), 20), what="payments delivered"
        )
        await _polled(a, b, rounds=3)
        # ...and the paused destination's rows are untouched.
        assert (await by_destination(db_url)).get(("orders", "pending")) == 20
        assert a.stats["claimed"] + b.stats["claimed"] == 20
        rows = [r for r in await fetch_rows(db_url) if r["destination"] == "orders"]
        assert all(r["attempts"] == 0 and r["locked_by"] is None for r in rows)

        await resume(db_url, "orders")
        await wait_until(
            lambda: _count(db_url, ("orders", "delivered"), 20), what="orders after resume"
        )
        await wait_until(lambda: not a.paused and not b.paused, what="both relays see resume")


async def _polled(a: Relay, b: Relay, rounds: int) -> None:
    """Wait until both relays re-read the paused set ``rounds`` more times."""
    start = (a.paused_refreshes, b.paused_refreshes)
    await wait_until(
        lambda: a.paused_refreshes >= start[0] + rounds and b.paused_refreshes >= start[1] + rounds,
        what="paused set refreshed",
    )


async def _count(db_url: str, key: tuple[str, str], n: int) -> bool:
    return (await by_destination(db_url)).get(key, 0) == n


async def test_a_relay_started_while_paused_never_claims(db_url: str, kafka_bootstrap: str) -> None:
    await pause(db_url, "orders")
    await enqueue_n(db_url, 5)
    s = settings(db_url, kafka_bootstrap, topic=topic(), relay={"poll_interval": 0.2})
    async with running(s) as relay:
        assert relay.paused == {"orders"}
        await _polled(relay, relay, rounds=2)
        assert relay.stats["claimed"] == 0
    assert (await status_counts(db_url)) == {"pending": 5}


# --- retention ----------------------------------------------------------------------------------


async def _aged_rows(db_url: str) -> dict[str, list[int]]:
    """Rows in every state, half of them two hours old."""
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    out: dict[str, list[int]] = {}
    try:
        for name, status, age, finished in [
            ("old_delivered", "delivered", "2 hours", "2 hours"),
            ("new_delivered", "delivered", "1 minute", "1 minute"),
            ("old_failed", "failed", "2 hours", "2 hours"),
            ("old_pending", "pending", "2 hours", None),
            ("old_skipped", "skipped", "3 hours", "2 hours"),
            # An old event an operator skipped a minute ago: kept for the retention period.
            ("new_skipped", "skipped", "3 hours", "1 minute"),
        ]:
            rows = await conn.fetch(
                """
                INSERT INTO outbox (destination, payload, status, created_at, delivered_at,
                                    run_after, finished_at)
                SELECT 'elsewhere', '\\x00', $1, now() - $2::text::interval,
                       CASE WHEN $1 = 'delivered' THEN now() - $2::text::interval END,
                       now() + interval '1 day', now() - $3::text::interval
                FROM generate_series(1, 25) RETURNING id
                """,
                status,
                age,
                finished,
            )
            out[name] = sorted(r[0] for r in rows)
    finally:
        await conn.close()
    return out


async def test_retention_deletes_only_delivered_and_skipped_rows_past_retention(
    db_url: str, kafka_bootstrap: str
) -> None:
    rows = await _aged_rows(db_url)
    s = settings(
        db_url,
        kafka_bootstrap,
        topic=topic(),
        relay={"retention": "1h", "retention_interval": 0.2, "retention_batch_size": 10},
    )
    async with running(s) as a, running(s) as b:
        await wait_until(
            lambda: _gone(db_url, rows["old_delivered"] + rows["old_skipped"]),
            what="old delivered and skipped rows deleted",
        )
        fresh = await enqueue_n(db_url, 3)
        await wait_until(lambda: _ids_with(db_url, "delivered", fresh), what="fresh delivered")
        deleted = (
            a.metrics.retention_deleted._value.get() + b.metrics.retention_deleted._value.get()
        )
    left = {r["id"]: r["status"] for r in await fetch_rows(db_url)}
    assert not set(rows["old_delivered"]) & set(left)
    for name in ("new_delivered", "old_failed", "old_pending", "new_skipped"):
        assert set(rows[name]) <= set(left), name
    assert all(left[i] == "delivered" for i in fresh)  # delivered just now: kept
    assert deleted == 50  # by whichever relay held the lock; never twice


async def _gone(db_url: str, ids: Sequence[int]) -> bool:
    return not {r["id"] for r in await fetch_rows(db_url)} & set(ids)


async def _ids_with(db_url: str, status: str, ids: Sequence[int]) -> bool:
    rows = {r["id"]: r["status"] for r in await fetch_rows(db_url)}
    return all(rows.get(i) == status for i in ids)


async def test_retention_zero_deletes_delivered_rows_as_it_records_them(
    db_url: str, kafka_bootstrap: str
) -> None:
    keep = await _aged_rows(db_url)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            big = await conn.fetchval(
                "INSERT INTO outbox (destination, payload) VALUES ('orders', $1) RETURNING id",
                b"x" * 20_000,
            )
    finally:
        await conn.close()
    sent = await enqueue_n(db_url, 30)
    s = settings(
        db_url,
        kafka_bootstrap,
        topic=topic(),
        kafka={"max_request_size": 4096},
        relay={"retention": 0, "retention_interval": 600},
    )
    async with running(s) as relay:
        await wait_until(lambda: relay.stats["delivered"] == 30, what="30 delivered")
        await wait_until(lambda: relay.stats["failed"] == 1, what="oversize failed")
        left = {r["id"]: r["status"] for r in await fetch_rows(db_url)}
        assert not set(sent) & set(left)  # deleted by the RECORD statement itself
        assert left[big] == "failed"  # a failure is kept for `retry`
        # The retention job's first run (at start) took the old delivered rows too.
        await wait_until(lambda: _gone(db_url, keep["old_delivered"] + keep["new_delivered"]))
    left = {r["id"]: r["status"] for r in await fetch_rows(db_url)}
    assert set(keep["old_failed"]) | set(keep["old_pending"]) | {big} == set(left)


def test_retention_accepts_durations_and_names_bad_ones() -> None:
    base = {"database_url": "postgresql://x/y"}
    assert load_settings(None, **base, relay={"retention": "1h30m"}).relay.retention == 5400
    assert load_settings(None, **base, relay={"retention": 0}).relay.retention == 0
    assert load_settings(None, **base).relay.retention == 3600
    with pytest.raises(ConfigError, match=r"relay\.retention: .*not a duration"):
        load_settings(None, **base, relay={"retention": "forever"})


def test_http_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_HTTP_PORT", "9191")
    monkeypatch.setenv("OUTBOX_HTTP_ENABLED", "false")
    s = load_settings(None, database_url="postgresql://x/y")
    assert (s.http.port, s.http.enabled, s.http.host) == (9191, False, "0.0.0.0")


# --- metrics ------------------------------------------------------------------------------------


class ScriptedWebhookLike:
    """An in-memory sink answering like an HTTP endpoint: 503 on the first attempt, then 200."""

    kind = "webhook"

    def __init__(self) -> None:
        from relay.breaker import Breaker

        self.breaker = Breaker(threshold=100)

    async def start(self) -> None:
        pass

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
        return [
            Outcome.retry(e.id, "HTTP 503", retry_in=0.05, status_class="5xx")
            if e.attempts == 0
            else Outcome.delivered(e.id, status_class="2xx")
            for e in batch
        ]

    def available(self, destination: str) -> bool:
        return True

    def ready(self, destination: str) -> bool:
        return True

    def circuits(self) -> dict[str, object]:
        return {"http://hooks.example/in": self.breaker}

    async def close(self) -> None:
        pass


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def get(
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return values[name, tuple(sorted(labels.items()))]


async def test_metrics_after_a_known_run(db_url: str, kafka_bootstrap: str) -> None:
    s = settings(
        db_url,
        kafka_bootstrap,
        destinations={
            "orders": {"kind": "kafka", "topic": topic()},
            "later": {"kind": "kafka", "topic": topic()},
            "hooks": {"kind": "kafka", "topic": topic()},
        },
        kafka={"max_request_size": 4096},
        relay={"stats_interval": 0.2, "poll_interval": 0.2},
    )
    sinks = build_sinks(s)
    sinks["hooks"] = ScriptedWebhookLike()  # type: ignore[assignment]
    await pause(db_url, "later")
    await enqueue_n(db_url, 3, destination="later")
    await enqueue_n(db_url, 5, destination="orders")
    await enqueue_n(db_url, 4, destination="hooks")
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            await conn.execute(
                "INSERT INTO outbox (destination, payload) VALUES ('orders', $1)", b"x" * 20_000
            )
    finally:
        await conn.close()

    async with running(s, sinks=sinks) as relay:
        assert relay.http is not None
        url = f"http://127.0.0.1:{relay.http.port}"
        await wait_until(
            lambda: relay.stats["delivered"] == 9 and relay.stats["failed"] == 1, what="settled"
        )
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:

            async def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
                res = await client.get("/metrics")
                assert res.status_code == 200
                assert res.headers["content-type"].startswith("text/plain")
                return metric_values(res.text)

            async def stats_seen() -> bool:
                # A refresh taken after the run settled: one taken before it (every 0.2 s)
                # already shows "later" at 3, but "orders" still pending.
                v = await scrape()
                return (
                    v.get(("outbox_pending_rows", (("destination", "later"),))) == 3
                    and v.get(("outbox_pending_rows", (("destination", "orders"),))) == 0
                )

            await wait_until(stats_seen, what="pending gauges refreshed")
            v = await scrape()
    assert get(v, "outbox_relay_up") == 1
    assert get(v, "outbox_events_delivered_total", destination="orders") == 5
    assert get(v, "outbox_events_delivered_total", destination="hooks") == 4
    assert get(v, "outbox_events_failed_total", destination="orders") == 1
    assert get(v, "outbox_events_retried_total", destination="hooks") == 4
    attempts = {
        (dict(k[1])["destination"], dict(k[1])["outcome"], dict(k[1])["status_class"]): n
        for k, n in v.items()
        if k[0] == "outbox_delivery_attempts_total"
    }
    assert attempts == {
        ("orders", "delivered", "none"): 5,
        ("orders", "failed", "none"): 1,
        ("hooks", "retry", "5xx"): 4,
        ("hooks", "delivered", "2xx"): 4,
    }
    claimed = relay.stats["claimed"]
    assert claimed == 14  # 6 orders, 4 + 4 hooks
    assert get(v, "outbox_claim_batch_size_sum") == claimed
    assert 1 <= get(v, "outbox_claim_batch_size_count") <= claimed
    assert get(v, "outbox_commit_to_ack_seconds_count", destination="orders") == 5
    assert get(v, "outbox_commit_to_ack_seconds_count", destination="hooks") == 4
    assert get(v, "outbox_commit_to_ack_seconds_bucket", destination="orders", le="+Inf") == 5
    assert 0 < get(v, "outbox_commit_to_ack_seconds_sum", destination="orders") < 60
    assert get(v, "outbox_pending_rows", destination="later") == 3
    assert get(v, "outbox_pending_rows", destination="orders") == 0
    assert 0 < get(v, "outbox_oldest_pending_age_seconds", destination="later") < 60
    assert get(v, "outbox_destination_paused", destination="later") == 1
    assert get(v, "outbox_destination_paused", destination="orders") == 0
    assert get(v, "outbox_in_flight_rows", source="events") == 0
    assert (
        get(
            v,
            "outbox_circuit_state",
            sink="webhook",
            endpoint="http://hooks.example/in",
        )
        == 0
    )
    assert get(v, "outbox_circuit_state", sink="kafka", endpoint=kafka_bootstrap) == 0


# --- probes -------------------------------------------------------------------------------------


async def test_readyz_turns_unready_when_the_database_is_gone(
    db_url: str, kafka_bootstrap: str
) -> None:
    await enqueue_n(db_url, 1)
    name = db_url.rsplit("/", 1)[1]
    admin_url = db_url.rsplit("/", 1)[0] + "/postgres"
    s = settings(db_url, kafka_bootstrap, topic=topic())
    async with running(s) as relay:
        assert relay.http is not None
        await wait_until(lambda: relay.stats["delivered"] == 1, what="sink connected")
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{relay.http.port}", timeout=10
        ) as client:
            assert (await client.get("/healthz")).status_code == 200
            ready = await client.get("/readyz")
            assert ready.status_code == 200, ready.text
            assert ready.json()["database"] == "ok"
            assert ready.json()["sinks"] == {"orders": True}
            assert (await client.get("/nope")).status_code == 404
            try:
                await execute(admin_url, f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
                await execute(
                    admin_url,
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = $1 AND pid <> pg_backend_pid()",
                    name,
                )

                async def unready() -> bool:
                    return (await client.get("/readyz")).status_code == 503

                await wait_until(unready, what="/readyz 503")
                body = (await client.get("/readyz")).json()
                assert body["status"] == "fail" and body["database"] != "ok"
                assert (await client.get("/healthz")).status_code == 200  # alive, just unready
            finally:
                await execute(admin_url, f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')

            async def ready_again() -> bool:
                return (await client.get("/readyz")).status_code == 200

            await wait_until(ready_again, what="/readyz 200 again")
            relay.stop()
            stopping = await client.get("/readyz")
            assert stopping.status_code == 503 and stopping.json()["shutting_down"] is True


async def test_port_in_use_is_a_clear_startup_error(db_url: str, kafka_bootstrap: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        s = settings(db_url, kafka_bootstrap, topic=topic(), http={"port": port})
        with pytest.raises(RelayStartupError, match=rf"127\.0\.0\.1:{port}.*http\.port"):
            await Relay(s).run()


async def test_relay_runs_without_the_listener(db_url: str, kafka_bootstrap: str) -> None:
    ids = await enqueue_n(db_url, 3)
    s = settings(db_url, kafka_bootstrap, topic=topic(), http={"enabled": False})
    async with running(s) as relay:
        assert relay.http is None
        await wait_until(lambda: _ids_with(db_url, "delivered", ids), what="delivered")
        assert relay.metrics.delivered.labels("orders")._value.get() == 3
