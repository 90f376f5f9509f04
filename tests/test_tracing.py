"""Trace propagation: enqueue stores the current W3C context, the relay links to it and the
message carries it. Without a current span, and without OpenTelemetry, nothing changes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator

import asyncpg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import generate_latest

import outbox
from outbox.dburl import to_asyncpg_dsn
from tests.support.kafka import consume
from tests.support.receiver import Receiver
from tests.support.relays import running, settings, wait_until
from tests.test_relay import fetch_rows
from tests.webhook_helpers import SECRET

_EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def provider() -> TracerProvider:
    # The global provider can be set once per process; later modules reuse this one.
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(p)
    return p


@pytest.fixture
def spans(provider: TracerProvider) -> Iterator[InMemorySpanExporter]:
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


async def _enqueue(db_url: str, **kw: object) -> int:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            return await outbox.enqueue(conn, destination="orders", payload={"a": 1}, **kw)  # type: ignore[arg-type]
    finally:
        await conn.close()


async def test_trace_context_travels_from_enqueue_to_the_kafka_header(
    db_url: str, kafka_bootstrap: str, spans: InMemorySpanExporter
) -> None:
    t = f"t-{uuid.uuid4().hex[:10]}"
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("place-order") as span:
        ctx = span.get_span_context()
        traced = await _enqueue(db_url)
        explicit = await _enqueue(
            db_url, headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
        )
    untraced = await _enqueue(db_url)  # no current span

    expected = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    stored = {r["id"]: json.loads(r["headers"]) for r in await fetch_rows(db_url)}
    assert stored[traced] == {"traceparent": expected}
    assert stored[explicit]["traceparent"].startswith("00-1111")  # the caller's own wins
    assert stored[untraced] == {}

    async with running(settings(db_url, kafka_bootstrap, topic=t)) as relay:
        await wait_until(lambda: relay.stats["delivered"] == 3, what="delivered")
    records = {
        int(dict(r.headers)["outbox-id"]): dict(r.headers)
        for r in await consume(kafka_bootstrap, t, count=3)
    }
    assert records[traced]["traceparent"] == expected.encode()
    assert "traceparent" not in records[untraced]

    publish = [s for s in spans.get_finished_spans() if s.name == "orders publish"]
    by_id = {s.attributes["messaging.message.id"]: s for s in publish}  # type: ignore[index]
    assert set(by_id) == {str(traced), str(explicit)}  # untraced rows cost no span
    delivery = by_id[str(traced)]
    assert delivery.kind is SpanKind.PRODUCER
    assert [(ln.context.trace_id, ln.context.span_id) for ln in delivery.links] == [
        (ctx.trace_id, ctx.span_id)
    ]
    assert delivery.attributes["messaging.system"] == "kafka"  # type: ignore[index]
    assert delivery.attributes["outbox.outcome"] == "delivered"  # type: ignore[index]
    assert delivery.status.is_ok


async def test_trace_context_reaches_the_webhook_header_and_metrics_see_the_endpoint(
    db_url: str, receiver: Receiver, spans: InMemorySpanExporter
) -> None:
    receiver.respond(503, times=1)  # one retry first, so attempts show two status classes
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("place-order") as span:
        ctx = span.get_span_context()
        traced = await _enqueue(db_url)
    expected = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    s = settings(
        db_url,
        "127.0.0.1:1",
        destinations={
            "orders": {
                "kind": "webhook",
                "url": receiver.url + "/hook",
                "secrets": [SECRET],
                "allow_private_networks": True,
                "backoff": {"base": 0.05, "jitter": 0},
            }
        },
        relay={"poll_interval": 0.05},
    )
    async with running(s) as relay:
        await wait_until(lambda: relay.stats["delivered"] == 1, what="delivered")
        metrics = generate_latest(relay.metrics.registry).decode()
    ok = [r for r in receiver.requests if r.status == 200]
    assert [int(r.headers["webhook-id"]) for r in ok] == [traced]
    assert ok[0].headers["traceparent"] == expected
    attempts = 'outbox_delivery_attempts_total{destination="orders",outcome="%s",status_class="%s"}'
    assert attempts % ("retry", "5xx") + " 1.0" in metrics
    assert attempts % ("delivered", "2xx") + " 1.0" in metrics
    origin = receiver.url.removeprefix("http://")
    assert f'outbox_circuit_state{{endpoint="orders http://{origin}",sink="webhook"}}' in metrics


async def test_enqueue_many_and_sync_enqueue_carry_the_context(
    db_url: str, spans: InMemorySpanExporter
) -> None:
    from sqlalchemy import create_engine

    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("batch") as span:
        ctx = span.get_span_context()
        conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
        try:
            async with conn.transaction():
                ids = await outbox.enqueue_many(
                    conn,
                    [
                        {"destination": "orders", "payload": {"i": 1}},
                        {"destination": "orders", "payload": {"i": 2}, "headers": {"x": "y"}},
                    ],
                )
        finally:
            await conn.close()
        engine = create_engine("postgresql+psycopg://" + db_url.partition("://")[2])
        try:
            with engine.begin() as sconn:
                sync_id = outbox.enqueue_sync(sconn, destination="orders", payload="s")
        finally:
            engine.dispose()
    want = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    stored = {r["id"]: json.loads(r["headers"]) for r in await fetch_rows(db_url)}
    assert stored[ids[0]] == {"traceparent": want}
    assert stored[ids[1]] == {"traceparent": want, "x": "y"}
    assert stored[sync_id] == {"traceparent": want}


def test_without_opentelemetry_nothing_changes(db_url: str) -> None:
    """The base install: opentelemetry cannot be imported; enqueue and the relay still work."""
    script = textwrap.dedent(
        f"""
        import asyncio, json, sys
        sys.modules["opentelemetry"] = None  # any import of it now fails
        import asyncpg, outbox
        from outbox import tracing
        from relay.obs import tracing as relay_tracing
        from relay.model import Envelope, Lease
        import time
        assert not tracing.AVAILABLE

        async def main():
            conn = await asyncpg.connect({to_asyncpg_dsn(db_url)!r})
            async with conn.transaction():
                i = await outbox.enqueue(conn, destination="orders", payload={{"a": 1}})
            h = await conn.fetchval("SELECT headers::text FROM outbox WHERE id = $1", i)
            await conn.close()
            env = Envelope(i, "orders", None, b"", "x", {{"traceparent": "00-x"}}, 0,
                           time.time(), 1, Lease(1e18))
            print(json.dumps([json.loads(h), relay_tracing.start_delivery_spans([env], "kafka")]))

        asyncio.run(main())
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == [{}, []]
