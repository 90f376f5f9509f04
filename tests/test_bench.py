"""`outbox-relay bench` runs each scenario end to end (small sizes; no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest


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
        # A rate the writers reach on a busy machine too (the bench reports no latency for a
        # rate that was not offered).
        "--rate",
        "100",
        "--seconds",
        "4",
        "--window",
        "0.5",
        "--warmup",
        "0.5",
        "--ordering",
        "key",
        "--keys",
        "10",
        "--hold-snapshot",
        "--idle-seconds",
        "0.5",
        admin=pg_admin_url,
    )
    s = out["steady 100/s"]
    assert s["events"] == 400 and s["acked"] == 400
    assert 0 < s["p50_ms"] <= s["p99_ms"] <= s["max_ms"]
    assert s["ordering"] == "key" and s["keys"] == 10
    # Per window of commit time: every event in one of them.
    windows = s["windows"]
    assert len(windows) >= 4 and sum(w["events"] for w in windows) == 400
    assert [w["from_s"] for w in windows] == [i * 0.5 for i in range(len(windows))]
    assert s["first_minute"]["from_s"] == 0.5 and s["last_minute_p99_ratio"] > 0
    # The snapshot was held by its own backend until the end of the run.
    assert s["snapshot_xmin"] is not None and s["snapshot_xmin_at_end"] == s["snapshot_xmin"]
    assert s["snapshot_held_seconds"] >= 2
    # The happy path: the claim's UPDATE and the outcome's UPDATE, none of them removable.
    assert s["outbox_inserts"] == 400 and s["row_versions_written_per_event"] == 2.0
    assert s["dead_rows_per_event"] >= 1.5  # an autoanalyze may have estimated it since
    assert s["outbox_table_mb"] > 0 and s["outbox_indexes_mb"] > 0


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
    # The catalog's phases (#31): each wrote its rows, and the check alone was timed.
    assert e["enqueue_many_typed_rows"] == e["enqueue_many_validated_rows"] == 3000
    assert e["tx_with_validated_event_ms"] > 0 and e["tx_with_typed_event_ms"] > 0
    assert 0 < e["validate_200b_us_p50"] <= e["validate_200b_us_p99"]
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
        "--hold-snapshot",
        admin=pg_admin_url,
    )
    assert out["drain"]["complete"] is True and out["drain"]["ordering"] == "none"
    ordered = out["drain ordering=key"]
    assert ordered["complete"] is True and ordered["ordering"] == "key"
    # Held from after the prefill: the drain's updates are all still there, dead. One per
    # event under batch leases (relay.claims "auto" here: the outcome's), two by row (ordered).
    for d, per_event in ((out["drain"], 1), (ordered, 2)):
        assert d["snapshot_xmin_at_end"] is not None
        assert d["outbox_updates"] >= 3000 * per_event
        assert d["row_versions_written_per_event"] >= per_event
        assert d["dead_rows_per_event"] >= per_event - 0.5
    assert out["drain"]["row_versions_written_per_event"] < 1.5  # fewer than by row
    assert out["ratios"]["ordered_vs_unordered"] > 0
    out = bench("drain", "--sink", "webhook", "--events", "1000", admin=pg_admin_url)
    assert out["drain"]["complete"] is True and out["drain"]["delivered"] == 1000
    assert out["sink"].startswith("webhook to http://127.0.0.1:")


def _commits(times: list[float], elapsed: float) -> Any:
    from array import array

    from relay.tools.bench.steady import Commits

    return Commits(array("q", range(1, len(times) + 1)), array("d", times), elapsed)


def _acked(commits: Any, latency: Callable[[float], float]) -> Any:
    from relay.sinks.null import NullSink
    from relay.tools.bench.common import TimingSink

    sink = TimingSink(NullSink())
    sink.acked_ids.extend(commits.ids)
    sink.acked_at.extend(t + latency(t) for t in commits.times)
    return sink


def test_steady_prints_no_latency_for_a_rate_it_did_not_offer() -> None:
    """Latencies measured at 6k/s must not be printed as the latencies of 10k/s."""
    from relay.tools.bench.steady import _report, load_shape

    commits = _commits([100.0] * 600, 0.1)  # 6,000/s of 10,000/s
    short = _report(_acked(commits, lambda t: 0.01), commits, 10_000, 10, 2, 0.0)
    assert short["rate_reached"] is False
    assert "p99_ms" not in short and "6,000/s of 10,000/s" in short["latency"]
    assert "p99_ms" not in short["windows"][0] and short["windows"][0]["events"] == 600
    commits.elapsed = 0.0605  # 9,917/s
    full = _report(_acked(commits, lambda t: 0.01), commits, 10_000, 10, 2, 0.0)
    assert full["rate_reached"] is True and full["p99_ms"] > 0
    assert load_shape(1000, None, None) == (1, 1)
    assert load_shape(3000, None, None) == (6, 2)
    assert load_shape(10_000, None, None) == (20, 2)
    assert load_shape(10_000, 5, 3) == (5, 3)  # what the user says wins


def test_steady_windows_and_the_last_minute_against_the_first() -> None:
    """Three minutes at 10 events/s whose latency grows from 10 to 190 ms: a window per 15 s
    of commit time, the minute after the warm-up against the last minute."""
    from relay.tools.bench.common import Latencies, percentile
    from relay.tools.bench.steady import _report

    times = [1000.0 + i / 10 for i in range(1800)]
    commits = _commits(times, 180.0)
    sink = _acked(commits, lambda t: 0.01 + (t - 1000.0) / 1000)
    sink.acked_ids.append(5)  # delivered twice: the first acknowledgement counts
    sink.acked_at.append(2000.0)
    r = _report(sink, commits, 10, 1, 1, 0.0, window=15, warmup=15)
    assert r["events"] == r["acked"] == 1800
    assert [w["from_s"] for w in r["windows"]] == list(range(0, 180, 15))
    assert all(w["events"] == 150 for w in r["windows"])
    assert r["windows"][0]["max_ms"] == 24.9 and r["windows"][-1]["p50_ms"] == 182.4
    assert r["first_minute"]["from_s"] == 15 and r["first_minute"]["to_s"] == 75
    assert r["first_minute"]["events"] == 600 and r["first_minute"]["p50_ms"] == 55.0
    assert r["last_minute"]["from_s"] == 119.9 and r["last_minute"]["events"] == 601
    assert r["last_minute_p50_ratio"] == round(r["last_minute"]["p50_ms"] / 55.0, 2)
    assert r["max_ms"] == 189.9
    # The binned percentiles are the exact ones, to the 0.01 ms the report rounds to.
    values = [3.14159 * (i % 97) for i in range(5000)]
    lat = Latencies()
    for v in values:
        lat.add(v)
    for p in (50, 95, 99):
        assert abs(lat.percentile(p) - percentile(values, p)) <= 0.005


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
        # Every statement by name: the fan-out's, the deliveries' claims and records, and the
        # ones around them (the reaper runs at every poll), as sql_statements_per_delivery sums.
        counted = s["statements"]
        assert counted["fan_out"] >= 1 and counted["delivery_claim"] >= 1, counted
        assert counted["delivery_record"] == s["delivery_record_statements"] >= 1, counted
        assert counted["delivery_reap"] >= 1, counted
        assert s["delivery_record_us_per_delivery"] > 0
        assert s["fan_out_statements"] >= 1 and s["fan_out_us_per_delivery"] > 0, s
        # The healthy endpoints' deliveries, once they are known to be fast, are claimed by
        # their fan-out; the first ones, the slow and the dead one's by the claim.
        assert 0 < s["deliveries_sent_at_fan_out"] < s["deliveries"], s
        per = sum(counted.values()) / s["healthy_delivered"]
        assert abs(per - s["sql_statements_per_delivery"]) < 0.01, (per, s)
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


def test_fanout_steady_under_a_held_snapshot_reports_windows_and_kept_versions(
    pg_admin_url: str,
) -> None:
    """`bench fanout --hold-snapshot`, bounded: the snapshot is held from before the relay
    starts to the end (its xmin unchanged), every delivery is accounted for, the latencies
    come per window of commit time, and the tables show the dead versions it kept."""
    out = bench(
        "fanout",
        "--endpoints",
        "2",
        "--no-slow-dead",
        "--rate",
        "100",
        "--seconds",
        "2",
        "--window",
        "1",
        "--hold-snapshot",
        admin=pg_admin_url,
    )
    s = out["steady"]
    assert s["complete"] is True and s["accounted"] is True, s
    assert s["hold_snapshot"] is True and s["snapshot_held_seconds"] > 2, s
    assert s["snapshot_xmin"] is not None and s["snapshot_xmin"] == s["snapshot_xmin_at_end"]
    rows = s["windows"]
    # Two seconds of commits, a line per second (a commit late on a loaded machine: a third).
    assert [w["from_s"] for w in rows][:2] == [0.0, 1.0] and len(rows) <= 3, rows
    assert sum(w["deliveries"] for w in rows) == s["healthy_delivered"] == 400
    assert all(0 < w["p50_ms"] <= w["p99_ms"] <= w["max_ms"] <= s["max_ms"] for w in rows)
    # Each delivery was recorded (one dead version, none removable), and one claimed after
    # its fan-out (not sent at once: its endpoint was not yet known to be fast) another.
    assert s["tables"]["outbox_deliveries"]["dead"] >= 400, s["tables"]
    assert s["tables"]["outbox"]["dead"] >= 100, s["tables"]


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


def test_the_enqueue_bench_validates_what_it_times() -> None:
    """The validated phases time a check that passes, of a schema that refuses (else they
    would time a lookup)."""
    from outbox.errors import EventSchemaError
    from outbox.message import build_message
    from relay.tools.bench.enqueue import TYPE, bench_catalog, body

    for size in (200, 10_000):
        catalog, event = bench_catalog(size, "reject"), body(size)
        assert abs(len(json.dumps(event)) - size) < 200
        message = build_message(destination="bench", payload=event, event_type=TYPE)
        catalog.check(message, event)
        wrong = {**event, "currency": "JPY"}
        with pytest.raises(EventSchemaError, match="currency"):
            catalog.check(build_message(destination="bench", payload=wrong, event_type=TYPE), wrong)
