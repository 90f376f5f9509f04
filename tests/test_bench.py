"""`outbox-relay bench` runs each scenario end to end (small sizes; no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def bench(*args: str, admin: str) -> dict[str, Any]:
    res = subprocess.run(
        [sys.executable, "-m", "relay.cli", "bench", *args, "--database-url", admin, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out: dict[str, Any] = json.loads(res.stdout[res.stdout.index("{") :])
    assert out["machine"]["cores"] >= 1 and out["machine"]["postgresql"]
    return out


def test_drain_against_kafka_with_naive_comparison(pg_admin_url: str, kafka_bootstrap: str) -> None:
    out = bench(
        "drain",
        "--events",
        "3000",
        "--bootstrap",
        kafka_bootstrap,
        "--no-idempotence",
        "--compare-naive",
        "--naive-events",
        "100",
        "--batch-size",
        "200",
        admin=pg_admin_url,
    )
    d = out["drain"]
    assert d["complete"] is True and d["delivered"] == 3000
    # 3000 events at batch 200: 15 claims and a handful of recordings, never one per row.
    assert d["hot_path_statements"] < 100
    assert out["naive loop"]["events"] == 100
    assert out["sink"].startswith("kafka")


def test_drain_with_retention_zero_beside_the_simple_loop(
    pg_admin_url: str, kafka_bootstrap: str
) -> None:
    out = bench(
        "drain",
        "--events",
        "3000",
        "--bootstrap",
        kafka_bootstrap,
        "--no-idempotence",
        "--retention",
        "0",
        "--compare-simple",
        admin=pg_admin_url,
    )
    assert out["drain"]["complete"] is True and out["drain"]["delivered"] == 3000
    simple = out["simple loop"]
    assert simple["events"] == 3000 and simple["loops"] == 4
    assert out["ratios"]["relay_vs_simple"] > 0
    # The host's other CPU (database, broker) is shown beside the relay's, on Linux.
    assert out["drain"]["others_cpu_per_event_us"] is not None


def test_steady_reports_latency_and_idle_cost(pg_admin_url: str) -> None:
    out = bench(
        "steady",
        "--sink",
        "null",
        "--rate",
        "200",
        "--seconds",
        "1",
        "--idle-seconds",
        "0.5",
        admin=pg_admin_url,
    )
    s = out["steady 200/s"]
    assert s["events"] == 200 and s["acked"] == 200
    assert 0 < s["p50_ms"] <= s["p99_ms"] <= s["max_ms"]


def test_enqueue_and_history(pg_admin_url: str) -> None:
    out = bench(
        "enqueue",
        "--transactions",
        "50",
        "--bulk-rows",
        "3000",
        "--chunk",
        "1000",
        admin=pg_admin_url,
    )
    e = out["enqueue"]
    assert e["enqueue_many_rows"] == 3000 and e["tx_with_event_ms"] > 0
    out = bench("history", "--rows", "20000", "--rounds", "10", admin=pg_admin_url)
    h = out["history"]
    assert h["delivered_rows"] == 20000 and h["empty_p50_ms"] > 0 and h["history_p50_ms"] > 0


def test_drain_ordered_vs_unordered_and_webhook_sink(pg_admin_url: str) -> None:
    out = bench(
        "drain",
        "--sink",
        "null",
        "--events",
        "3000",
        "--keys",
        "50",
        "--ordering",
        "both",
        admin=pg_admin_url,
    )
    assert out["drain"]["complete"] is True and out["drain"]["ordering"] == "none"
    ordered = out["drain ordering=key"]
    assert ordered["complete"] is True and ordered["ordering"] == "key"
    assert out["ratios"]["ordered_vs_unordered"] > 0
    out = bench("drain", "--sink", "webhook", "--events", "1000", admin=pg_admin_url)
    assert out["drain"]["complete"] is True and out["drain"]["delivered"] == 1000
    assert out["sink"].startswith("webhook to http://127.0.0.1:")


def test_steady_prints_no_latency_for_a_rate_it_did_not_offer() -> None:
    """Latencies measured at 6k/s must not be printed as the latencies of 10k/s."""
    from relay.sinks.null import NullSink
    from relay.tools.bench.common import TimingSink
    from relay.tools.bench.steady import _report, load_shape

    sink = TimingSink(NullSink())
    sink.acked = {i: 100.0 + 0.01 for i in range(600)}
    commits = {i: 100.0 for i in range(600)}
    short = _report(sink, commits, 0.1, 10_000, 10, 2, 0.0)  # 6,000/s of 10,000/s
    assert short["rate_reached"] is False
    assert "p99_ms" not in short and "6,000/s of 10,000/s" in short["latency"]
    full = _report(sink, commits, 0.0605, 10_000, 10, 2, 0.0)  # 9,917/s
    assert full["rate_reached"] is True and full["p99_ms"] > 0
    assert load_shape(1000, None, None) == (1, 1)
    assert load_shape(3000, None, None) == (6, 2)
    assert load_shape(10_000, None, None) == (20, 2)
    assert load_shape(10_000, 5, 3) == (5, 3)  # what the user says wins


STATUSES = ("delivered", "pending", "running", "failed", "cancelled")


def test_fanout_accounts_for_every_delivery(pg_admin_url: str) -> None:
    """Tiny bounded runs of `bench fanout`: the report's counts match the database's rows."""
    out = bench(
        "fanout",
        "--compare",
        "--endpoints",
        "2",
        "--rate",
        "100",
        "--seconds",
        "1",
        "--slow-delay",
        "0.2",
        "--dead-backlog",
        "50",
        admin=pg_admin_url,
    )
    for name, matching, backlog in (("steady", 2, 0), ("steady slow+dead", 4, 50)):
        s = out[name]
        assert s["complete"] is True and s["accounted"] is True, s
        assert s["events"] == 100 and s["endpoints_matching"] == matching
        assert s["deliveries"] == s["deliveries_expected"] == 100 * matching + backlog
        assert sum(s[f"deliveries_{st}"] for st in STATUSES) == s["deliveries"]
        assert s["healthy_delivered"] == s["healthy_received"] == s["healthy_expected"] == 200
        assert s["attempts_logged"] >= s["deliveries_delivered"] >= 200
        assert 0 < s["p50_ms"] <= s["p99_ms"] <= s["max_ms"]
    assert out["steady slow+dead"]["deliveries_pending"] >= 50  # the dead one's backlog
    assert out["ratios"]["p99_ms slow_dead_vs_without"] > 0
    out = bench(
        "fanout",
        "--scenario",
        "scale",
        "--registered",
        "40",
        "--fan-out",
        "2",
        "--events",
        "100",
        admin=pg_admin_url,
    )
    for name, registered in (("scale 2", 2), ("scale 40", 40)):
        s = out[name]
        assert s["endpoints_registered"] == registered and s["accounted"] is True, s
        assert s["deliveries"] == s["deliveries_delivered"] == s["healthy_received"] == 200
        assert s["probe_deliveries"] == s["probe_claimed"] == 200
    assert "relay_cpu_us_per_delivery registered_vs_matching_only" in out["ratios"]


def test_fanout_with_slow_endpoints_beside_a_small_max_in_flight(pg_admin_url: str) -> None:
    """The fair share's case, bounded: several endpoints answering 2xx slowly (under the
    timeout) beside a max_in_flight they could fill; every healthy delivery accounted."""
    out = bench(
        "fanout",
        "--compare",
        "--endpoints",
        "1",
        "--slow-endpoints",
        "3",
        "--slow-delay",
        "0.5",
        "--timeout",
        "1",
        "--max-in-flight",
        "8",
        "--max-concurrency",
        "4",
        "--rate",
        "50",
        "--seconds",
        "1",
        admin=pg_admin_url,
    )
    s = out["steady slow+dead"]
    assert s["complete"] is True and s["accounted"] is True, s
    assert (s["slow_endpoints"], s["max_in_flight"], s["timeout_s"]) == (3, 8, 1.0)
    assert s["endpoints_matching"] == 5 and s["healthy_delivered"] == 50
    assert out["steady"]["max_in_flight"] == 8
    assert "target_p99_within_2x" in out["ratios"]


def test_console_pages_over_a_small_and_an_estimated_outbox(pg_admin_url: str) -> None:
    """`bench console`, bounded: every page answers 200 (the run fails otherwise); 20,000 rows
    are counted exactly, 150,000 (more than 100,000 delivered) estimated, within a few %."""
    out = bench("console", "--rows", "20000", "--requests", "3", admin=pg_admin_url)
    c = out["console"]
    assert c["rows"] == 20000 and sum(v for k, v in c.items() if k.startswith("rows ")) == 20000
    assert c["delivered_estimated"] is False and c["delivered_shown"] == c["rows delivered"]
    assert c["failed_shown"] == c["rows failed"] > 0
    for page in ("GET /", "GET /api/series", "GET /rows?status=failed", "admin.status"):
        assert 0 < c[f"{page} p50_ms"] <= c[f"{page} p95_ms"], page
    assert c["GET / n"] == 3
    out = bench("console", "--rows", "150000", "--requests", "3", admin=pg_admin_url)
    c = out["console"]
    assert c["delivered_estimated"] is True and abs(c["delivered_error_pct"]) < 5
    assert c["failed_shown"] == c["rows failed"]
