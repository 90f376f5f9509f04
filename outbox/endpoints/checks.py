"""The checks of what an endpoint call is given, made before any SQL, and their limits: each
failure is an OutboxValidationError that names the argument."""

from __future__ import annotations

import builtins
import itertools
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from outbox import endpoint_secrets
from outbox.endpoints.model import UNSET
from outbox.errors import OutboxError, OutboxValidationError
from outbox.message import MAX_EVENT_TYPE_BYTES, MAX_TENANT_BYTES
from outbox.message import _label as _check_label
from outbox.message import _text as _check_text

MAX_URL_BYTES = 2048
MAX_DESCRIPTION_BYTES = 1024
MAX_EVENT_TYPES = 100
DEFAULT_KEEP_PREVIOUS = timedelta(hours=24)
MAX_KEEP_PREVIOUS = timedelta(days=366)
MAX_RATE_LIMIT = 2**31 - 1  # the column is an integer
MAX_ID = 2**63 - 1  # and ids are bigint
MAX_REENCRYPT_BATCH = 10_000


def fields(
    *,
    url: Any = UNSET,
    tenant: Any = UNSET,
    event_types: Any = UNSET,
    rate_limit: Any = UNSET,
    description: Any = UNSET,
) -> dict[str, Any]:
    """What is given of an endpoint's fields, checked (event types deduplicated)."""
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


def given(**values: Any) -> dict[str, Any]:
    """The values that are not UNSET."""
    return {k: v for k, v in values.items() if v is not UNSET}


def endpoint_id(endpoint_id: object) -> int:
    if (
        isinstance(endpoint_id, bool)
        or not isinstance(endpoint_id, int)
        or not 1 <= endpoint_id <= MAX_ID
    ):
        raise OutboxValidationError("endpoint_id", f"must be an int from 1 to {MAX_ID}")
    return endpoint_id


def reason(reason: object) -> str | None:
    if reason is None:
        return None
    return _check_text("reason", reason, MAX_DESCRIPTION_BYTES, kind="a str or None")


def given_secret(secret: object) -> str:
    if not isinstance(secret, str):
        raise OutboxValidationError("secret", "must be a 'whsec_…' str or None")
    try:
        return endpoint_secrets.check(secret)
    except OutboxError as exc:
        raise OutboxValidationError("secret", str(exc)) from None


def keep_previous(keep_previous: object) -> timedelta:
    if not isinstance(keep_previous, timedelta) or not (
        timedelta(0) <= keep_previous <= MAX_KEEP_PREVIOUS
    ):
        raise OutboxValidationError(
            "keep_previous", f"must be a timedelta from zero to {MAX_KEEP_PREVIOUS.days} days"
        )
    return keep_previous


def batch(limit: object) -> int:
    """A batch size of reencrypt."""
    if (
        isinstance(limit, bool)
        or not isinstance(limit, int)
        or not 0 < limit <= MAX_REENCRYPT_BATCH
    ):
        raise OutboxValidationError("limit", f"must be an int from 1 to {MAX_REENCRYPT_BATCH}")
    return limit


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
