"""``[portal]``: the tenant portal served by the relay's listener at ``/portal`` (beside the
console's ``/ui``), as ``outbox-relay portal`` serves it on its own (docs/portal.md)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from pydantic import Field, SecretStr, field_validator, model_validator

from relay.config.base import Section

if TYPE_CHECKING:
    from outbox.endpoints.portal_tokens import PortalKeys


def check_origins(origins: tuple[str, ...]) -> tuple[str, ...]:
    """Origins as a CSP source list takes them: scheme, host and an optional port, nothing
    more (a path, a wildcard or a space would widen or break the policy)."""
    for origin in origins:
        if not re.fullmatch(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?", origin):
            raise ValueError(
                f"embed origin {origin!r}: give scheme, host and port only "
                "(https://app.example.com)"
            )
    return tuple(origins)


class PortalSettings(Section):
    """The tenant portal (issue #30): an API and pages for each tenant of the endpoints
    destinations, opened by a token the application mints."""

    enabled: bool = Field(
        False, description="serve the tenant portal at `/portal` on the `[http]` listener"
    )
    key: SecretStr | None = Field(
        None,
        description="the portal key(s), `opk_…`, comma-separated during a rotation (the first "
        "signs); usually set through OUTBOX_PORTAL_KEY, never in a file others read",
    )
    key_file: str | None = Field(None, description="a file holding the key(s) instead")
    destinations: list[str] = Field(
        default_factory=list,
        description="the endpoints destinations tenants may add endpoints to, the first the "
        "default (empty: every endpoints destination)",
    )
    max_endpoints: int = Field(50, ge=1, le=10_000, description="endpoints a tenant may have")
    embed_origins: list[str] = Field(
        default_factory=list,
        description="sites whose pages may frame the portal's (`https://app.example.com`)",
    )
    allow_private_networks: bool = Field(
        False,
        description="let tenants register endpoints on private or loopback networks (a test "
        "set-up only)",
    )

    @field_validator("embed_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        check_origins(tuple(v))  # raises ValueError naming the origin
        return v

    @model_validator(mode="after")
    def _key_when_enabled(self) -> PortalSettings:
        if self.enabled:
            self.keys()  # raises ValueError naming what is missing or wrong
        return self

    def keys(self) -> PortalKeys:
        """The portal keys: ``key``, else ``key_file``, else OUTBOX_PORTAL_KEY."""
        # Here, not at the top: a relay without the portal loads nothing of outbox.endpoints
        # (tests/test_imports.py).
        from outbox.endpoints.portal_tokens import KEY_VARIABLE, PortalKeys
        from outbox.errors import OutboxError

        try:
            if self.key is not None:
                return PortalKeys.parse(self.key.get_secret_value(), "portal.key")
            if self.key_file is not None:
                with open(self.key_file, encoding="utf-8") as f:
                    return PortalKeys.parse(f.read(4097).strip(), "portal.key_file")
            return PortalKeys.of(None)
        except OSError as exc:
            where = f"portal.key_file: cannot read {self.key_file}"
            raise ValueError(f"{where}: {exc.strerror}") from None
        except OutboxError as exc:
            raise ValueError(
                f"{exc} (portal.key, portal.key_file or {KEY_VARIABLE}; make one with "
                "`outbox-relay endpoints portal-key`)"
            ) from None
