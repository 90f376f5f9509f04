"""What a batch of :meth:`Endpoints.reencrypt` does to each endpoint's secrets: each one as it
is under the box's first key, counted by what that took."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outbox import endpoint_secrets
from outbox.errors import OutboxError


def sort(
    box: endpoint_secrets.SecretBox, rows: Sequence[Any]
) -> tuple[dict[str, int], list[int], list[tuple[int, str, str | None]]]:
    """Of the rows read (id, secret, previous secret, whether it expired): the counts, the
    endpoints with a secret no key opens (left as they are: changing it would lose it), and
    the (id, secret, previous secret) to write where either changed."""
    counts = dict.fromkeys(("encrypted", "rewritten", "current", "expired"), 0)
    unreadable: list[int] = []
    changed: list[tuple[int, str, str | None]] = []
    for row in rows:
        endpoint_id, secret, previous, previous_expired = tuple(row)
        row_counts = dict.fromkeys(counts, 0)
        try:
            new_secret = _reencrypted(box, secret, row_counts)
            if previous is None or previous_expired:
                row_counts["expired"] += previous is not None
                new_previous = None
            else:
                new_previous = _reencrypted(box, previous, row_counts)
        except OutboxError:  # no key opens it: changing it would lose it
            unreadable.append(endpoint_id)
            continue
        for k, v in row_counts.items():
            counts[k] += v
        if (new_secret, new_previous) != (secret, previous):
            changed.append((endpoint_id, new_secret, new_previous))
    return counts, unreadable, changed


def _reencrypted(box: endpoint_secrets.SecretBox, stored: str, counts: dict[str, int]) -> str:
    """``stored`` as it is under the box's first key, counted; OutboxError if no key opens it."""
    if box.is_current(stored):
        counts["current"] += 1
        return stored
    sealed = endpoint_secrets.is_sealed(stored)
    counts["rewritten" if sealed else "encrypted"] += 1
    return box.seal(box.open(stored))
