"""One endpoint delivery as the relay holds it (Claimed: claimed, by DELIVERY_CLAIM or by its
fan-out) and as its outcome is written (DeliveryRecord), built from the statements' rows."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from relay.db.store import Record, read_headers
from relay.model import Envelope, Lease


class RowLease(Lease):
    """The hold of one delivery's claim: each delivery has a Lease of its own, so any loss
    noted in it is this row's. The pipeline notes a loss under the delivery's id
    (Leases.lose) while the request checks the event's (Envelope.held: a delivery is sent
    as its event): either way, a lost delivery is not sent."""

    __slots__ = ()

    def held(self, row_id: int) -> bool:
        return not self.lost and time.monotonic() < self.until


@dataclass(slots=True, eq=False)
class Claimed:
    """One delivery (an event for one endpoint) this relay claimed, with what sending needs.
    It is a :class:`relay.db.leasing.Held` (deliveries have no ordered keys)."""

    id: int
    event_id: int
    endpoint_id: int
    destination: str
    attempts: int
    token: int
    replay: bool
    found: bool  # False: the event was deleted (purged) before it could be sent
    payload: bytes
    content_type: str
    headers: object
    created_at: float
    url: str
    secret: str
    previous_secret: str | None
    rate_limit: int | None
    lease: Lease
    lease_started: float = 0.0  # monotonic time just before the claim statement
    sending: bool = False  # its request started (a stop cuts it short: counted)
    event_type: str | None = None  # the event's (None: it has none, or was deleted)
    tenant: str | None = None  # the endpoint's (None: it takes every tenant)
    event_types: tuple[str, ...] = ()  # the endpoint's (none: every type)
    event_tenant: str | None = None  # the event's
    key: str | None = None  # no ordered keys among deliveries


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see relay/model.py
class DeliveryRecord(Record):
    """One delivery's outcome as DELIVERY_RECORD takes it, with its attempt for the log: a
    Record (the pipeline's Completer and Leases write and settle it as one), whose status may
    also be ``cancelled``, and whose ``counted`` may be 2 (NOT_SENT: tried, nothing sent,
    logged but not counted among its attempts)."""

    http_status: int | None = None
    event_id: int = 0
    endpoint_id: int = 0
    duration_ms: float | None = None
    response: str | None = None
    replay: bool = False


def takes(
    tenant: str | None,
    event_types: Sequence[str],
    event_tenant: str | None,
    event_type: str | None,
) -> bool:
    """Whether an endpoint of ``tenant`` and ``event_types`` takes an event of
    ``event_tenant`` and ``event_type``: the rule of the fan-out (FAN_OUT)."""
    if tenant is not None and tenant != event_tenant:
        return False
    return not event_types or event_type in event_types


def sent_at_once(r: asyncpg.Record, event: Envelope, until: float, started: float) -> Claimed:
    """A delivery FAN_OUT claimed as it wrote it (a row of endpoints -1), of ``event``."""
    return Claimed(
        id=r[0],
        event_id=r[3],
        endpoint_id=r[4],
        destination=event.destination,
        attempts=0,
        token=1,
        replay=False,
        found=True,
        payload=event.payload,
        content_type=event.content_type,
        headers=event.headers,
        created_at=event.created,
        url=r[5],
        secret=r[6],
        previous_secret=r[7],
        rate_limit=None,  # FAN_OUT sends none of a rate-limited endpoint at once
        lease=RowLease(until),
        lease_started=started,
        event_type=event.event_type,
        tenant=r[8],
        event_types=tuple(r[9] or ()),
        event_tenant=r[10],
    )


def claimed_row(r: asyncpg.Record, until: float, started: float) -> Claimed:
    """A row of DELIVERY_CLAIM, held until ``until`` (monotonic) by the claim made at
    ``started``."""
    return Claimed(
        id=r[0],
        event_id=r[1],
        endpoint_id=r[2],
        destination=r[3],
        attempts=r[4],
        token=r[5],
        replay=r[6],
        found=r[7],
        payload=r[8] or b"",
        content_type=r[9] or "application/octet-stream",
        headers={} if r[10] in (None, "{}") else read_headers(r[10]),
        created_at=r[11] or 0.0,
        url=r[12],
        secret=r[13],
        previous_secret=r[14],
        rate_limit=r[15],
        lease=RowLease(until),
        lease_started=started,
        event_type=r[16],
        tenant=r[17],
        event_types=tuple(r[18] or ()),
        event_tenant=r[19],
    )


__all__ = ["Claimed", "DeliveryRecord", "RowLease", "claimed_row", "sent_at_once", "takes"]
