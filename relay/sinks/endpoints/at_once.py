"""Deliveries sent at once: which endpoints a fan-out may claim deliveries of as it writes them
(FAN_OUT's :room_ids), how many each, and how many events the relay's claim may take so that
their deliveries fit (EndpointsSink.claim_limit).

A delivery claimed by its fan-out costs no claim statement and no pending version: it is
written running under this relay's lease and handed to the pipeline. That is for endpoints
known to be fast, up to a queue of FAN_OUT_AHEAD times their max_concurrency in this relay
(their requests wait in its request slots, as rows claimed ahead do), within the free half of
``max_in_flight``. The events' claim follows that room: claimed faster, the events' deliveries
would wait, pending, for a claim each. While the relay is busy (half its room held, or the fair
share plan holding someone back) the claim shares the room out instead, and events are claimed
as before. Pure: the deliveries source gathers what it knows and runs FAN_OUT.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# How many times its max_concurrency a fast endpoint's deliveries a fan-out may queue in this
# relay: a fan-out is one statement for a batch of events, so a deep queue makes few, large
# ones (at 4, a fan-out came every few deliveries; the drain ran slower than with claims).
FAN_OUT_AHEAD = 16


@dataclass(frozen=True, slots=True)
class Queue:
    """A fast endpoint as the plan sees it: how many of its deliveries it may queue here, how
    many it holds, and whether some of its deliveries wait for the claim, which is serving them
    (claimed from lately: a disabled or deleted endpoint's kept queue holds nothing back)."""

    endpoint_id: int
    depth: int  # max_concurrency * FAN_OUT_AHEAD
    in_hand: int
    backlog: bool = False
    # Whether it sends a queue's worth of deliveries within the events' hold (FanOuts'
    # BACKLOG_HOLD), and no hold left its backlog behind: only then may its backlog hold the
    # events back (holds_back), and its room pace them (fits).
    quick: bool = True


def room(queues: Iterable[Queue], left: int) -> dict[int, int]:
    """Each endpoint's room at a fan-out (what its queue lacks), in all at most ``left``;
    none for one with a backlog (FAN_OUT would send none of it at once anyway)."""
    out: dict[int, int] = {}
    for q in queues:
        if left <= 0:
            break
        n = min(q.depth - q.in_hand, left)
        if n > 0 and not q.backlog:
            out[q.endpoint_id] = n
            left -= n
    return out


def holds_back(queues: Iterable[Queue]) -> bool:
    """Whether an endpoint's backlog is to hold the events back for a while, so that the claim
    takes it rather than each new event adding to it: one of a quick endpoint only. An
    endpoint slower than that (seconds an answer, under its latency budget) takes its backlog
    at its own pace whatever the events do; holding them would only make every other endpoint
    wait (a 2 s endpoint held them all a second in every eleven)."""
    return any(q.backlog and q.quick for q in queues)


def fits(
    queues: Sequence[Queue], left: int, fanning: float, per_event: float, hold: bool
) -> int | None:
    """How many events the relay's claim may take now: those whose deliveries fit in the room
    of the fast endpoints without a backlog (``left`` of the free half of max_in_flight, less
    ``fanning``, the deliveries of fan-outs in progress, at ``per_event`` deliveries an
    event), once at least half of that room is free (a fan-out is best for many events); one
    at least, even if an event has more deliveries than the queues hold. 0 while the caller
    ``hold``s the events (for the claim to take backlogs: each event claimed meanwhile would
    add to them). None (as many as asked, as for any destination) when no endpoint is known
    to be fast without a backlog (an endpoint's backlog, or a slow one, never paces the
    others' events), or the relay is busy (less than an event's deliveries ``left``: the
    claim shares out the room, and the fair share plan keeps the reserve)."""
    per_event = max(per_event, 1.0)
    if not queues or left < per_event:
        return None
    if hold:
        return 0
    clear = [q for q in queues if not q.backlog]
    if not clear:
        return None
    free = sum(room(clear, left).values()) - fanning
    # Half of the room the quick ones can free soon: a queue of an endpoint answering in
    # seconds frees its room at its own pace, and must not keep the others' events waiting.
    if free < min(sum(q.depth for q in clear if q.quick), left) / 2:
        return 0
    return max(1, int(free // per_event))


__all__ = ["FAN_OUT_AHEAD", "Queue", "fits", "holds_back", "room"]
