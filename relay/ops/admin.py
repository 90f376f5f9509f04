"""The operations with their results as JSON-ready data, what `--json` prints, for scripts and
tests that read them as such (the console's benchmark reads status so). The commands and the
console call the typed operations themselves: relay/ops/status.py, rows.py, retry.py,
replay.py, purge.py and pause.py."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec

from relay.ops import pause as _pause
from relay.ops import replay as _replay
from relay.ops import retry as _retry
from relay.ops import rows as _rows
from relay.ops import status as _status
from relay.ops.common import AdminError, Result, origin
from relay.ops.retry import RetryFilter
from relay.ops.rows import LIST_DEFAULT_LIMIT, LIST_MAX_LIMIT, like_pattern
from relay.ops.selection import Selection, SelectionChanged

P = ParamSpec("P")


def _as_json(
    operation: Callable[P, Awaitable[Result]],
) -> Callable[P, Awaitable[dict[str, Any]]]:
    @functools.wraps(operation)
    async def run(*args: P.args, **kwargs: P.kwargs) -> dict[str, Any]:
        return (await operation(*args, **kwargs)).to_json()

    return run


status = _as_json(_status.status)
list_rows = _as_json(_rows.list_rows)
retry = _as_json(_retry.retry)
replay_event = _as_json(_replay.replay_event)
replay_endpoint = _as_json(_replay.replay_endpoint)
pause = _as_json(_pause.pause)
resume = _as_json(_pause.resume)

__all__ = [
    "LIST_DEFAULT_LIMIT",
    "LIST_MAX_LIMIT",
    "AdminError",
    "RetryFilter",
    "Selection",
    "SelectionChanged",
    "like_pattern",
    "list_rows",
    "origin",
    "pause",
    "replay_endpoint",
    "replay_event",
    "resume",
    "retry",
    "status",
]
