"""What the endpoint calls return: :class:`Endpoint` (read from a row of outbox_endpoints),
:class:`Reencrypted`, :class:`EndpointNotFound`, and ``UNSET``, the default of what an update
leaves as it is."""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from outbox.errors import OutboxError


class EndpointNotFound(OutboxError):
    def __init__(self, endpoint_id: int) -> None:
        self.endpoint_id = endpoint_id
        super().__init__(f"no endpoint {endpoint_id} (list them with: outbox-relay endpoints list)")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A registered endpoint. ``secret`` is None unless the call returns it on purpose."""

    id: int
    destination: str
    url: str
    tenant: str | None
    event_types: tuple[str, ...]
    rate_limit: int | None
    description: str
    enabled: bool
    disabled_reason: str | None
    disabled_at: datetime | None
    failing_since: datetime | None
    last_success_at: datetime | None
    created_at: datetime
    updated_at: datetime
    previous_secret_until: datetime | None
    secret: str | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (times as ISO 8601); the secret only if this object carries it."""
        out = {
            k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in asdict(self).items()
        }
        out["event_types"] = builtins.list(self.event_types)
        if self.secret is None:
            del out["secret"]
        return out


@dataclass(frozen=True, slots=True)
class Reencrypted:
    """What one batch of :meth:`Endpoints.reencrypt` did, counted in secrets (an endpoint has
    its current one and maybe a previous one)."""

    last_id: int | None  # the last endpoint read: the next batch starts after it (None: none)
    endpoints: int  # endpoints read
    encrypted: int  # secrets that were stored in clear, now encrypted
    rewritten: int  # secrets that were encrypted under another key, now under the first
    current: int  # secrets already encrypted under the first key: left as they are
    expired: int  # previous secrets past their window: cleared, not re-encrypted
    unreadable: tuple[int, ...] = ()  # endpoints with a secret no key opens: left unchanged


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


def endpoint(row: Any, *, secret: str | None = None) -> Endpoint:
    """The endpoint of a row the statements return."""
    m = row._mapping
    return Endpoint(
        id=m["id"],
        destination=m["destination"],
        url=m["url"],
        tenant=m["tenant"],
        event_types=tuple(m["event_types"] or ()),
        rate_limit=m["rate_limit"],
        description=m["description"],
        enabled=m["enabled"],
        disabled_reason=m["disabled_reason"],
        disabled_at=m["disabled_at"],
        failing_since=m["failing_since"],
        last_success_at=m["last_success_at"],
        created_at=m["created_at"],
        updated_at=m["updated_at"],
        previous_secret_until=m["previous_secret_until"],
        secret=secret,
    )


def one(rows: Sequence[Any], endpoint_id: int, secret: str | None = None) -> Endpoint:
    """The endpoint of the first row; EndpointNotFound if there is none."""
    if not rows:
        raise EndpointNotFound(endpoint_id)
    return endpoint(rows[0], secret=secret)


def deleted(rows: Sequence[Any], endpoint_id: int) -> int:
    """How many deliveries the deletion cancelled; EndpointNotFound if it deleted nothing."""
    deleted, cancelled = rows[0]
    if not deleted:
        raise EndpointNotFound(endpoint_id)
    return int(cancelled)
