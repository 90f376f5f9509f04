"""The relay process: claim, deliver outside any transaction, record, and keep leases alive.

:class:`Relay` only assembles and supervises. Stages overlap: while one batch is delivered
(relay/pipeline/sending.py) the next is claimed (relay/pipeline/claimer.py), up to
``max_in_flight`` rows held at once (relay/pipeline/leases.py), and outcomes are written by the
completer in the background. The side jobs (relay/maintenance/) and the listener are
supervised: if one dies the relay stops with a non-zero status rather than running
half-alive.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections import Counter
from typing import Any

import structlog

from outbox.errors import describe
from relay.breaker import Breaker, State
from relay.catalog.view import CatalogView, load_view
from relay.config import Settings
from relay.config.base import package_version
from relay.db.store import Store
from relay.maintenance import every
from relay.maintenance.horizon import Horizon
from relay.maintenance.pauses import Pauses
from relay.maintenance.reaper import Reaper
from relay.maintenance.reporter import Reporter
from relay.maintenance.retention import Retention
from relay.model import Envelope
from relay.obs.metrics import Metrics
from relay.pipeline.claimer import Claimer, Feed
from relay.pipeline.completer import Completer
from relay.pipeline.leases import Leases
from relay.pipeline.listener import Listener
from relay.pipeline.routes import attempt_limits, build_routes, build_sinks
from relay.pipeline.sending import Sending
from relay.pipeline.source_sending import SourceSending
from relay.runtime import loop, probes
from relay.runtime.claim_modes import MixedClaims
from relay.runtime.pipes import EVENTS, Pipe, adopter
from relay.runtime.server import HttpServer, HttpStartupError, build_app
from relay.runtime.shutdown import FINAL_BUDGET, shutdown
from relay.runtime.startup import RelayStartupError, open_store
from relay.sinks import Host, Sink, with_hooks

log = structlog.get_logger("relay")

# Between sweeps for fresh rows below the claims' cursors (see Store.sweep).
SWEEP_INTERVAL = 1800.0
# How long a source's outcome waits for others to share its statement (Completer.linger):
# a source's rows end one by one (a delivery per request), the events' by the batch.
RECORD_LINGER = 0.005

__all__ = ["FINAL_BUDGET", "Relay", "RelayStartupError"]


class Relay:
    def __init__(
        self,
        settings: Settings,
        sinks: dict[str, Sink] | None = None,
        *,
        relay_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.id = relay_id or settings.relay_id()
        self.sinks = _checked(sinks) if sinks is not None else build_sinks(settings)
        self.routes = build_routes(settings, self.sinks)
        self.stats: Counter[str] = Counter()
        self.started = asyncio.Event()  # for tests and probes: set once claiming has begun
        self.stopping = asyncio.Event()
        self.metrics = Metrics()
        # The events' leases (their pipe is built with the store: see _prepare).
        self.leases: Leases[Envelope] = Leases(self.metrics, self.stats)
        self.metrics.watch_circuits(self._circuits)
        self.http: HttpServer | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        # Built once the database is reached (they all need the store).
        self._store: Store | None = None
        self.claimer: Claimer | None = None
        self.sending: Sending | None = None
        self.completer: Completer | None = None  # the events'
        # A pipe per source of claimable rows: the events' first (see relay/runtime/pipes.py).
        self.pipes: list[Pipe[Any]] = []
        self.pauses: Pauses | None = None
        self._listener: Listener | None = None
        self.console: Any = None  # the console's ASGI app, when [ui] enabled = true
        self.portal: Any = None  # the tenant portal's, when [portal] enabled = true
        # The event catalog the console and the portal show, loaded with the first of them.
        self._catalog: CatalogView | None = None
        self._catalog_loaded = False
        self._mixed = MixedClaims(settings)  # relays claiming a destination another way

    # --- public -------------------------------------------------------------------------

    def stop(self, reason: str = "stop") -> None:
        """Begin a graceful shutdown (safe to call from a signal handler)."""
        if not self.stopping.is_set():
            log.info("relay.stopping", relay_id=self.id, in_flight=len(self.leases), reason=reason)
        self.stopping.set()
        # At once, not when the shutdown begins a few loop turns later: a request ending in
        # between must not start the next one queued behind it.
        for pipe in self.pipes:
            if pipe.sending is not None:
                pipe.sending.halt()

    def wake(self) -> None:
        """Claim now (a NOTIFY arrived, rows became claimable)."""
        if self.claimer is not None:
            self.claimer.wake()

    def _notified(self, payload: str) -> None:
        """A NOTIFY's payload: "endpoints" (an endpoint was added, changed, enabled) wakes the
        sinks with work of their own. Events' notifications do not: fanning them out wakes
        the endpoint deliveries anyway, and a claim walk per enqueue would cost for nothing."""
        if payload == "endpoints":
            for sink in _distinct(self.sinks):
                sink.wake()

    @property
    def in_flight(self) -> int:
        return len(self.leases)

    @property
    def store(self) -> Store:
        assert self._store is not None, "relay not started"
        return self._store

    @property
    def paused(self) -> frozenset[str]:
        return self.pauses.paused if self.pauses is not None else frozenset()

    @property
    def paused_refreshes(self) -> int:
        """For tests: how often the paused set was read."""
        return self.pauses.refreshes if self.pauses is not None else 0

    async def health(self) -> probes.Answer:
        return await probes.health(self)

    async def readiness(self) -> probes.Answer:
        return await probes.readiness(self)

    async def run(self) -> int:
        """Run until :meth:`stop`; returns the process exit status."""
        await self._start()
        assert self.claimer is not None
        background = self._background()
        # The HTTP server is supervised like the rest, but stopped last (probes answer "not
        # ready" while the relay drains), by shutdown().
        http_task = {self.http.task} if self.http is not None and self.http.task else set()
        # Sinks with loops of their own are supervised too; they stop when the sink is closed.
        sink_tasks = {t for s in _distinct(self.sinks) for t in s.tasks()}
        claimer = asyncio.create_task(self.claimer.run(), name="claimer")
        stop_wait = asyncio.create_task(self.stopping.wait())
        self.tasks = {*background, *http_task, *sink_tasks, claimer}
        self.metrics.up.set(1)
        self.started.set()
        self._log_started()
        done, _ = await asyncio.wait({*self.tasks, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        status = 0
        for task in done - {stop_wait}:
            if task is claimer and self.stopping.is_set() and _ended_cleanly(task):
                continue  # it saw the stop request first: a normal exit
            status = 1
            exc = task.exception() if not task.cancelled() else None
            log.error(
                "relay.task.crashed",
                task=task.get_name(),
                error=describe(exc) if exc else "exited",
                exc_info=exc,
            )
        self.stopping.set()
        await shutdown(self, claimer, background)
        stop_wait.cancel()
        log.info("relay.stopped", relay_id=self.id, status=status, **dict(self.stats))
        return status

    # --- start-up -----------------------------------------------------------------------

    async def _start(self) -> None:
        if not self.sinks:
            raise RelayStartupError(
                "no destinations configured: add a [destinations.NAME] table to the config "
                '(kind = "kafka" with a topic, or kind = "webhook" with a url)'
            )
        self._store = await open_store(self.settings, self.id, self._prepare)
        if self.settings.http.enabled:
            self.http = HttpServer(
                self.settings.http,
                build_app(
                    self.metrics.registry,
                    self.health,
                    self.readiness,
                    self._console_app(),
                    self._portal_app(),
                ),
            )
            try:
                await self.http.start()
            except HttpStartupError as exc:
                await self.store.pool.close()
                raise RelayStartupError(str(exc)) from exc
        self._listener = Listener(
            self.settings.dsn,
            self.store.channel,
            self.wake,
            f"outbox-relay-listen:{self.id}",
            on_payload=self._notified,
        )
        for sink in _distinct(self.sinks):
            await sink.start()

    async def _prepare(self, store: Store) -> None:
        """Build what needs the store, read the paused destinations and register: all before
        the first claim, so a relay that starts while a destination is paused never claims
        it, and other relays know what this one serves."""
        self._store = store
        events = Pipe(
            EVENTS,
            store,
            self.leases,
            heads=self._key_finished,
            gauge=self.metrics.in_flight.labels(EVENTS),
        )
        self.completer = events.completer
        self.sending = Sending(self.routes, self.leases, store, self.completer, self.metrics)
        events.sending = self.sending
        self.pipes = [events]
        self.pauses = Pauses(store, self.sinks, self.metrics, self.wake)
        rs = self.settings.relay
        # Sinks that keep tables of their own (endpoint deliveries) use the relay's.
        host = Host(
            store, rs.max_in_flight, rs.poll_interval, self.metrics, lambda: self.paused, self.wake
        )
        for sink in _distinct(self.sinks):
            sink.attach(host)
        # Their rows are claimed, held, renewed, recorded, reaped and released by this
        # pipeline too: a pipe each (their ids are their own), sent by their sink.
        feeds: list[Feed[Any]] = []
        sources = [src for sink in _distinct(self.sinks) for src in sink.sources()]
        for source in sources:
            pipe: Pipe[Any] = Pipe(
                source.name,
                source,
                Leases(self.metrics, Counter()),
                gauge=self.metrics.in_flight.labels(source.name),
                linger=RECORD_LINGER,
            )
            sending = SourceSending(source, pipe.leases, pipe.completer, self.metrics)
            pipe.sending = sending
            self.pipes.append(pipe)
            feeds.append(Feed(source, pipe.leases, sending.dispatch, rs.max_in_flight))
            source.adopt = adopter(pipe.leases, sending.dispatch)
        self.claimer = Claimer(
            rs,
            self.routes,
            store,
            self.leases,
            self.sending.dispatch,
            lambda: self.paused,
            self.metrics,
            self.stats,
            self.stopping,
            sources=feeds,
        )
        for source in sources:
            source.on_due = self.claimer.wake_sources
        await self.pauses()
        await self._register()

    def _background(self) -> set[asyncio.Task[Any]]:
        """The supervised side tasks: each pipe's completer and heartbeat, the listener and the
        maintenance jobs."""
        assert self.pipes and self._listener is not None
        assert self.pauses is not None and self.claimer is not None
        rs = self.settings.relay
        store = self.store
        reaper = Reaper(
            store,
            rs.max_attempts,
            attempt_limits(self.settings),
            self.metrics,
            self.wake,
            extra=[feed.source for feed in self.claimer.sources],  # each reaped apart
        )
        reporter = Reporter(rs, list(self.settings.destinations), self.routes, store, self.metrics)
        retention = Retention(rs, store, self.metrics, self.stopping)
        lease = rs.lease
        jobs: list[tuple[str, Any, float, float]] = [
            *(job for pipe in self.pipes for job in pipe.jobs(lease)),
            ("registry", self._register, min(lease / 3, 10.0), min(lease / 3, 10.0)),
            # Every poll interval (at most lease / 2): a dead relay's rows are claimable again
            # within one lease and one poll interval. The query reads only the small partial
            # index of running rows, so running it this often is cheap.
            ("reaper", reaper, min(rs.poll_interval, max(lease / 2, 0.5)), 0.0),
            ("reporter", reporter, rs.report_interval, 0.0),
            ("progress", self._progress, 10.0, 10.0),
            ("pauses", self.pauses, rs.poll_interval, rs.poll_interval),
            ("stats", reporter.pending, rs.stats_interval, 0.0),
            # Every relay reads it (one look at pg_stat_activity and two small views), as
            # often as the pending gauges: a snapshot matters after a minute, not a second.
            ("horizon", Horizon(store, self.metrics, rs.snapshot_warning), rs.stats_interval, 0.0),
            ("retention", retention, rs.retention_interval, min(5.0, rs.poll_interval)),
            # Fresh rows below the claims' cursors (ids handed out again by a sequence set
            # back): rare, and under a held snapshot a read of every dead entry below them,
            # which loads the database while it runs.
            ("sweep", self._sweep, SWEEP_INTERVAL, SWEEP_INTERVAL),
        ]
        tasks = {
            *(task for pipe in self.pipes for task in pipe.tasks()),
            asyncio.create_task(self._listener.run(), name="listener"),
        }
        for name, job, interval, first in jobs:
            tasks.add(asyncio.create_task(every(interval, job, name, first), name=name))
        return tasks

    async def _sweep(self) -> None:
        if await self.store.sweep():
            log.warning(
                "relay.claim.rewound",
                action="fresh rows were found below where the claims had seen every one (ids "
                "handed out again: the outbox sequence set back?); claiming them now",
            )
            self.wake()

    def _portal_app(self) -> Any:
        """The tenant portal, when [portal] enabled = true: served at /portal."""
        p = self.settings.portal
        if not p.enabled:
            return None
        from relay.portal.app import build_portal  # Starlette and Jinja2 only where used
        from relay.portal.changes import Policy

        self.portal = build_portal(
            self.settings.database_url.get_secret_value(),
            p.keys(),
            Policy(self.settings.portal_destinations(), p.max_endpoints, p.allow_private_networks),
            schema=self.settings.relay.db_schema,
            embed_origins=tuple(p.embed_origins),
            catalog=self._catalog_view(),
        )
        return self.portal

    def _console_app(self) -> Any:
        """The operator console, when [ui] enabled = true: served at /ui by the listener."""
        ui = self.settings.ui
        if not ui.enabled:
            return None
        from relay.ui.app import build_console  # Starlette and Jinja2 only where used

        token, operators = ui.credentials()
        self.console = build_console(
            self.settings.database_url.get_secret_value(),
            token,
            schema=self.settings.relay.db_schema,
            read_only=ui.read_only,
            operators=operators,
            snapshot_warning=self.settings.relay.snapshot_warning,
            catalog=self._catalog_view(),
        )
        return self.console

    def _catalog_view(self) -> CatalogView | None:
        """The event catalog of [catalog] source for the console and the portal, loaded once
        (None without one). One that fails to load is logged and shown so on their pages;
        delivery never waits on it."""
        if not self._catalog_loaded:
            self._catalog = load_view(None, self.settings)
            self._catalog_loaded = True
        return self._catalog

    def _log_started(self) -> None:
        rs = self.settings.relay
        log.info(
            "relay.started",
            relay_id=self.id,
            destinations=sorted(self.sinks),
            batch_size=rs.batch_size,
            max_in_flight=rs.max_in_flight,
            lease_s=rs.lease,
            retention_s=rs.retention,
            paused=sorted(self.paused),
            http_port=self.http.port if self.http else None,
            event_loop=loop.name(),
        )

    # --- what the parts tell each other -------------------------------------------------

    def _key_finished(self) -> None:
        """An outcome let the next row of an ordered key go: claim it now."""
        if self.claimer is not None:
            self.claimer.key_finished()

    async def _register(self) -> None:
        """Tell the table this relay runs and what it serves (status, unknown destinations)."""
        await self.store.register(
            socket.gethostname(),
            os.getpid(),
            package_version(),
            sorted(self.sinks),
            self._circuit_states(),
        )
        await self._mixed(self.store)

    def _circuit_states(self) -> dict[str, str]:
        """Destinations whose circuit is not closed in this relay: a webhook destination's
        own breaker, the Kafka cluster's for each Kafka destination. (Endpoints' circuits are
        written per endpoint by their sink.)"""
        states: dict[str, str] = {}
        for name, sink in self.sinks.items():
            for breaker in sink.breakers_of(name):
                state = breaker.state
                if state is not State.CLOSED and states.get(name) != State.OPEN.value:
                    states[name] = state.value  # open wins over half-open
        return states

    async def _progress(self) -> None:
        log.info("relay.progress", in_flight=len(self.leases), **dict(self.stats))

    def _circuits(self) -> list[tuple[str, str, Breaker]]:
        return [(s.kind, ep, b) for s in _distinct(self.sinks) for ep, b in s.circuits().items()]


SINK_MEMBERS = ("kind", "start", "deliver", "available", "ready", "circuits", "close")


def _checked(sinks: dict[str, Sink]) -> dict[str, Sink]:
    """Sinks handed in by a caller, refused at once when they lack part of the interface: a
    sink without ``kind`` would fail every row it is given, a missing ``circuits`` every
    metrics scrape. The hooks (attach, tasks, wake, drain, breakers_of) are optional here:
    one written without them gets SinkBase's answers (relay.sinks.Hooked), the same object
    for every destination it serves."""
    hooked: dict[int, Sink] = {}
    for name, sink in sinks.items():
        missing = [m for m in SINK_MEMBERS if not hasattr(sink, m)]
        if missing:
            raise TypeError(
                f"the sink for destination {name!r} ({type(sink).__name__}) is not a "
                f"relay.sinks.Sink: it lacks {', '.join(missing)}"
            )
        hooked.setdefault(id(sink), with_hooks(sink))
    return {name: hooked[id(sink)] for name, sink in sinks.items()}


def _distinct(sinks: dict[str, Sink]) -> list[Sink]:
    """Each sink once (one sink serves all the destinations of its kind)."""
    return list({id(s): s for s in sinks.values()}.values())


def _ended_cleanly(task: asyncio.Task[Any]) -> bool:
    return not task.cancelled() and task.exception() is None
