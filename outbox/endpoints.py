"""Webhook endpoints registered at runtime, for destinations of kind ``endpoints``.

    ep = await outbox.endpoints.create(session, destination="customer-events",
                                       url="https://hooks.acme.example/in", tenant="acme",
                                       event_types=["invoice.paid"])
    ep.secret  # "whsec_…": show it to the customer once

Every function runs in the connection it is given (inside the caller's transaction when there
is one) and has a ``_sync`` twin for SQLAlchemy's ``Session``/``Connection``. An event of the
destination goes to every enabled endpoint whose tenant is the event's (an endpoint without a
tenant takes every tenant) and whose event types include the event's (none listed: all).
Running relays see a change within a second (NOTIFY, and a periodic refresh).

Secrets are returned only by ``create``, ``rotate_secret`` and ``get(..., show_secret=True)``,
and are stored encrypted when ``OUTBOX_ENDPOINT_SECRET_KEY`` is set (see
:mod:`outbox.endpoint_secrets`).
"""

from __future__ import annotations

import asyncio
import builtins
import ipaddress
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from outbox import endpoint_secrets, queries
from outbox.errors import OutboxError, OutboxValidationError
from outbox.message import MAX_DESTINATION_BYTES, MAX_EVENT_TYPE_BYTES, MAX_TENANT_BYTES
from outbox.message import _label as _check_label
from outbox.message import _text as _check_text

MAX_URL_BYTES = 2048
MAX_DESCRIPTION_BYTES = 1024
MAX_EVENT_TYPES = 100
DEFAULT_KEEP_PREVIOUS = timedelta(hours=24)


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


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@dataclass(frozen=True, slots=True)
class _Call:
    sql: TextClause
    binds: dict[str, Any]


AsyncTarget = AsyncSession | AsyncConnection
SyncTarget = Session | Connection


class Endpoints:
    """The endpoints of the outbox in ``schema``; ``outbox.endpoints`` uses schema public.

    ``secret_key``: the Fernet key(s) for secrets at rest; default: the environment's
    ``OUTBOX_ENDPOINT_SECRET_KEY``, read when first needed.
    """

    def __init__(self, schema: str = "public", *, secret_key: str | None = None) -> None:
        queries.check_schema(schema)
        self.schema = schema
        self._box = endpoint_secrets.SecretBox(secret_key) if secret_key is not None else None

        def sql(statement: str) -> TextClause:
            return text(queries.render_endpoints(statement, schema))

        self._create = sql(queries.ENDPOINT_CREATE)
        self._get = sql(queries.ENDPOINT_GET)
        self._list = sql(queries.ENDPOINT_LIST)
        self._update = sql(queries.ENDPOINT_UPDATE)
        self._disable = sql(queries.ENDPOINT_DISABLE)
        self._enable = sql(queries.ENDPOINT_ENABLE)
        self._rotate = sql(queries.ENDPOINT_ROTATE)
        self._delete = sql(queries.ENDPOINT_DELETE)

    @property
    def box(self) -> endpoint_secrets.SecretBox:
        if self._box is None:
            self._box = endpoint_secrets.SecretBox.from_environment()
        return self._box

    # --- validation (before any SQL) ----------------------------------------------------------

    def _fields(
        self,
        *,
        url: Any = UNSET,
        tenant: Any = UNSET,
        event_types: Any = UNSET,
        rate_limit: Any = UNSET,
        description: Any = UNSET,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if url is not UNSET:
            _check_text("url", url, MAX_URL_BYTES)
            from relay.sinks.webhook.config import check_url

            try:
                check_url(url)
            except ValueError as exc:
                raise OutboxValidationError("url", str(exc)) from None
            out["url"] = url
        if tenant is not UNSET:
            out["tenant"] = _check_label("tenant", tenant, MAX_TENANT_BYTES)
        if event_types is not UNSET:
            out["event_types"] = _event_types(event_types)
        if rate_limit is not UNSET:
            if rate_limit is not None and (
                isinstance(rate_limit, bool) or not isinstance(rate_limit, int) or rate_limit < 1
            ):
                raise OutboxValidationError(
                    "rate_limit", "must be a positive int (requests per second) or None"
                )
            out["rate_limit"] = rate_limit
        if description is not UNSET:
            out["description"] = _check_text(
                "description", description, MAX_DESCRIPTION_BYTES, kind="a str"
            )
        return out

    def _create_call(
        self,
        destination: str,
        url: str,
        tenant: str | None,
        event_types: Iterable[str],
        rate_limit: int | None,
        description: str,
        secret: str | None,
    ) -> tuple[_Call, str]:
        _check_text("destination", destination, MAX_DESTINATION_BYTES)
        fields = self._fields(
            url=url,
            tenant=tenant,
            event_types=event_types,
            rate_limit=rate_limit,
            description=description,
        )
        plain = endpoint_secrets.generate() if secret is None else _given_secret(secret)
        binds = {"destination": destination, "secret": self.box.seal(plain), **fields}
        return _Call(self._create, binds), plain

    def _update_call(self, endpoint_id: int, changes: Mapping[str, Any]) -> _Call:
        fields = self._fields(**changes)
        binds: dict[str, Any] = {"id": _id(endpoint_id)}
        for name in ("url", "tenant", "event_types", "rate_limit", "description"):
            binds[f"set_{name}"] = name in fields
            binds[name] = fields.get(name)
        if binds["event_types"] is None:
            binds["event_types"] = []
        if binds["description"] is None:
            binds["description"] = ""
        return _Call(self._update, binds)

    def _rotate_call(
        self, endpoint_id: int, keep_previous: timedelta, secret: str | None
    ) -> tuple[_Call, str]:
        if not isinstance(keep_previous, timedelta) or keep_previous < timedelta(0):
            raise OutboxValidationError("keep_previous", "must be a timedelta of zero or more")
        plain = endpoint_secrets.generate() if secret is None else _given_secret(secret)
        binds = {
            "id": _id(endpoint_id),
            "secret": self.box.seal(plain),
            "keep_seconds": keep_previous.total_seconds(),
        }
        return _Call(self._rotate, binds), plain

    def _endpoint(self, row: Any, *, secret: str | None = None) -> Endpoint:
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

    def _one(self, rows: Sequence[Any], endpoint_id: int, secret: str | None = None) -> Endpoint:
        if not rows:
            raise EndpointNotFound(endpoint_id)
        return self._endpoint(rows[0], secret=secret)

    def _shown(self, rows: Sequence[Any], endpoint_id: int, show_secret: bool) -> Endpoint:
        if not rows:
            raise EndpointNotFound(endpoint_id)
        secret = self.box.open(rows[0]._mapping["secret"]) if show_secret else None
        return self._endpoint(rows[0], secret=secret)

    # The public methods spell their keywords out, async and sync, so that editors and type
    # checkers show each one; the work is done once, by the _*_call builders above.

    # --- async ---------------------------------------------------------------------------------

    async def create(
        self,
        conn: AsyncTarget,
        *,
        destination: str,
        url: str,
        tenant: str | None = None,
        event_types: Iterable[str] = (),
        rate_limit: int | None = None,
        description: str = "",
        secret: str | None = None,
        allow_private_networks: bool = False,
        check_dns: bool = True,
    ) -> Endpoint:
        """Register an endpoint; the result carries its secret (generated unless given).

        The URL must resolve (``check_dns``) to public addresses only, unless
        ``allow_private_networks`` (set it as the destination's setting of that name is set);
        the relay checks again at every delivery."""
        call, plain = self._create_call(
            destination, url, tenant, event_types, rate_limit, description, secret
        )
        if check_dns:
            await asyncio.to_thread(check_reachable, url, allow_private_networks)
        return self._one(await _run(conn, call), 0, plain)

    async def get(
        self, conn: AsyncTarget, endpoint_id: int, *, show_secret: bool = False
    ) -> Endpoint:
        rows = await _run(conn, _Call(self._get, {"id": _id(endpoint_id)}))
        return self._shown(rows, endpoint_id, show_secret)

    async def list(
        self, conn: AsyncTarget, *, destination: str | None = None, tenant: str | None = None
    ) -> builtins.list[Endpoint]:
        rows = await _run(conn, _Call(self._list, {"destination": destination, "tenant": tenant}))
        return [self._endpoint(r) for r in rows]

    async def update(
        self,
        conn: AsyncTarget,
        endpoint_id: int,
        *,
        url: str = UNSET,
        tenant: str | None = UNSET,
        event_types: Iterable[str] = UNSET,
        rate_limit: int | None = UNSET,
        description: str = UNSET,
        allow_private_networks: bool = False,
        check_dns: bool = True,
    ) -> Endpoint:
        """Change what is given; ``tenant=None`` / ``event_types=[]`` / ``rate_limit=None``
        mean all tenants / all types / no limit."""
        changes = _given(
            url=url,
            tenant=tenant,
            event_types=event_types,
            rate_limit=rate_limit,
            description=description,
        )
        call = self._update_call(endpoint_id, changes)
        if "url" in changes and check_dns:
            await asyncio.to_thread(check_reachable, url, allow_private_networks)
        return self._one(await _run(conn, call), endpoint_id)

    async def disable(
        self, conn: AsyncTarget, endpoint_id: int, *, reason: str | None = None
    ) -> Endpoint:
        call = _Call(self._disable, {"id": _id(endpoint_id), "reason": _reason(reason)})
        return self._one(await _run(conn, call), endpoint_id)

    async def enable(self, conn: AsyncTarget, endpoint_id: int) -> Endpoint:
        return self._one(
            await _run(conn, _Call(self._enable, {"id": _id(endpoint_id)})), endpoint_id
        )

    async def rotate_secret(
        self,
        conn: AsyncTarget,
        endpoint_id: int,
        *,
        keep_previous: timedelta = DEFAULT_KEEP_PREVIOUS,
        secret: str | None = None,
    ) -> Endpoint:
        """A new secret (returned); the previous one still signs for ``keep_previous``."""
        call, plain = self._rotate_call(endpoint_id, keep_previous, secret)
        return self._one(await _run(conn, call), endpoint_id, plain)

    async def delete(self, conn: AsyncTarget, endpoint_id: int) -> int:
        """Delete the endpoint; its unfinished deliveries end as ``cancelled``. Returns how
        many were cancelled."""
        rows = await _run(conn, _Call(self._delete, {"id": _id(endpoint_id)}))
        return _deleted(rows, endpoint_id)

    # --- sync ----------------------------------------------------------------------------------

    def create_sync(
        self,
        conn: SyncTarget,
        *,
        destination: str,
        url: str,
        tenant: str | None = None,
        event_types: Iterable[str] = (),
        rate_limit: int | None = None,
        description: str = "",
        secret: str | None = None,
        allow_private_networks: bool = False,
        check_dns: bool = True,
    ) -> Endpoint:
        """``create`` for a SQLAlchemy ``Session`` or ``Connection``."""
        call, plain = self._create_call(
            destination, url, tenant, event_types, rate_limit, description, secret
        )
        if check_dns:
            check_reachable(url, allow_private_networks)
        return self._one(_run_sync(conn, call), 0, plain)

    def get_sync(
        self, conn: SyncTarget, endpoint_id: int, *, show_secret: bool = False
    ) -> Endpoint:
        rows = _run_sync(conn, _Call(self._get, {"id": _id(endpoint_id)}))
        return self._shown(rows, endpoint_id, show_secret)

    def list_sync(
        self, conn: SyncTarget, *, destination: str | None = None, tenant: str | None = None
    ) -> builtins.list[Endpoint]:
        rows = _run_sync(conn, _Call(self._list, {"destination": destination, "tenant": tenant}))
        return [self._endpoint(r) for r in rows]

    def update_sync(
        self,
        conn: SyncTarget,
        endpoint_id: int,
        *,
        url: str = UNSET,
        tenant: str | None = UNSET,
        event_types: Iterable[str] = UNSET,
        rate_limit: int | None = UNSET,
        description: str = UNSET,
        allow_private_networks: bool = False,
        check_dns: bool = True,
    ) -> Endpoint:
        changes = _given(
            url=url,
            tenant=tenant,
            event_types=event_types,
            rate_limit=rate_limit,
            description=description,
        )
        call = self._update_call(endpoint_id, changes)
        if "url" in changes and check_dns:
            check_reachable(url, allow_private_networks)
        return self._one(_run_sync(conn, call), endpoint_id)

    def disable_sync(
        self, conn: SyncTarget, endpoint_id: int, *, reason: str | None = None
    ) -> Endpoint:
        call = _Call(self._disable, {"id": _id(endpoint_id), "reason": _reason(reason)})
        return self._one(_run_sync(conn, call), endpoint_id)

    def enable_sync(self, conn: SyncTarget, endpoint_id: int) -> Endpoint:
        return self._one(
            _run_sync(conn, _Call(self._enable, {"id": _id(endpoint_id)})), endpoint_id
        )

    def rotate_secret_sync(
        self,
        conn: SyncTarget,
        endpoint_id: int,
        *,
        keep_previous: timedelta = DEFAULT_KEEP_PREVIOUS,
        secret: str | None = None,
    ) -> Endpoint:
        call, plain = self._rotate_call(endpoint_id, keep_previous, secret)
        return self._one(_run_sync(conn, call), endpoint_id, plain)

    def delete_sync(self, conn: SyncTarget, endpoint_id: int) -> int:
        rows = _run_sync(conn, _Call(self._delete, {"id": _id(endpoint_id)}))
        return _deleted(rows, endpoint_id)


def check_reachable(url: str, allow_private_networks: bool = False) -> None:
    """Refuse a URL whose host does not resolve, or resolves to a private, loopback or other
    non-public address (unless allowed): the relay would refuse to deliver to it anyway."""
    from yarl import URL

    from relay.sinks.webhook.ssrf import is_public

    parsed = URL(url)
    host = parsed.raw_host or ""
    try:
        addresses = [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, parsed.port or 443, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise OutboxValidationError(
                "url", f"its host {host!r} does not resolve ({exc}); check the spelling"
            ) from None
        addresses = builtins.list(dict.fromkeys(ipaddress.ip_address(str(i[4][0])) for i in infos))
    refused = [a for a in addresses if not is_public(a)]
    if refused and not allow_private_networks:
        shown = ", ".join(map(str, refused))
        raise OutboxValidationError(
            "url",
            f"its host {host!r} resolves to non-public address(es) {shown}; endpoints may "
            "only be public unless the destination sets allow_private_networks = true "
            "(then pass allow_private_networks=True / --allow-private-networks)",
        )


def _given(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not UNSET}


def _id(endpoint_id: object) -> int:
    if isinstance(endpoint_id, bool) or not isinstance(endpoint_id, int) or endpoint_id < 1:
        raise OutboxValidationError("endpoint_id", "must be a positive int")
    return endpoint_id


def _reason(reason: object) -> str | None:
    if reason is None:
        return None
    return _check_text("reason", reason, MAX_DESCRIPTION_BYTES, kind="a str or None")


def _given_secret(secret: object) -> str:
    if not isinstance(secret, str):
        raise OutboxValidationError("secret", "must be a 'whsec_…' str or None")
    try:
        return endpoint_secrets.check(secret)
    except OutboxError as exc:
        raise OutboxValidationError("secret", str(exc)) from None


def _event_types(values: object) -> builtins.list[str]:
    if isinstance(values, str) or not isinstance(values, Iterable):
        raise OutboxValidationError(
            "event_types", 'must be a list of str (e.g. ["invoice.paid"]); empty: every type'
        )
    out = builtins.list(dict.fromkeys(values))
    if len(out) > MAX_EVENT_TYPES:
        raise OutboxValidationError(
            "event_types", f"{len(out)} types, above the limit of {MAX_EVENT_TYPES}"
        )
    for t in out:
        _check_label("event_types", t, MAX_EVENT_TYPE_BYTES)
    return out


def _deleted(rows: Sequence[Any], endpoint_id: int) -> int:
    deleted, cancelled = rows[0]
    if not deleted:
        raise EndpointNotFound(endpoint_id)
    return int(cancelled)


async def _run(conn: AsyncTarget, call: _Call) -> builtins.list[Any]:
    if not isinstance(conn, AsyncSession | AsyncConnection):
        raise TypeError(
            "outbox.endpoints takes a SQLAlchemy AsyncSession or AsyncConnection; got "
            f"{type(conn).__name__} (use the _sync functions for a Session or Connection)"
        )
    result = await conn.execute(call.sql, call.binds)
    return builtins.list(result.fetchall())


def _run_sync(conn: SyncTarget, call: _Call) -> builtins.list[Any]:
    if not isinstance(conn, Session | Connection):
        raise TypeError(
            "the _sync endpoint functions take a SQLAlchemy Session or Connection; got "
            f"{type(conn).__name__} (await the async ones for async connections)"
        )
    return builtins.list(conn.execute(call.sql, call.binds).fetchall())


_default = Endpoints()
create = _default.create
get = _default.get
list = _default.list
update = _default.update
disable = _default.disable
enable = _default.enable
rotate_secret = _default.rotate_secret
delete = _default.delete
create_sync = _default.create_sync
get_sync = _default.get_sync
list_sync = _default.list_sync
update_sync = _default.update_sync
disable_sync = _default.disable_sync
enable_sync = _default.enable_sync
rotate_secret_sync = _default.rotate_secret_sync
delete_sync = _default.delete_sync
