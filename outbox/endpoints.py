"""Webhook endpoints registered at runtime, for destinations of kind ``endpoints``.

    ep = await outbox.endpoints.create(session, destination="customer-events",
                                       url="https://hooks.acme.example/in", tenant="acme",
                                       event_types=["invoice.paid"])
    ep.secret  # "whsec_…": show it to the customer once

Every function runs in the connection it is given (inside the caller's transaction when there
is one) and has a ``_sync`` twin for SQLAlchemy's ``Session``/``Connection``. An event of the
destination goes to every enabled endpoint whose tenant is the event's (an endpoint without a
tenant takes every tenant) and whose event types include the event's (none listed: all).
A change notifies the relays (NOTIFY on the outbox's channel); this relay version stores
endpoints but does not deliver to them yet (docs/endpoints.md).

Secrets are returned only by ``create``, ``rotate_secret`` and ``get(..., show_secret=True)``,
and are stored encrypted when ``OUTBOX_ENDPOINT_SECRET_KEY`` is set (see
:mod:`outbox.endpoint_secrets`). Without it a secret is stored in clear, with the warning event
``outbox.endpoints.secret_unencrypted``, and only where no secret is encrypted yet (else
``SecretEncryptionRequired``, as with ``OUTBOX_ENDPOINT_SECRET_REQUIRE=1``); ``reencrypt``
moves every secret under the first key.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import ipaddress
import itertools
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import StatementError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from outbox import endpoint_secrets, queries
from outbox.endpoint_secrets import SecretEncryptionRequired
from outbox.errors import OutboxError, OutboxValidationError
from outbox.message import MAX_DESTINATION_BYTES, MAX_EVENT_TYPE_BYTES, MAX_TENANT_BYTES
from outbox.message import _label as _check_label
from outbox.message import _text as _check_text
from outbox.webhooks.ssrf import is_public

__all__ = [
    "UNSET",
    "Endpoint",
    "EndpointNotFound",
    "Endpoints",
    "Reencrypted",
    "SecretEncryptionRequired",
    "check_reachable",
]

MAX_URL_BYTES = 2048
MAX_DESCRIPTION_BYTES = 1024
MAX_EVENT_TYPES = 100
DEFAULT_KEEP_PREVIOUS = timedelta(hours=24)
MAX_KEEP_PREVIOUS = timedelta(days=366)
MAX_RATE_LIMIT = 2**31 - 1  # the column is an integer
MAX_ID = 2**63 - 1  # and ids are bigint
MAX_REENCRYPT_BATCH = 10_000
DNS_TIMEOUT = 5.0  # seconds a registration waits for the URL's host to resolve


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


@dataclass(frozen=True, slots=True)
class _Call:
    sql: TextClause
    binds: dict[str, Any]


AsyncTarget = AsyncSession | AsyncConnection
SyncTarget = Session | Connection


class Endpoints:
    """The endpoints of the outbox in ``schema``; ``outbox.endpoints`` uses schema public.

    ``secret_key``: the Fernet key(s) for secrets at rest; default: the environment's
    ``OUTBOX_ENDPOINT_SECRET_KEY``, read when first needed. ``require_encryption``: refuse to
    store a secret unencrypted (no key); default: ``OUTBOX_ENDPOINT_SECRET_REQUIRE``.
    """

    def __init__(
        self,
        schema: str = "public",
        *,
        secret_key: str | None = None,
        require_encryption: bool | None = None,
    ) -> None:
        queries.check_schema(schema)
        self.schema = schema
        self.table = queries.qualified_table(schema, "outbox_endpoints")
        self._secret_key = secret_key
        self._require = require_encryption
        # A key given here is checked at once; the environment's when first needed.
        self._box = self._open_box() if secret_key is not None else None

        def sql(statement: str) -> TextClause:
            return text(queries.render_endpoints(statement, schema))

        self._create = sql(queries.ENDPOINT_CREATE)
        self._get = sql(queries.ENDPOINT_GET)
        self._list = sql(queries.ENDPOINT_LIST)
        self._update = sql(queries.ENDPOINT_UPDATE)
        self._disable = sql(queries.ENDPOINT_DISABLE)
        self._enable = sql(queries.ENDPOINT_ENABLE)
        self._rotate = sql(queries.ENDPOINT_ROTATE)
        self._seal_previous = sql(queries.ENDPOINT_SEAL_PREVIOUS)
        self._holds_sealed = sql(queries.ENDPOINT_HOLDS_SEALED)
        self._reencrypt_read = sql(queries.ENDPOINT_REENCRYPT_READ)
        self._reencrypt_write = sql(queries.ENDPOINT_REENCRYPT_WRITE)
        self._delete = sql(queries.ENDPOINT_DELETE)

    def _open_box(self) -> endpoint_secrets.SecretBox:
        keys = self._secret_key
        if keys is None:
            keys = os.environ.get(endpoint_secrets.KEY_VARIABLE)
        required = self._require if self._require is not None else endpoint_secrets.required()
        return endpoint_secrets.SecretBox(keys, required=required)

    @property
    def box(self) -> endpoint_secrets.SecretBox:
        if self._box is None:
            self._box = self._open_box()
        return self._box

    def _unencrypted(self, ep: Endpoint) -> None:
        """Called when ``ep``'s new secret was stored in clear (no key): logs the warning
        event. (The command line says it on stderr instead.)"""
        endpoint_secrets.warn_unencrypted(ep.id, ep.destination, self.table)

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
            from outbox.webhooks.urls import check_url

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
                isinstance(rate_limit, bool)
                or not isinstance(rate_limit, int)
                or not 1 <= rate_limit <= MAX_RATE_LIMIT
            ):
                raise OutboxValidationError(
                    "rate_limit",
                    f"must be an int from 1 to {MAX_RATE_LIMIT} (requests per second) or None",
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
        if not isinstance(keep_previous, timedelta) or not (
            timedelta(0) <= keep_previous <= MAX_KEEP_PREVIOUS
        ):
            raise OutboxValidationError(
                "keep_previous", f"must be a timedelta from zero to {MAX_KEEP_PREVIOUS.days} days"
            )
        plain = endpoint_secrets.generate() if secret is None else _given_secret(secret)
        binds = {
            "id": _id(endpoint_id),
            "secret": self.box.seal(plain),
            "keep_seconds": keep_previous.total_seconds(),
        }
        return _Call(self._rotate, binds), plain

    def _list_call(self, destination: object, tenant: object) -> _Call:
        """``tenant`` lists the endpoints registered for that tenant, not those taking all."""
        if destination is not None:
            _check_text("destination", destination, MAX_DESTINATION_BYTES)
        return _Call(
            self._list,
            {
                "destination": destination,
                "tenant": _check_label("tenant", tenant, MAX_TENANT_BYTES),
            },
        )

    def _get_call(self, endpoint_id: int) -> _Call:
        return _Call(self._get, {"id": _id(endpoint_id)})

    def _created(self, rows: Sequence[Any], call: _Call, plain: str) -> Endpoint:
        if not rows:  # the insert's own condition: a secret in clear where some are encrypted
            raise endpoint_secrets.downgrade_refused(self.table)
        ep = self._endpoint(rows[0], secret=plain)
        if not endpoint_secrets.is_sealed(call.binds["secret"]):
            self._unencrypted(ep)
        return ep

    def _previous_in_clear(self, rows: Sequence[Any], call: _Call) -> _Call | None:
        """After a rotation with a key: the statement that encrypts the previous secret too,
        if it was stored in clear (from before the key), else None."""
        previous = rows[0]._mapping["previous_secret"]
        if not endpoint_secrets.is_sealed(call.binds["secret"]) or previous is None:
            return None
        if endpoint_secrets.is_sealed(previous):
            return None
        binds = {"id": rows[0]._mapping["id"], "previous": self.box.seal(previous)}
        return _Call(self._seal_previous, binds)

    def _rotated(self, rows: Sequence[Any], call: _Call, plain: str) -> Endpoint:
        ep = self._one(rows, call.binds["id"], plain)
        if not endpoint_secrets.is_sealed(call.binds["secret"]):
            self._unencrypted(ep)
        return ep

    def _refuse_rotation(self, rows: Sequence[Any], endpoint_id: int, downgrade: bool) -> None:
        """A rotation changed no row: the endpoint is missing, its secrets are encrypted and
        this one would not be (``downgrade``), or its previous secret is still within the
        window promised at the last rotation."""
        until = self._one(rows, endpoint_id).previous_secret_until
        if downgrade:
            raise endpoint_secrets.downgrade_refused(self.table)
        raise OutboxValidationError(
            "keep_previous",
            f"the previous secret of endpoint {endpoint_id} is still valid until "
            f"{until.isoformat() if until else '?'}; rotate again after that, or pass "
            "keep_previous=timedelta(0) (--keep-previous-hours 0) to drop it at once (a leaked "
            "secret)",
        )

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
        await _check_address(url, allow_private_networks, check_dns)
        return self._created(await _run(conn, call), call, plain)

    async def get(
        self, conn: AsyncTarget, endpoint_id: int, *, show_secret: bool = False
    ) -> Endpoint:
        rows = await _run(conn, _Call(self._get, {"id": _id(endpoint_id)}))
        return self._shown(rows, endpoint_id, show_secret)

    async def list(
        self, conn: AsyncTarget, *, destination: str | None = None, tenant: str | None = None
    ) -> builtins.list[Endpoint]:
        rows = await _run(conn, self._list_call(destination, tenant))
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
        if "url" in changes:
            await _check_address(url, allow_private_networks, check_dns)
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
        rows = await _run(conn, call)
        if not rows:
            found = await _run(conn, self._get_call(endpoint_id))
            downgrade = bool(found) and not endpoint_secrets.is_sealed(call.binds["secret"])
            if downgrade:
                downgrade = bool((await _run(conn, _Call(self._holds_sealed, {})))[0][0])
            self._refuse_rotation(found, endpoint_id, downgrade)
        seal = self._previous_in_clear(rows, call)
        if seal is not None:
            await _run(conn, seal)
        return self._rotated(rows, call, plain)

    async def reencrypt(
        self, conn: AsyncTarget, *, after_id: int = 0, limit: int = 500
    ) -> Reencrypted:
        """Re-encrypt under the first key the secrets of the next ``limit`` endpoints after
        ``after_id`` (in id order), in the caller's transaction: those stored in clear, those
        under an older key (``secret_key="new,old"``); a previous secret past its window is
        cleared. An endpoint with a secret no key opens is left as it is and reported. Run it
        batch after batch (a transaction each), from ``last_id``, until ``last_id`` is None;
        running it again is harmless (secrets already under the first key are left alone).
        Async only: it is a maintenance step, run by ``outbox-relay endpoints reencrypt``."""
        box = self.box
        if not box.encrypts:
            raise SecretEncryptionRequired(
                f"re-encrypting needs {endpoint_secrets.KEY_VARIABLE}: set it to the new key "
                "followed by the keys the secrets may be encrypted with now, comma-separated "
                "(new,old)"
            )
        if (
            isinstance(limit, bool)
            or not isinstance(limit, int)
            or not 0 < limit <= MAX_REENCRYPT_BATCH
        ):
            raise OutboxValidationError("limit", f"must be an int from 1 to {MAX_REENCRYPT_BATCH}")
        if after_id != 0:
            _id(after_id)
        rows = await _run(conn, _Call(self._reencrypt_read, {"after_id": after_id, "limit": limit}))
        counts = dict.fromkeys(("encrypted", "rewritten", "current", "expired"), 0)
        unreadable: builtins.list[int] = []
        changed: builtins.list[tuple[int, str, str | None]] = []
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
        if changed:
            ids, secrets, previous_secrets = (builtins.list(c) for c in zip(*changed, strict=True))
            binds = {"ids": ids, "secrets": secrets, "previous": previous_secrets}
            await _run(conn, _Call(self._reencrypt_write, binds))
        return Reencrypted(
            last_id=rows[-1][0] if rows else None,
            endpoints=len(rows),
            unreadable=tuple(unreadable),
            **counts,
        )

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
        check_reachable(url, allow_private_networks, resolve=check_dns)
        return self._created(_run_sync(conn, call), call, plain)

    def get_sync(
        self, conn: SyncTarget, endpoint_id: int, *, show_secret: bool = False
    ) -> Endpoint:
        rows = _run_sync(conn, _Call(self._get, {"id": _id(endpoint_id)}))
        return self._shown(rows, endpoint_id, show_secret)

    def list_sync(
        self, conn: SyncTarget, *, destination: str | None = None, tenant: str | None = None
    ) -> builtins.list[Endpoint]:
        rows = _run_sync(conn, self._list_call(destination, tenant))
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
        if "url" in changes:
            check_reachable(url, allow_private_networks, resolve=check_dns)
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
        rows = _run_sync(conn, call)
        if not rows:
            found = _run_sync(conn, self._get_call(endpoint_id))
            downgrade = bool(found) and not endpoint_secrets.is_sealed(call.binds["secret"])
            if downgrade:
                downgrade = bool(_run_sync(conn, _Call(self._holds_sealed, {}))[0][0])
            self._refuse_rotation(found, endpoint_id, downgrade)
        seal = self._previous_in_clear(rows, call)
        if seal is not None:
            _run_sync(conn, seal)
        return self._rotated(rows, call, plain)

    def delete_sync(self, conn: SyncTarget, endpoint_id: int) -> int:
        rows = _run_sync(conn, _Call(self._delete, {"id": _id(endpoint_id)}))
        return _deleted(rows, endpoint_id)


def check_reachable(
    url: str, allow_private_networks: bool = False, *, resolve: bool = True
) -> None:
    """Refuse a URL whose host does not resolve, or resolves to a private, loopback or other
    non-public address (unless allowed): the relay would refuse to deliver to it anyway. An IP
    literal is checked even when ``resolve`` is off (nothing to look up)."""
    from yarl import URL

    parsed = URL(url)
    host = parsed.raw_host or ""
    try:
        addresses = [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        if not resolve:
            return
        addresses = _lookup(host, parsed.port or 443)
    refused = [a for a in addresses if not is_public(a)]
    if refused and not allow_private_networks:
        shown = ", ".join(map(str, refused))
        raise OutboxValidationError(
            "url",
            f"its host {host!r} is or resolves to non-public address(es) {shown}; endpoints "
            "may only be public unless the destination sets allow_private_networks = true "
            "(then pass allow_private_networks=True / --allow-private-networks)",
        )


def _lookup(host: str, port: int) -> builtins.list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The host's addresses, or OutboxValidationError if it does not resolve within
    DNS_TIMEOUT (getaddrinfo itself has no timeout: a stuck resolver would hang the call)."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="outbox-dns")
    try:
        future = pool.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        infos = future.result(timeout=DNS_TIMEOUT)
    except concurrent.futures.TimeoutError:
        raise OutboxValidationError(
            "url",
            f"its host {host!r} did not resolve within {DNS_TIMEOUT:g} s; check the DNS, or "
            "pass check_dns=False (--no-dns-check) to register it unresolved",
        ) from None
    except (OSError, UnicodeError) as exc:
        raise OutboxValidationError(
            "url", f"its host {host!r} does not resolve ({exc}); check the spelling"
        ) from None
    finally:
        pool.shutdown(wait=False)
    return builtins.list(dict.fromkeys(ipaddress.ip_address(str(i[4][0])) for i in infos))


async def _check_address(url: str, allow_private_networks: bool, resolve: bool) -> None:
    # In a thread: a DNS lookup must not stop the caller's event loop.
    await asyncio.to_thread(check_reachable, url, allow_private_networks, resolve=resolve)


def _given(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not UNSET}


def _id(endpoint_id: object) -> int:
    if (
        isinstance(endpoint_id, bool)
        or not isinstance(endpoint_id, int)
        or not 1 <= endpoint_id <= MAX_ID
    ):
        raise OutboxValidationError("endpoint_id", f"must be an int from 1 to {MAX_ID}")
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
    if isinstance(values, str | bytes | Mapping) or not isinstance(values, Iterable):
        raise OutboxValidationError(
            "event_types", 'must be a list of str (e.g. ["invoice.paid"]); empty: every type'
        )
    # At most one more than the limit is read: an endless iterable fails instead of hanging.
    given = builtins.list(itertools.islice(values, MAX_EVENT_TYPES + 1))
    if len(given) > MAX_EVENT_TYPES:
        raise OutboxValidationError(
            "event_types", f"more than {MAX_EVENT_TYPES} types; subscribe to all (empty) instead"
        )
    for t in given:
        if not isinstance(t, str):
            raise OutboxValidationError(
                "event_types", f"each type must be a non-empty str, got {type(t).__name__}"
            )
        _check_label("event_types", t, MAX_EVENT_TYPE_BYTES)
    return builtins.list(dict.fromkeys(given))


def _reencrypted(box: endpoint_secrets.SecretBox, stored: str, counts: dict[str, int]) -> str:
    """``stored`` as it is under the box's first key, counted; OutboxError if no key opens it."""
    if box.is_current(stored):
        counts["current"] += 1
        return stored
    sealed = endpoint_secrets.is_sealed(stored)
    counts["rewritten" if sealed else "encrypted"] += 1
    return box.seal(box.open(stored))


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
    try:
        result = await conn.execute(call.sql, call.binds)
    except StatementError as exc:
        _hide_parameters(exc)
        raise
    return builtins.list(result.fetchall())


def _run_sync(conn: SyncTarget, call: _Call) -> builtins.list[Any]:
    if not isinstance(conn, Session | Connection):
        raise TypeError(
            "the _sync endpoint functions take a SQLAlchemy Session or Connection; got "
            f"{type(conn).__name__} (await the async ones for async connections)"
        )
    try:
        return builtins.list(conn.execute(call.sql, call.binds).fetchall())
    except StatementError as exc:
        _hide_parameters(exc)
        raise


def _hide_parameters(exc: StatementError) -> None:
    """SQLAlchemy prints a failed statement's parameters in its message, and ours carry the
    endpoint's secret (in clear when no key is set): a lock timeout must not log it."""
    exc.hide_parameters = True
    exc.params = None


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
