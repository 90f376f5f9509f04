"""What the fan-out scenarios set up alike: the relay's settings and its run, endpoints
registered and events added in one statement each."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import asyncpg
import click

from outbox import endpoint_secrets
from relay.app import Relay
from relay.config import Settings
from relay.settings import load_settings
from relay.tools.bench.common import DESTINATION
from relay.tools.bench.fanout_sql import ENDPOINTS, EVENTS


def relay_settings(
    db_url: str,
    *,
    batch_size: int,
    max_concurrency: int,
    endpoints: int,
    shutdown: float,
    max_in_flight: int | None = None,
    timeout: float = 15.0,
) -> Settings:
    in_flight = max_in_flight or batch_size * 4
    # The benchmark's relay is its own: the shell's OUTBOX_* variables name another outbox.
    return load_settings(
        None,
        environment=False,
        database_url=db_url,
        log_level="warning",
        relay={
            "batch_size": min(batch_size, in_flight),
            "max_in_flight": in_flight,
            "poll_interval": 0.5,
            "shutdown_timeout": shutdown,
        },
        destinations={
            DESTINATION: {
                "kind": "endpoints",
                # The receivers are on loopback.
                "allow_private_networks": True,
                "max_concurrency": max_concurrency,
                "timeout": timeout,
            }
        },
        # Room for every endpoint's requests, so they never wait on each other's connections.
        webhooks={"max_connections": max(100, endpoints * max_concurrency)},
        # No metrics listener: a benchmark must not take the port of a relay on this host.
        http={"enabled": False},
    )


@contextlib.asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[tuple[Relay, asyncio.Task[int]]]:
    relay = Relay(settings)
    task = asyncio.create_task(relay.run())
    started = asyncio.create_task(relay.started.wait())
    await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED, timeout=60)
    if not relay.started.is_set():
        started.cancel()
        if task.done():
            task.result()
        relay.stop()
        await asyncio.gather(task, return_exceptions=True)
        raise click.ClickException("the relay did not start within 60 s")
    try:
        yield relay, task
    finally:
        relay.stop()
        await asyncio.wait_for(task, settings.relay.shutdown_timeout + 60)


async def register(
    conn: asyncpg.Connection, urls: Sequence[str], tenant: str | None = None
) -> list[int]:
    """Endpoints for ``urls`` (one statement), each with a secret of its own; their ids."""
    secrets = [endpoint_secrets.generate() for _ in urls]
    rows = await conn.fetch(ENDPOINTS, DESTINATION, list(urls), tenant, secrets)
    by_url = {r["url"]: r["id"] for r in rows}
    return [by_url[u] for u in urls]


async def add_events(conn: asyncpg.Connection, events: int, tenant: str | None = None) -> None:
    step = 100_000
    for start in range(0, events, step):
        await conn.execute(EVENTS, DESTINATION, min(step, events - start), 198, tenant)
