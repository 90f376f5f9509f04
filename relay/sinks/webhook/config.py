"""The webhook sink's settings: the HTTP client all webhook destinations share ([webhooks]),
and a destination's endpoint: URL, signing secrets, limits, circuit breaker."""

from __future__ import annotations

import ipaddress
import os
import re
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator

from outbox.webhooks.signing import decode_secret
from outbox.webhooks.urls import check_url
from relay.cloudevents import HTTP_ATTRIBUTE_HEADERS
from relay.config.base import MAX_SECONDS, Backoff, DestinationSettings, Section, package_version
from relay.config.environment import PLACEHOLDER_SECRET, documenting

# webhook-id is the row id, unique in one outbox only: a prefix (the service's name) makes it
# unique across the outboxes a receiver consumes. Short (it is in every header and every
# receiver's inbox key, whose event_id holds 1,024 bytes), and printable ASCII without spaces:
# a header value, and the first part of the signed "id.timestamp.body".
MAX_ID_PREFIX_CHARS = 64


def id_prefix_problem(prefix: str) -> str | None:
    """Why ``prefix`` cannot start a ``webhook-id``, or None."""
    if len(prefix) > MAX_ID_PREFIX_CHARS:
        return (
            f"is {len(prefix)} characters long; a webhook-id prefix is at most "
            f'{MAX_ID_PREFIX_CHARS} characters, such as "billing-"'
        )
    for c in prefix:
        if c == " ":
            what = "a space"
        elif c == "\t":
            what = "a tab"
        elif c in "\r\n":
            what = "a line break"
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            what = f"a control character (U+{ord(c):04X})"
        elif ord(c) > 0x7E:
            what = f"{c!r}, which is not printable ASCII"
        else:
            continue
        return (
            f"holds {what}: a webhook-id prefix is printable ASCII without spaces (letters, "
            'digits and punctuation such as "billing-" or "orders.v1:")'
        )
    return None


class WebhookClientSettings(Section):
    """The one HTTP client the relay shares between all webhook destinations."""

    max_connections: int = Field(
        100,
        ge=1,
        description="requests in flight at most, per address policy (destinations with the "
        "same allow_private_networks / allowed_networks share one pool); keep >= the sum of "
        "their max_concurrency",
    )
    max_keepalive_connections: int = Field(
        20,
        ge=0,
        description="no longer used: idle connections close after keepalive_expiry "
        "(accepted so older files still load)",
    )
    keepalive_expiry: float = Field(
        30.0, gt=0, le=86400, description="seconds an idle connection lives"
    )
    connect_timeout: float = Field(
        5.0, gt=0, le=300, description="seconds for DNS + TCP + TLS; destinations may override"
    )
    max_response_bytes: int = Field(
        4096, ge=0, le=1_048_576, description="response body bytes read, at most"
    )
    user_agent: str = Field(
        default_factory=lambda: f"outbox-relay/{package_version()}",
        min_length=1,
        description="the `user-agent` header of every webhook request",
    )
    id_prefix: str | None = Field(
        None,
        description="put before the row id in the `webhook-id` of every request (webhook and "
        'endpoints destinations), e.g. the service\'s name (`"billing-"` sends '
        "`billing-42`), so that a receiver of several outboxes gets ids unique across them; "
        f"at most {MAX_ID_PREFIX_CHARS} printable ASCII characters, no spaces; unset or "
        "empty: the row id alone",
    )

    @field_validator("user_agent")
    @classmethod
    def _user_agent(cls, v: str) -> str:
        problem = header_problem("user-agent", v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("id_prefix")
    @classmethod
    def _id_prefix(cls, v: str | None) -> str | None:
        if not v:
            return None  # OUTBOX_WEBHOOKS_ID_PREFIX= (empty) turns it off, as unset does
        problem = id_prefix_problem(v)
        if problem:
            raise ValueError(problem)
        return v


# The Standard Webhooks example schedule, stretched to about two days: the first attempt is
# immediate, then 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h, 10 h, 10 h (≈ 47.6 h in all).
WEBHOOK_SCHEDULE = (5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0, 36000.0, 36000.0)
WEBHOOK_MAX_ATTEMPTS = len(WEBHOOK_SCHEDULE) + 1

# Headers the relay sets itself: configured headers may not replace them.
RESERVED_HEADERS = frozenset(
    {
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
        "content-type",
        "content-length",
        "transfer-encoding",
        "host",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "proxy-authorization",
        "proxy-connection",
    }
)
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # tab is allowed in a field value
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


def header_problem(name: str, value: str) -> str | None:
    """Why ``name: value`` cannot be sent as an HTTP header, or None if it can."""
    if not _TOKEN.match(name):
        return f"header name {name!r} is not a valid HTTP token"
    if any(c in value for c in "\r\n\x00"):
        return f"header {name!r} has a line break or NUL in its value"
    if _CONTROL.search(value):
        return f"header {name!r} has a control character in its value"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return f"header {name!r} holds text that cannot be encoded (a lone surrogate)"
    return None


class Circuit(Section):
    """Per-endpoint circuit breaker: stop sending after consecutive failures, then probe."""

    threshold: int = Field(5, ge=1, description="consecutive failures that open the circuit")
    cooldown: float = Field(
        30.0, gt=0, le=MAX_SECONDS, description="seconds open before the first probe"
    )
    max_cooldown: float = Field(
        600.0,
        gt=0,
        le=MAX_SECONDS,
        description="cap on the cool-down, which doubles per failed probe",
    )


class WebhookRequestSettings(DestinationSettings):
    """How a destination's rows are POSTed: what a webhook destination (one URL) and an
    endpoints destination (URLs registered at runtime) share."""

    timeout: float = Field(15.0, gt=0, le=300, description="seconds per request, in total")
    connect_timeout: float | None = Field(
        None, gt=0, le=300, description="overrides webhooks.connect_timeout"
    )
    max_concurrency: int = Field(16, ge=1, le=1000, description="in-flight requests, at most")
    headers: dict[str, str] = Field(
        default_factory=dict,
        repr=False,
        description=(
            "extra request headers (values never printed); headers the relay sets itself "
            '(`webhook-*`, `content-type`, framing headers; with envelope = "cloudevents" '
            "the `ce-` attributes it sets, and in structured mode every `ce-` header) are refused"
        ),
    )
    retry_client_errors: bool = Field(
        True, description="retry 3xx and 4xx (but 408/410/425/429); false: fail them at once"
    )
    retry_after_max: float = Field(
        3600.0,
        ge=1,
        le=MAX_SECONDS,
        description="cap on a Retry-After the endpoint asks for, seconds",
    )
    allow_private_networks: bool = Field(
        False, description="allow loopback/private/link-local/... addresses (SSRF guard off)"
    )
    allowed_networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = Field(
        default_factory=list, description="CIDRs allowed although not public, e.g. 10.1.0.0/16"
    )
    circuit: Circuit = Field(
        Circuit(), description="circuit breaker of each endpoint: threshold, cooldown, max_cooldown"
    )
    max_attempts: int = Field(
        WEBHOOK_MAX_ATTEMPTS, ge=1, le=10_000, description="attempts before a row is failed"
    )
    backoff: Backoff = Field(
        Backoff(schedule=list(WEBHOOK_SCHEDULE), jitter=0.2),
        description="retry delays; by default the Standard Webhooks schedule over ~2 days",
    )

    @field_validator("allowed_networks", mode="before")
    @classmethod
    def _cidrs(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        nets = []
        for item in v:
            if isinstance(item, str):
                try:
                    item = ipaddress.ip_network(item)
                except ValueError as exc:
                    raise ValueError(
                        f"{item!r} is not a network in CIDR form like 10.1.0.0/16 ({exc})"
                    ) from None
            nets.append(item)
        return nets

    @field_validator("headers")
    @classmethod
    def _headers(cls, v: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        cloudevents = info.data.get("envelope") == "cloudevents"
        structured = cloudevents and info.data.get("cloudevents_mode") == "structured"
        for name, value in v.items():
            lower = name.lower()
            if lower in RESERVED_HEADERS:
                raise ValueError(f"header {name!r} is set by the relay and cannot be configured")
            if cloudevents and lower in HTTP_ATTRIBUTE_HEADERS:
                raise ValueError(
                    f"header {name!r} is the CloudEvents attribute the relay sets "
                    '(envelope = "cloudevents"); remove it from headers'
                )
            if structured and lower.startswith("ce-"):
                # A ce- header makes receivers read the request in binary mode.
                raise ValueError(
                    f"header {name!r}: a structured CloudEvent carries its attributes in the "
                    "body, and a ce- header would make receivers read it as binary; remove "
                    'it, or use cloudevents_mode = "binary"'
                )
            problem = header_problem(name, value)
            if problem:
                raise ValueError(problem)
        return v


class WebhookDestination(WebhookRequestSettings):
    kind: Literal["webhook"] = Field(
        description=(
            "the kind of sink that delivers the destination's rows; it decides which other keys the"
            " destination takes"
        )
    )
    url: str = Field(description="http(s) URL the events are POSTed to")
    secrets: list[SecretStr] = Field(
        default_factory=list, description="whsec_ signing secrets; several while rotating"
    )
    secret_env: str | None = Field(
        None, description="environment variable holding the secret(s), read at start-up"
    )

    @model_validator(mode="before")
    @classmethod
    def _secret_from_env(cls, data: Any) -> Any:
        # Read at start-up so a missing variable stops the relay now, not at the first event.
        if not isinstance(data, dict) or data.get("secret_env") is None:
            return data
        if data.get("secrets"):
            raise ValueError("set either secrets or secret_env, not both")
        var = data["secret_env"]
        value = os.environ.get(var) if isinstance(var, str) else None
        if (not value or not value.strip()) and documenting.get():
            value = PLACEHOLDER_SECRET
        if not value or not value.strip():
            raise ValueError(
                f"secret_env names the environment variable {var!r}, which is not set "
                "(or empty); export it or put the secret in secrets"
            )
        # Several secrets (rotation) may be separated by spaces or commas.
        return {**data, "secrets": [s for s in re.split(r"[\s,]+", value) if s]}

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        return check_url(v)

    @field_validator("secrets")
    @classmethod
    def _whsec(cls, v: list[SecretStr]) -> list[SecretStr]:
        for s in v:
            decode_secret(s.get_secret_value())
        return v

    @model_validator(mode="after")
    def _needs_secret(self) -> WebhookDestination:
        if not self.secrets:
            raise ValueError(
                'a webhook destination needs a signing secret: set secrets = ["whsec_…"] '
                'or secret_env = "NAME_OF_ENV_VAR"'
            )
        return self

    def signing_keys(self) -> list[bytes]:
        return [decode_secret(s.get_secret_value()) for s in self.secrets]
