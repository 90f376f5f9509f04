"""The public calls on the endpoints of one outbox schema, :class:`Endpoints`: each async, with
a ``_sync`` twin for SQLAlchemy's ``Session``/``Connection``, both over the same work
(outbox.endpoints.operations)."""

from __future__ import annotations

import builtins
from collections.abc import Iterable
from datetime import timedelta

from outbox.endpoints.checks import DEFAULT_KEEP_PREVIOUS
from outbox.endpoints.model import UNSET, Endpoint, Reencrypted
from outbox.endpoints.operations import Operations
from outbox.endpoints.runners import AsyncRunner, AsyncTarget, SyncRunner, SyncTarget, finish


class Endpoints(Operations):
    """The endpoints of the outbox in ``schema``; ``outbox.endpoints`` uses schema public.

    ``secret_key``: the Fernet key(s) for secrets at rest; default: the environment's
    ``OUTBOX_ENDPOINT_SECRET_KEY``, read when first needed. ``require_encryption``: refuse to
    store a secret unencrypted (no key); default: ``OUTBOX_ENDPOINT_SECRET_REQUIRE``.
    """

    # The public methods spell their keywords out, async and sync, so that editors and type
    # checkers show each one; the work is done once, by the _*_on coroutines of Operations,
    # over a runner of the connection (a sync one never suspends: finish() runs it here).

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
        new = (destination, url, tenant, event_types, rate_limit, description, secret)
        reach = (allow_private_networks, check_dns)
        return await self._create_on(AsyncRunner(conn), new, reach)

    async def get(
        self, conn: AsyncTarget, endpoint_id: int, *, show_secret: bool = False
    ) -> Endpoint:
        return await self._get_on(AsyncRunner(conn), endpoint_id, show_secret)

    async def list(
        self, conn: AsyncTarget, *, destination: str | None = None, tenant: str | None = None
    ) -> builtins.list[Endpoint]:
        return await self._list_on(AsyncRunner(conn), destination, tenant)

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
        fields = (url, tenant, event_types, rate_limit, description)
        reach = (allow_private_networks, check_dns)
        return await self._update_on(AsyncRunner(conn), endpoint_id, fields, reach)

    async def disable(
        self, conn: AsyncTarget, endpoint_id: int, *, reason: str | None = None
    ) -> Endpoint:
        return await self._disable_on(AsyncRunner(conn), endpoint_id, reason)

    async def enable(self, conn: AsyncTarget, endpoint_id: int) -> Endpoint:
        return await self._enable_on(AsyncRunner(conn), endpoint_id)

    async def rotate_secret(
        self,
        conn: AsyncTarget,
        endpoint_id: int,
        *,
        keep_previous: timedelta = DEFAULT_KEEP_PREVIOUS,
        secret: str | None = None,
    ) -> Endpoint:
        """A new secret (returned); the previous one still signs for ``keep_previous``."""
        return await self._rotate_on(AsyncRunner(conn), endpoint_id, keep_previous, secret)

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
        return await self._reencrypt_on(AsyncRunner(conn), after_id, limit)

    async def delete(self, conn: AsyncTarget, endpoint_id: int) -> int:
        """Delete the endpoint; its unfinished deliveries end as ``cancelled``. Returns how
        many were cancelled."""
        return await self._delete_on(AsyncRunner(conn), endpoint_id)

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
        new = (destination, url, tenant, event_types, rate_limit, description, secret)
        reach = (allow_private_networks, check_dns)
        return finish(self._create_on(SyncRunner(conn), new, reach))

    def get_sync(
        self, conn: SyncTarget, endpoint_id: int, *, show_secret: bool = False
    ) -> Endpoint:
        return finish(self._get_on(SyncRunner(conn), endpoint_id, show_secret))

    def list_sync(
        self, conn: SyncTarget, *, destination: str | None = None, tenant: str | None = None
    ) -> builtins.list[Endpoint]:
        return finish(self._list_on(SyncRunner(conn), destination, tenant))

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
        fields = (url, tenant, event_types, rate_limit, description)
        reach = (allow_private_networks, check_dns)
        return finish(self._update_on(SyncRunner(conn), endpoint_id, fields, reach))

    def disable_sync(
        self, conn: SyncTarget, endpoint_id: int, *, reason: str | None = None
    ) -> Endpoint:
        return finish(self._disable_on(SyncRunner(conn), endpoint_id, reason))

    def enable_sync(self, conn: SyncTarget, endpoint_id: int) -> Endpoint:
        return finish(self._enable_on(SyncRunner(conn), endpoint_id))

    def rotate_secret_sync(
        self,
        conn: SyncTarget,
        endpoint_id: int,
        *,
        keep_previous: timedelta = DEFAULT_KEEP_PREVIOUS,
        secret: str | None = None,
    ) -> Endpoint:
        return finish(self._rotate_on(SyncRunner(conn), endpoint_id, keep_previous, secret))

    def delete_sync(self, conn: SyncTarget, endpoint_id: int) -> int:
        return finish(self._delete_on(SyncRunner(conn), endpoint_id))
