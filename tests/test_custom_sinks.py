"""A sink handed to the relay (`Relay(sinks=…)`), as docs/guarantees.md allows: one written
with only the members every sink has (no hooks) runs as it did before the hooks were declared
(relay.sinks.Hooked supplies them), and a custom sink's open circuit reaches the relay
registry, as the built-in sinks' do. Both failed after the hooks became required (review of
issue #28's first step)."""

from __future__ import annotations

from collections.abc import Sequence

from structlog.testing import capture_logs

from relay.app import Relay
from relay.breaker import Breaker
from relay.model import Envelope, Outcome
from relay.sinks import Hooked, Sink
from tests.support.relays import running, settings, status_counts, wait_until
from tests.support.sinks import MemorySink
from tests.test_relay import enqueue_n


class Documented:
    """Exactly the members every sink has, and none of the hooks: no SinkBase."""

    kind = "memory"

    def __init__(self) -> None:
        self.woken = 0

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def available(self, destination: str) -> bool:
        return True

    def ready(self, destination: str) -> bool:
        return True

    def circuits(self) -> dict[str, Breaker]:
        return {}

    def wake(self) -> None:  # one hook of its own: called, not replaced
        self.woken += 1

    async def deliver(self, batch: Sequence[Envelope]) -> list[Outcome]:
        return [Outcome.delivered(e.id) for e in batch]


async def test_a_sink_without_the_hooks_runs_as_before(db_url: str) -> None:
    s = settings(db_url, "127.0.0.1:1", relay={"report_interval": 0.1, "shutdown_timeout": 1})
    ids = await enqueue_n(db_url, 3)
    sink = Documented()
    with capture_logs() as logs:
        async with running(s, sinks={"orders": sink, "refunds": sink}) as relay:
            assert isinstance(relay.sinks["orders"], Hooked)
            assert relay.sinks["orders"] is relay.sinks["refunds"]  # one sink, both names
            assert isinstance(relay.sinks["orders"], Sink)
            await wait_until(
                lambda: _delivered(db_url, len(ids)), what="the sink without hooks delivers"
            )
            relay.sinks["orders"].wake()
            assert sink.woken == 1
    bad = [e for e in logs if e["event"] in ("relay.sink.drain_failed", "relay.task.crashed")]
    assert not bad, bad


async def _delivered(db_url: str, n: int) -> bool:
    return (await status_counts(db_url)).get("delivered", 0) == n


class OneBreaker(MemorySink):
    """A custom sink with one breaker for its whole target, as the Kafka sink has."""

    def __init__(self) -> None:
        self.breaker = Breaker(threshold=1, cooldown=60)
        self.breaker.failure()

    def circuits(self) -> dict[str, Breaker]:
        return {"target": self.breaker}


def test_a_custom_sinks_open_circuit_reaches_the_registry() -> None:
    s = settings("postgresql://root@127.0.0.1:5432/unused", "127.0.0.1:9")
    assert Relay(s, sinks={"orders": OneBreaker()})._circuit_states() == {"orders": "open"}
    legacy = Documented()
    legacy.circuits = lambda: {"target": OneBreaker().breaker}  # type: ignore[method-assign]
    assert Relay(s, sinks={"orders": legacy})._circuit_states() == {"orders": "open"}  # type: ignore[dict-item]
