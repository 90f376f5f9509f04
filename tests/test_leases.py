"""The relay's book of held rows: what it renews, what it let go, what waits for a record."""

from __future__ import annotations

import dataclasses
from collections import Counter

from relay.leases import Leases
from relay.metrics import Metrics
from tests.webhook_helpers import envelope


async def test_rows_let_go_leave_no_trace() -> None:
    """Rows whose hand-off failed and which the relay then let go (forget) are neither held
    nor remembered as waiting for the completer: a thousand failed hand-offs leak nothing."""
    leases = Leases(Metrics(), Counter())
    envs = [envelope() for _ in range(1000)]
    leases.claimed(envs)
    leases.handed(envs)
    assert leases.capacity.is_set()  # rows left their sink: the claim may take more
    leases.forget(envs)
    assert len(leases) == 0
    assert leases.tokens() == []
    assert leases._handed == {}


async def test_a_row_claimed_again_replaces_its_earlier_claim() -> None:
    leases = Leases(Metrics(), Counter())
    first = envelope(id=42)
    leases.claimed([first])
    again = dataclasses.replace(envelope(id=42), token=2)
    leases.claimed([again])
    assert leases.tokens() == [(42, 2)]
    assert 42 in first.lease.lost  # the earlier claim can no longer send or record
