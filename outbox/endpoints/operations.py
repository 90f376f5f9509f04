"""The work of each endpoint call, written once: check the arguments, build the statement, run
it over a runner (async or sync: outbox.endpoints.runners), read its rows. :class:`Operations`
is the base of :class:`outbox.endpoints.Endpoints`, whose public methods, async and sync, call
these."""

from __future__ import annotations

import builtins
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NoReturn

from sqlalchemy import TextClause, text

from outbox import endpoint_secrets, queries
from outbox.endpoints import checks
from outbox.endpoints.model import Endpoint, Reencrypted, deleted, endpoint, one
from outbox.endpoints.reencrypt import sort
from outbox.endpoints.runners import Call, Runner
from outbox.errors import OutboxValidationError
from outbox.message import MAX_DESTINATION_BYTES, MAX_TENANT_BYTES
from outbox.message import _label as _check_label
from outbox.message import _text as _check_text

# The fields an update may change, in the order Endpoints.update passes them.
_CHANGEABLE = ("url", "tenant", "event_types", "rate_limit", "description")


class Operations:
    """The statements of one schema's endpoints, the secret box, and each call's work."""

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

    # --- each call, over a runner -------------------------------------------------------------

    async def _create_on(
        self, io: Runner, new: tuple[Any, ...], reach: tuple[bool, bool]
    ) -> Endpoint:
        """``new``: destination, url, tenant, event_types, rate_limit, description, secret;
        ``reach``: allow_private_networks, check_dns."""
        destination, url, tenant, event_types, rate_limit, description, secret = new
        _check_text("destination", destination, MAX_DESTINATION_BYTES)
        fields = checks.fields(
            url=url,
            tenant=tenant,
            event_types=event_types,
            rate_limit=rate_limit,
            description=description,
        )
        plain = endpoint_secrets.generate() if secret is None else checks.given_secret(secret)
        call = Call(
            self._create, {"destination": destination, "secret": self.box.seal(plain), **fields}
        )
        await io.reach(url, *reach)
        rows = await io.run(call)
        if not rows:  # the insert's own condition: a secret in clear where some are encrypted
            raise endpoint_secrets.downgrade_refused(self.table)
        ep = endpoint(rows[0], secret=plain)
        if not endpoint_secrets.is_sealed(call.binds["secret"]):
            self._unencrypted(ep)
        return ep

    async def _get_on(self, io: Runner, endpoint_id: int, show_secret: bool) -> Endpoint:
        rows = await io.run(Call(self._get, {"id": checks.endpoint_id(endpoint_id)}))
        secret = self.box.open(rows[0]._mapping["secret"]) if show_secret and rows else None
        return one(rows, endpoint_id, secret)

    async def _list_on(
        self, io: Runner, destination: object, tenant: object
    ) -> builtins.list[Endpoint]:
        """``tenant`` lists the endpoints registered for that tenant, not those taking all."""
        if destination is not None:
            _check_text("destination", destination, MAX_DESTINATION_BYTES)
        binds = {
            "destination": destination,
            "tenant": _check_label("tenant", tenant, MAX_TENANT_BYTES),
        }
        return [endpoint(r) for r in await io.run(Call(self._list, binds))]

    async def _update_on(
        self, io: Runner, endpoint_id: int, values: tuple[Any, ...], reach: tuple[bool, bool]
    ) -> Endpoint:
        """``values``: url, tenant, event_types, rate_limit, description (UNSET: unchanged);
        ``reach``: allow_private_networks, check_dns."""
        changes = checks.given(**dict(zip(_CHANGEABLE, values, strict=True)))
        fields = checks.fields(**changes)
        binds: dict[str, Any] = {"id": checks.endpoint_id(endpoint_id)}
        for name in _CHANGEABLE:
            binds[f"set_{name}"] = name in fields
            binds[name] = fields.get(name)
        if binds["event_types"] is None:
            binds["event_types"] = []
        if binds["description"] is None:
            binds["description"] = ""
        if "url" in changes:
            await io.reach(changes["url"], *reach)
        return one(await io.run(Call(self._update, binds)), endpoint_id)

    async def _disable_on(self, io: Runner, endpoint_id: int, reason: str | None) -> Endpoint:
        binds = {"id": checks.endpoint_id(endpoint_id), "reason": checks.reason(reason)}
        return one(await io.run(Call(self._disable, binds)), endpoint_id)

    async def _enable_on(self, io: Runner, endpoint_id: int) -> Endpoint:
        rows = await io.run(Call(self._enable, {"id": checks.endpoint_id(endpoint_id)}))
        return one(rows, endpoint_id)

    async def _rotate_on(
        self, io: Runner, endpoint_id: int, keep_previous: timedelta, secret: str | None
    ) -> Endpoint:
        keep = checks.keep_previous(keep_previous)
        plain = endpoint_secrets.generate() if secret is None else checks.given_secret(secret)
        ident = checks.endpoint_id(endpoint_id)
        stored = self.box.seal(plain)
        sealed = endpoint_secrets.is_sealed(stored)
        binds = {"id": ident, "secret": stored, "keep_seconds": keep.total_seconds()}
        rows = await io.run(Call(self._rotate, binds))
        if not rows:
            found = await io.run(Call(self._get, {"id": checks.endpoint_id(endpoint_id)}))
            downgrade = bool(found) and not sealed
            if downgrade:
                downgrade = bool((await io.run(Call(self._holds_sealed, {})))[0][0])
            self._refuse_rotation(found, endpoint_id, downgrade)
        # With a key, the previous secret is encrypted too if it was stored in clear (from
        # before the key).
        previous = rows[0]._mapping["previous_secret"]
        if sealed and previous is not None and not endpoint_secrets.is_sealed(previous):
            seal = {"id": rows[0]._mapping["id"], "previous": self.box.seal(previous)}
            await io.run(Call(self._seal_previous, seal))
        ep = one(rows, ident, plain)
        if not sealed:
            self._unencrypted(ep)
        return ep

    def _refuse_rotation(self, rows: Sequence[Any], endpoint_id: int, downgrade: bool) -> NoReturn:
        """A rotation changed no row: the endpoint is missing, its secrets are encrypted and
        this one would not be (``downgrade``), or its previous secret is still within the
        window promised at the last rotation."""
        until = one(rows, endpoint_id).previous_secret_until
        if downgrade:
            raise endpoint_secrets.downgrade_refused(self.table)
        raise OutboxValidationError(
            "keep_previous",
            f"the previous secret of endpoint {endpoint_id} is still valid until "
            f"{until.isoformat() if until else '?'}; rotate again after that, or pass "
            "keep_previous=timedelta(0) (--keep-previous-hours 0) to drop it at once (a leaked "
            "secret)",
        )

    async def _reencrypt_on(self, io: Runner, after_id: int, limit: int) -> Reencrypted:
        box = self.box
        if not box.encrypts:
            raise endpoint_secrets.SecretEncryptionRequired(
                f"re-encrypting needs {endpoint_secrets.KEY_VARIABLE}: set it to the new key "
                "followed by the keys the secrets may be encrypted with now, comma-separated "
                "(new,old)"
            )
        checks.batch(limit)
        if after_id != 0:
            checks.endpoint_id(after_id)
        rows = await io.run(Call(self._reencrypt_read, {"after_id": after_id, "limit": limit}))
        counts, unreadable, changed = sort(box, rows)
        if changed:
            ids, secrets, previous_secrets = (builtins.list(c) for c in zip(*changed, strict=True))
            binds = {"ids": ids, "secrets": secrets, "previous": previous_secrets}
            await io.run(Call(self._reencrypt_write, binds))
        return Reencrypted(
            last_id=rows[-1][0] if rows else None,
            endpoints=len(rows),
            unreadable=tuple(unreadable),
            **counts,
        )

    async def _delete_on(self, io: Runner, endpoint_id: int) -> int:
        rows = await io.run(Call(self._delete, {"id": checks.endpoint_id(endpoint_id)}))
        return deleted(rows, endpoint_id)
