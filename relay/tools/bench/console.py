"""``console``: the operator console over a large outbox (issue #17).

A scratch database is filled with one ``INSERT … SELECT FROM generate_series`` per million
rows: the newest ``--pending-fraction`` of the rows pending (a few hundred of them running,
5% backing off), the rest delivered over the last ``--hours``, about 0.1% failed with a few
error texts (a handful of them keyed, so some keys are blocked) and 0.01% skipped, across four
destinations (two keyed). Then VACUUM ANALYZE, as autovacuum would have done by then.

The console is built in this process (``build_console``) and served by uvicorn on a loopback
port; httpx sends each page's GET with the bearer token ``--requests`` times (after two
unmeasured ones), and ``admin.status`` is timed alone on a connection of its own. Reported:
median and p95 per page, the fill's time and the table's size. Every page must answer 200.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg

from outbox.dburl import to_asyncpg_dsn
from outbox.sql import load
from relay.tools.bench.common import percentile

# The target for GET / on 10 million rows, 1% pending.
TARGET_MS = 500.0
FILL_CHUNK = 1_000_000
RUNNING_ROWS = 200
# Failed rows carry a key (and so block it) when their hash h is a multiple of this: about 3
# in a million rows; the other failed rows carry none.
KEYED_FAILED = 500_000

# The statements' text, and why each is written so, is in console.sql beside this module.
_q = load("relay.tools.bench", "console.sql", binds="numbered")

FILL = _q["fill"]
VACUUM_ANALYZE = _q["vacuum_analyze"]
TABLE_SIZE = _q["table_size"]
ROWS_BY_STATUS = _q["rows_by_status"]

FILTER_ERROR = "timeout"


async def fill(
    db_url: str,
    *,
    rows: int,
    pending_fraction: float,
    hours: float,
    payload: int,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """The rows, then VACUUM ANALYZE; what it took."""
    pending = round(rows * pending_fraction)
    pad = "x" * max(0, payload - 20)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        started = time.perf_counter()
        for start in range(1, rows + 1, FILL_CHUNK):
            end = min(rows, start + FILL_CHUNK - 1)
            await conn.execute(
                FILL,
                start,
                end,
                rows,
                pending,
                hours,
                pad,
                KEYED_FAILED,
                min(RUNNING_ROWS, pending // 10),
                timeout=None,
            )
            if progress is not None:
                progress(end)
        filled = time.perf_counter() - started
        started = time.perf_counter()
        await conn.execute(VACUUM_ANALYZE, timeout=None)
        vacuumed = time.perf_counter() - started
        size = await conn.fetchval(TABLE_SIZE)
        by_status = {r["status"]: r["n"] for r in await conn.fetch(ROWS_BY_STATUS)}
    finally:
        await conn.close()
    return {
        "rows": rows,
        "by_status": by_status,
        "fill_s": round(filled, 1),
        "fill_rows_per_s": round(rows / filled),
        "vacuum_analyze_s": round(vacuumed, 1),
        "table_and_indexes_mb": round(size / 2**20),
    }


def _bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.asynccontextmanager
async def served(app: Any) -> AsyncIterator[str]:
    """``app`` served by uvicorn on a loopback port, on this event loop."""
    from relay.tools import serving  # uvicorn only for the runs that serve the console

    sock = _bound_socket()
    port = sock.getsockname()[1]
    async with serving.served(app, sock, "the console's server", lifespan="on"):
        yield f"http://127.0.0.1:{port}"


async def _timed(
    call: Callable[[], Awaitable[Any]], requests: int, max_seconds: float
) -> list[float]:
    """Milliseconds of ``requests`` calls after two unmeasured ones; fewer (at least 3) when
    they would take more than ``max_seconds``."""
    for _ in range(2):
        await call()
    times: list[float] = []
    deadline = time.monotonic() + max_seconds
    while len(times) < requests and (len(times) < 3 or time.monotonic() < deadline):
        started = time.perf_counter()
        await call()
        times.append((time.perf_counter() - started) * 1000)
    return times


def pages(destination: str = "orders") -> dict[str, str]:
    """The pages timed, by name: what an operator opens (the overview and the live part it
    polls every 5 s, status for scripts, the charts' series, the rows with the filters the
    console offers)."""
    return {
        "GET /": "/",
        "GET /fragments/overview": "/fragments/overview",
        "GET /api/status": "/api/status",
        "GET /api/series": "/api/series",
        f"GET /api/series?destination={destination}": f"/api/series?destination={destination}",
        "GET /rows": "/rows",
        "GET /rows?status=failed": "/rows?status=failed",
        f"GET /rows?status=failed&error_like={FILTER_ERROR}": (
            f"/rows?status=failed&error_like={FILTER_ERROR}"
        ),
        f"GET /rows?error_like={FILTER_ERROR}": f"/rows?error_like={FILTER_ERROR}",
        f"GET /destinations/{destination}": f"/destinations/{destination}",
    }


async def measure(db_url: str, *, requests: int, max_seconds: float) -> dict[str, Any]:
    """Each page over HTTP, and admin.status alone; median and p95 in ms."""
    import httpx

    from relay.ops import admin
    from relay.ui.app import build_console

    out: dict[str, Any] = {}
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        status = await admin.status(conn, "public")
        times = await _timed(lambda: admin.status(conn, "public"), requests, max_seconds)
    finally:
        await conn.close()
    out["admin.status p50_ms"] = round(percentile(times, 50), 1)
    out["admin.status p95_ms"] = round(percentile(times, 95), 1)
    out["delivered_estimated"] = status.get("delivered_estimated", False)
    out["delivered_shown"] = status["totals"]["delivered"]
    out["failed_shown"] = status["totals"]["failed"]
    out["blocked_keys_shown"] = sum(len(d["blocked_keys"]) for d in status["destinations"])

    token = secrets.token_urlsafe(32)
    app = build_console(db_url, token)
    async with (
        served(app) as url,
        httpx.AsyncClient(
            base_url=url, headers={"authorization": f"Bearer {token}"}, timeout=30
        ) as client,
    ):
        for name, path in pages().items():
            codes: set[int] = set()

            async def get(path: str = path, codes: set[int] = codes) -> None:
                r = await client.get(path)
                codes.add(r.status_code)

            times = await _timed(get, requests, max_seconds)
            if codes != {200}:
                raise RuntimeError(f"{name} answered {sorted(codes)}, not only 200")
            out[f"{name} p50_ms"] = round(percentile(times, 50), 1)
            out[f"{name} p95_ms"] = round(percentile(times, 95), 1)
            out[f"{name} n"] = len(times)
    out["target_ms"] = TARGET_MS
    out["overview_within_target"] = out["GET / p95_ms"] < TARGET_MS
    return out


async def console(
    db_url: str,
    *,
    rows: int,
    pending_fraction: float,
    hours: float,
    payload: int,
    requests: int,
    max_seconds: float,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    filled = await fill(
        db_url,
        rows=rows,
        pending_fraction=pending_fraction,
        hours=hours,
        payload=payload,
        progress=progress,
    )
    measured = await measure(db_url, requests=requests, max_seconds=max_seconds)
    by_status = filled.pop("by_status")
    actual = by_status.get("delivered", 0)
    shown = measured["delivered_shown"]
    return {
        **filled,
        **{f"rows {k}": v for k, v in sorted(by_status.items())},
        **measured,
        "delivered_error_pct": round(100 * (shown - actual) / actual, 2) if actual else 0.0,
    }
