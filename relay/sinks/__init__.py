"""Sinks deliver envelopes to the outside world. Each is one small interface (:class:`Sink`),
and each kind of sink is one package here that owns its settings and helpers and describes
itself with a :class:`SinkKind`; ``relay/sinks/registry.py`` lists the kinds."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel

from relay.breaker import Breaker
from relay.config.base import DestinationSettings
from relay.model import Envelope, Outcome

if TYPE_CHECKING:
    from relay.db.store import Store
    from relay.obs.metrics import Metrics
    from relay.sinks.source import SendingSource


@dataclass(frozen=True)
class Host:
    """What the relay lends a sink once the database is reached (:meth:`Sink.attach`): its
    store (for a sink with tables of its own), its limits, metrics and paused destinations."""

    store: Store
    max_in_flight: int
    poll_interval: float
    metrics: Metrics
    paused: Callable[[], Collection[str]]
    # Claims events now: a sink whose claim_limit held a destination back has room again.
    wake: Callable[[], None] = lambda: None


@runtime_checkable
class Sink(Protocol):
    """Delivers batches and says, per envelope, what happened.

    Every envelope of a ``batch`` is of one destination, one of those the sink was built for
    (the relay groups a claim by destination). ``deliver`` returns exactly one outcome per
    envelope (in any order) and never raises for a delivery problem: a failure of one
    message is that message's outcome, so its neighbours are still recorded. Exceptions are
    reserved for bugs; the relay then retries the whole batch.
    """

    kind: str  # "kafka", "webhook", …: the label of its metrics and traces

    async def start(self) -> None: ...

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]: ...

    def available(self, destination: str) -> bool:
        """False while the destination is known to be down (circuit open): not claimed."""
        ...

    def ready(self, destination: str) -> bool:
        """For /readyz: the destination's rows can be delivered now (connected, circuit not
        open)."""
        ...

    def circuits(self) -> Mapping[str, Breaker]:
        """Its circuit breakers by endpoint name (the outbox_circuit_state metric)."""
        ...

    def breakers_of(self, destination: str) -> Sequence[Breaker]:
        """The breakers that stand for ``destination`` as a whole (the relay registry's
        circuit states): a Kafka destination's cluster, a webhook destination's endpoint;
        none where circuits are per endpoint registered at runtime."""
        ...

    def attach(self, host: Host) -> None:
        """Called once the database is reached, before any claim and before start()."""
        ...

    def tasks(self) -> set[asyncio.Task[None]]:
        """Loops of its own for the relay to supervise: if one ends, the relay stops."""
        ...

    def wake(self) -> None:
        """A NOTIFY said that work of its own may be due (an endpoint added or enabled)."""
        ...

    async def drain(self, timeout: float) -> None:
        """On shutdown, after the relay's own deliveries: finish, record and release what
        it holds of its own within ``timeout`` seconds."""
        ...

    def claim_limit(self, destination: str, limit: int) -> int:
        """How many of ``destination``'s events (at most ``limit``) the next claim may take:
        a sink whose deliveries of a batch take room of their own says how many fit now (0:
        none; it wakes the relay through :attr:`Host.wake` once some do)."""
        ...

    def sources(self) -> Sequence[SendingSource[Any]]:
        """Tables of rows of its own (endpoint deliveries), once attached: the relay claims,
        holds, renews, records, reaps and releases their rows with its own pipeline, and the
        sink sends them (relay/sinks/source.py)."""
        ...

    async def close(self) -> None: ...


HOOKS = ("breakers_of", "attach", "tasks", "wake", "drain", "claim_limit", "sources")


class SinkBase:
    """What a sink without loops or tables of its own answers to the hooks of :class:`Sink`
    (most sinks: they inherit it). Its breakers stand for each of its destinations: a kind
    with a breaker per destination, or per endpoint registered at runtime, says otherwise."""

    def circuits(self) -> Mapping[str, Breaker]:
        return {}

    def breakers_of(self, destination: str) -> Sequence[Breaker]:
        return tuple(self.circuits().values())

    def attach(self, host: Host) -> None:
        return None

    def tasks(self) -> set[asyncio.Task[None]]:
        return set()

    def wake(self) -> None:
        return None

    async def drain(self, timeout: float) -> None:
        return None

    def claim_limit(self, destination: str, limit: int) -> int:
        return limit

    def sources(self) -> Sequence[SendingSource[Any]]:
        return ()


@dataclass(frozen=True)
class SinkKind:
    """A kind of sink, as the configuration and the relay know it.

    ``name`` is what destinations say (``kind = "kafka"``); ``destination`` the model of such
    a destination's settings; ``section``/``settings`` the table of settings its destinations
    share (``[kafka]``), if any; ``build(section, destinations)`` makes the one sink that
    delivers them all; ``secrets(section, destinations)`` lists what must never be printed;
    ``check()`` checks, when a destination of the kind is configured, what the settings cannot
    hold (the environment it shares with applications), raising OutboxError with what to set.
    """

    name: str
    destination: type[DestinationSettings]
    build: Callable[[Any, Mapping[str, Any]], Sink]
    section: str | None = None
    settings: type[BaseModel] | None = None
    secrets: Callable[[Any, Mapping[str, Any]], set[str]] = field(
        default=lambda section, destinations: set()
    )
    check: Callable[[], None] = field(default=lambda: None)


class Hooked(SinkBase):
    """A sink handed to the relay (``Relay(sinks=…)``) without some of the hooks, as custom
    sinks were written before :class:`Sink` declared them: its own members, and SinkBase's
    answers for the hooks it lacks. The one place where a sink's members are looked up."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.kind = inner.kind

    def __getattr__(self, name: str) -> Any:  # its own members: deliver, start, …
        return getattr(self.inner, name)

    def circuits(self) -> Mapping[str, Breaker]:
        return self.inner.circuits()  # type: ignore[no-any-return]

    def breakers_of(self, destination: str) -> Sequence[Breaker]:
        own = getattr(self.inner, "breakers_of", None)
        return own(destination) if own is not None else super().breakers_of(destination)

    def attach(self, host: Host) -> None:
        own = getattr(self.inner, "attach", None)
        if own is not None:
            own(host)

    def tasks(self) -> set[asyncio.Task[None]]:
        own = getattr(self.inner, "tasks", None)
        return own() if own is not None else set()

    def wake(self) -> None:
        own = getattr(self.inner, "wake", None)
        if own is not None:
            own()

    async def drain(self, timeout: float) -> None:
        own = getattr(self.inner, "drain", None)
        if own is not None:
            await own(timeout)

    def claim_limit(self, destination: str, limit: int) -> int:
        own = getattr(self.inner, "claim_limit", None)
        return own(destination, limit) if own is not None else limit

    def sources(self) -> Sequence[SendingSource[Any]]:
        own = getattr(self.inner, "sources", None)
        return own() if own is not None else ()


def with_hooks(sink: Any) -> Sink:
    """``sink`` itself when it has every hook of :class:`Sink`, else it in a :class:`Hooked`."""
    if all(hasattr(sink, h) for h in HOOKS):
        return sink  # type: ignore[no-any-return]
    return Hooked(sink)


async def misrouted(
    batch: Sequence[Envelope],
    known: Container[str],
    kind: str,
    deliver: Callable[[Sequence[Envelope]], Awaitable[list[Outcome]]],
) -> list[Outcome]:
    """For a sink handed a batch that breaks the contract (several destinations, or one it
    does not have): each known destination's rows are delivered, each other row fails alone
    with the reason, instead of the whole batch failing."""
    groups: dict[str, list[Envelope]] = {}
    outcomes: list[Outcome] = []
    for env in batch:
        if env.destination in known:
            groups.setdefault(env.destination, []).append(env)
        else:
            reason = f"destination {env.destination!r} is not a {kind} one of this relay"
            outcomes.append(Outcome.failed(env.id, reason))
    for group in await asyncio.gather(*(deliver(g) for g in groups.values())):
        outcomes.extend(group)
    return outcomes


__all__ = ["Sink", "SinkKind", "misrouted"]
