"""The order in which the relay's statements take the rows it holds."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar


class _Row(Protocol):
    @property
    def id(self) -> int: ...


R = TypeVar("R", bound=_Row)


def in_id_order(records: Iterable[R]) -> list[R]:
    """Outcomes in the order of their rows' ids. Every statement that writes rows this relay
    holds (records, heartbeats, releases, and FAN_OUT, the events' record of an endpoints
    destination, which run beside each other) takes them in id order, so that two over the
    same rows lock them in the same order: a record and a heartbeat, each in the order its
    rows came, deadlocked (`bench fanout --scenario steady`, the relay behind, rows held past
    a third of their lease)."""
    return sorted(records, key=lambda r: r.id)
