"""A request's scope: the tenant a verified token opened, and what it may do. The portal's
statements bind their tenant only from one, so no string from a request reaches them as a
tenant."""

from __future__ import annotations

from dataclasses import dataclass

from outbox.endpoints.portal_tokens import PortalAccess


@dataclass(frozen=True, slots=True)
class Scope:
    tenant: str
    token_id: str
    write: bool
    schema: str

    @classmethod
    def of(cls, access: PortalAccess, schema: str) -> Scope:
        return cls(access.tenant, access.token_id, access.write, schema)

    def require_write(self) -> None:
        """PermissionError unless the token may change things (a read-only one may not)."""
        if not self.write:
            raise PermissionError("this token may read, not change")
