"""Endpoint secrets at rest, as a relay sees them: the key it opens them with, what it says at
start-up when secrets must be encrypted (OUTBOX_ENDPOINT_SECRET_REQUIRE) and some are not,
and clearing previous secrets once their window has passed.

A relay that requires encryption and finds secrets in clear starts anyway, and says so as an
error naming the endpoints: refusing would stop every destination (Kafka ones too) over rows
the relay's role cannot rewrite, and a restart of any relay, for any reason, would turn one
such row into an outage. The writers are where the requirement holds (outbox.endpoints
refuses plaintext); `outbox-relay endpoints reencrypt` mends what was stored before. A relay
that requires encryption without having the key itself is a configuration error, and does
not start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING

import asyncpg
import structlog

from outbox import queries
from outbox.endpoint_secrets import KEY_VARIABLE, REQUIRE_VARIABLE, SecretBox
from outbox.errors import OutboxError

if TYPE_CHECKING:
    from relay.db.store import Store

log = structlog.get_logger("relay.sink.endpoints")

LISTED = 20  # endpoint ids named in the start-up error; the count says how many in all
CLEAR_BATCH = 500


def secret_box(environ: Mapping[str, str] | None = None) -> SecretBox:
    """The relay's key(s) from the environment; OutboxError, saying what to set, for a key
    that is not one, a requirement that is not 1 or 0, or a requirement without a key."""
    box = SecretBox.from_environment(environ)
    if box.required and not box.encrypts:
        raise OutboxError(
            f"{REQUIRE_VARIABLE} is set, so endpoint secrets are stored encrypted, but "
            f"{KEY_VARIABLE} is not set for the relay, which could then sign with none of "
            "them: set it to the key the applications use (the same value)"
        )
    return box


async def warn_unencrypted(store: Store, box: SecretBox) -> None:
    """At start-up, where encryption is required: the endpoints whose secret or previous
    secret is stored in clear, as the error event ``relay.endpoints.secrets_unencrypted``
    (one read of outbox_endpoints)."""
    if not box.required:
        return
    count, ids = await store.call("fetchrow", queries.ENDPOINT_UNENCRYPTED_PG, LISTED)
    if count:
        log.error(
            "relay.endpoints.secrets_unencrypted",
            endpoints=count,
            ids=list(ids),
            action=f"{REQUIRE_VARIABLE} is set but these secrets are stored unencrypted: run "
            f"`outbox-relay endpoints reencrypt` with {KEY_VARIABLE} set",
        )


async def clear_expired_previous_secrets(store: Store, batch_size: int = CLEAR_BATCH) -> int:
    """Clear every previous secret whose window has passed (it signs nothing any more, and
    should not be kept), ``batch_size`` endpoints per statement; returns how many. Only when
    there is one does it write (each write wakes every relay, which re-reads the keys). For
    the relay's maintenance; a role granted before this needs deploy/sql/relay_role.sql again
    (it is said, and nothing is cleared)."""
    cleared = 0
    while True:
        due = await store.call("fetch", queries.ENDPOINT_EXPIRED_PREVIOUS_PG, batch_size)
        if not due:
            return cleared
        try:
            done = await store.call(
                "fetch", queries.ENDPOINT_CLEAR_PREVIOUS_PG, [r["id"] for r in due]
            )
        except asyncpg.InsufficientPrivilegeError:
            log.warning(
                "relay.endpoints.previous_secrets_not_cleared",
                endpoints=len(due),
                action="the relay's role may not clear them: run deploy/sql/relay_role.sql "
                "again (it grants UPDATE of previous_secret and previous_secret_until)",
            )
            return cleared
        cleared += len(done)
        if len(due) < batch_size:
            return cleared
        await asyncio.sleep(0)  # let deliveries run between batches
