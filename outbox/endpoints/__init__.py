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

from outbox.endpoint_secrets import SecretEncryptionRequired
from outbox.endpoints.api import Endpoints

# The limits and the connection types stay names of outbox.endpoints, as before its split
# (the limits are the columns': read them here; DNS_TIMEOUT may be set here too).
from outbox.endpoints.checks import (
    DEFAULT_KEEP_PREVIOUS as DEFAULT_KEEP_PREVIOUS,
)
from outbox.endpoints.checks import (
    MAX_DESCRIPTION_BYTES as MAX_DESCRIPTION_BYTES,
)
from outbox.endpoints.checks import MAX_EVENT_TYPES as MAX_EVENT_TYPES
from outbox.endpoints.checks import MAX_ID as MAX_ID
from outbox.endpoints.checks import MAX_KEEP_PREVIOUS as MAX_KEEP_PREVIOUS
from outbox.endpoints.checks import MAX_RATE_LIMIT as MAX_RATE_LIMIT
from outbox.endpoints.checks import MAX_REENCRYPT_BATCH as MAX_REENCRYPT_BATCH
from outbox.endpoints.checks import MAX_URL_BYTES as MAX_URL_BYTES
from outbox.endpoints.model import UNSET, Endpoint, EndpointNotFound, Reencrypted
from outbox.endpoints.portal_tokens import (
    PortalAccess,
    PortalKeyMissing,
    PortalTokenRefused,
    new_portal_key,
    portal_token,
    portal_url,
    verify_portal_token,
)
from outbox.endpoints.reachable import DNS_TIMEOUT as DNS_TIMEOUT
from outbox.endpoints.reachable import check_reachable
from outbox.endpoints.runners import AsyncTarget as AsyncTarget
from outbox.endpoints.runners import SyncTarget as SyncTarget

__all__ = [
    "UNSET",
    "Endpoint",
    "EndpointNotFound",
    "Endpoints",
    "PortalAccess",
    "PortalKeyMissing",
    "PortalTokenRefused",
    "Reencrypted",
    "SecretEncryptionRequired",
    "check_reachable",
    "new_portal_key",
    "portal_token",
    "portal_url",
    "verify_portal_token",
]

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
