"""CloudEvents 1.0 for the sinks: what a destination with ``envelope = "cloudevents"`` adds.

A row becomes a CloudEvent whose ``id`` is the row's id, ``source`` the destination's,
``type`` the row's ``event_type`` (or the destination's ``default_type``), ``time`` its
``created_at`` and ``datacontenttype`` its content type. In *binary* mode the attributes
travel as headers and the payload is sent as it is; in *structured* mode one JSON document
(``application/cloudevents+json``) holds the attributes and the data. See docs/cloudevents.md.

A row's own ``ce-`` (HTTP) / ``ce_`` (Kafka) headers become extension attributes in binary
mode, but only those whose name is a valid attribute name that the relay does not set: any
other would make readers refuse the whole event (:meth:`CloudEvents.row_attribute`).

Everything that is the same for every row of a destination is built once (:class:`CloudEvents`
per destination); a row costs its id, time and type, and, structured, one JSON document
spliced from bytes: a JSON payload is embedded as it is (checked to be JSON, not re-encoded),
any other payload as ``data_base64``.
"""

from __future__ import annotations

import base64
import json
import re
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal, Protocol
from urllib.parse import quote

import structlog

if TYPE_CHECKING:
    from relay.model import Envelope

SPECVERSION = "1.0"
STRUCTURED_CONTENT_TYPE = "application/cloudevents+json"
# The attributes the relay sets on every event, as the HTTP binding names them (Kafka: ce_).
ATTRIBUTES = ("id", "source", "type", "specversion", "time")
HTTP_ATTRIBUTE_HEADERS = frozenset(f"ce-{a}" for a in ATTRIBUTES)
KAFKA_ATTRIBUTE_HEADERS = frozenset(f"ce_{a}" for a in ATTRIBUTES)
# A context attribute's name (spec 1.0, "Attribute Naming Convention").
ATTRIBUTE_NAME = re.compile(r"[a-z0-9]{1,20}")
# Optional attributes that, when present, must not be empty (the SDKs refuse the event).
_NOT_EMPTY = frozenset(("subject", "dataschema"))

log = structlog.get_logger("relay.cloudevents")

MAX_TYPE_BYTES = 255  # as enqueue's event_type
MAX_SOURCE_CHARS = 2048
_CACHE_MAX = 4096  # distinct event types or content types remembered per destination

# The CloudEvents JSON format's rule for data held as JSON (the SDKs use it too).
_JSON_MEDIA = re.compile(r"^(application|text)/([a-zA-Z0-9\-.]+\+)?json(;.*)?$", re.IGNORECASE)

# RFC 3986, appendix B: scheme, authority, path, query, fragment of any URI-reference.
_PARTS = re.compile(r"^(?:([^:/?#]+):)?(?://([^/?#]*))?([^?#]*)(?:\?([^#]*))?(?:#(.*))?$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*$")
_PCT = "%[0-9A-Fa-f]{2}"
_PCHAR = r"A-Za-z0-9\-._~!$&'()*+,;=:@"
_PATH = re.compile(rf"^(?:[{_PCHAR}/]|{_PCT})*$")
_QUERY = re.compile(rf"^(?:[{_PCHAR}/?]|{_PCT})*$")
_AUTHORITY = re.compile(
    rf"^(?:(?:[A-Za-z0-9\-._~!$&'()*+,;=:]|{_PCT})*@)?"  # userinfo@
    rf"(?:\[[0-9A-Fa-f:.vV]+\]|(?:[A-Za-z0-9\-._~!$&'()*+,;=]|{_PCT})*)"  # host
    r"(?::[0-9]*)?$"  # :port
)
# The HTTP binding (3.1.3.2): header values are printable ASCII but space, '"' and '%'.
_HTTP_SAFE = "".join(c for c in map(chr, range(0x21, 0x7F)) if c not in ' "%')


def source_problem(v: str) -> str | None:
    """Why ``v`` is not a URI-reference (RFC 3986) usable as a CloudEvents ``source``, or
    None."""
    if not v:
        return "is empty"
    if len(v) > MAX_SOURCE_CHARS:
        return f"is longer than {MAX_SOURCE_CHARS} characters"
    bad = next((c for c in v if ord(c) <= 0x20 or ord(c) >= 0x7F), None)
    if bad is not None:
        what = "a space" if bad == " " else f"the character {bad!r}"
        return f"holds {what}; percent-encode it (e.g. %20 for a space)"
    m = _PARTS.match(v)
    if m is None:  # the pattern matches every string; kept for the type checker
        return "cannot be parsed"
    scheme, authority, path, query, fragment = m.groups()
    if scheme is not None and not _SCHEME.match(scheme):
        return (
            f"starts with {scheme + ':'!r}, which is not a URI scheme; a relative reference "
            "cannot have ':' in its first segment (write ./" + v + " or a full URI)"
        )
    if authority is not None and not _AUTHORITY.match(authority):
        return "has a host part (after //) that is not a valid authority"
    for part, pattern, name in (
        (path, _PATH, "path"),
        (query, _QUERY, "query"),
        (fragment, _QUERY, "fragment"),
    ):
        if part is not None and not pattern.match(part):
            return f"has a {name} with a character URIs take only %-encoded, or a bad %-escape"
    return None


def type_problem(v: str) -> str | None:
    """Why ``v`` cannot be an event's ``type`` (as enqueue checks event_type), or None."""
    if not v:
        return "is empty"
    if len(v.encode("utf-8", "surrogatepass")) > MAX_TYPE_BYTES:
        return f"is longer than {MAX_TYPE_BYTES} bytes"
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in v):
        return "holds a control character"
    return None


def is_json(content_type: str) -> bool:
    """Whether the JSON event format holds data of ``content_type`` as JSON."""
    return _JSON_MEDIA.match(content_type) is not None


def rfc3339(t: datetime) -> str:
    """``t`` as RFC 3339, UTC as ``Z``, with microseconds (a naive time is taken as UTC)."""
    if t.tzinfo is UTC or t.tzinfo is None:
        # The relay's times are UTC: formatted by hand, in half the time of isoformat().
        return "%04d-%02d-%02dT%02d:%02d:%02d.%06dZ" % (  # noqa: UP031 - the fastest form
            t.year,
            t.month,
            t.day,
            t.hour,
            t.minute,
            t.second,
            t.microsecond,
        )
    text = t.isoformat(timespec="microseconds")
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def http_header_value(v: str) -> str:
    """``v`` percent-encoded as the HTTP binding requires of a ``ce-`` header's value."""
    return quote(v, safe=_HTTP_SAFE)


class NotSendable(ValueError):
    """The row cannot be sent as a CloudEvent; retrying the row as it is gives the same."""


class CloudEvents:
    """One destination's CloudEvents envelope, with what every row shares built once."""

    __slots__ = (
        "_ct_json",
        "_head",
        "_http_types",
        "_type_json",
        "_warned",
        "default_type",
        "http_fixed",
        "kafka_fixed",
        "source",
        "structured",
    )

    def __init__(
        self,
        source: str,
        mode: Literal["binary", "structured"] = "binary",
        default_type: str | None = None,
    ) -> None:
        problem = source_problem(source)
        if problem:
            raise ValueError(f"source {problem}")
        self.source = source
        self.structured = mode == "structured"
        self.default_type = default_type
        self.http_fixed = {
            "ce-specversion": SPECVERSION,
            "ce-source": http_header_value(source),
        }
        self.kafka_fixed = [("ce_specversion", b"1.0"), ("ce_source", source.encode())]
        self._head = b'{"specversion":"1.0","source":%b,"id":"' % json.dumps(source).encode()
        self._http_types: dict[str, str] = {}
        self._type_json: dict[str, bytes] = {}
        self._ct_json: dict[str, tuple[bytes, bool]] = {}
        self._warned = False  # a row header was dropped (logged once per destination)

    def __repr__(self) -> str:
        mode = "structured" if self.structured else "binary"
        return f"CloudEvents(source={self.source!r}, mode={mode!r})"

    def type_of(self, env: Envelope) -> str:
        """The row's ``type``: its event_type, else the destination's default_type."""
        kind = env.event_type or self.default_type
        if kind is None:
            raise NotSendable(
                f"row {env.id} has no event_type, and destination {env.destination!r} sends "
                "CloudEvents, whose type attribute is required: set the row's event_type "
                f"(UPDATE outbox SET event_type = '…' WHERE id = {env.id}), or default_type on "
                f"the destination, then run outbox-relay retry --id {env.id}"
            )
        return kind

    # --- a row's own ce- / ce_ headers ----------------------------------------------------

    def row_attribute(self, env: Envelope, header: str, value: str) -> str | None:
        """The attribute a row's ``ce-`` (HTTP) or ``ce_`` (Kafka) header sets: its name
        without the prefix, lower-cased (header names are case-insensitive to the bindings),
        or None when the header is dropped. In structured mode every one is dropped (a ce
        header makes readers take the message as binary). In binary mode a header is
        dropped, with a warning logged once per destination, when it names an attribute
        the relay sets (``id``, ``source``, ``type``, ``specversion``, ``time``), or
        ``datacontenttype`` (the content type says it), or ``data``, or is not a valid
        attribute name (``[a-z0-9]{1,20}``): readers refuse the whole event for such a name.
        """
        if self.structured:
            return None
        attr = header[3:].lower()
        problem = attribute_problem(attr, value)
        if problem is None:
            return attr
        if not self._warned:
            self._warned = True
            log.warning(
                "relay.cloudevents.header_dropped",
                destination=env.destination,
                row=env.id,
                header=header[:100],
                reason=problem,
                hint=(
                    "a row's ce- (HTTP) / ce_ (Kafka) header becomes an extension attribute "
                    "only when the rest of its name is 1 to 20 lower-case letters or digits "
                    "and not an attribute the relay sets; such headers are not sent (logged "
                    "once per destination)"
                ),
            )
        return None

    # --- HTTP -----------------------------------------------------------------------------

    def http(self, env: Envelope, headers: dict[str, str]) -> bytes:
        """The request body for ``env``; sets the CloudEvents headers in ``headers`` (binary:
        the attributes; structured: the content type). Raises NotSendable."""
        kind = self.type_of(env)
        if self.structured:
            headers["content-type"] = STRUCTURED_CONTENT_TYPE
            return self.document(env, kind)
        headers.update(self.http_fixed)
        headers["ce-id"] = str(env.id)
        encoded = self._http_types.get(kind)
        if encoded is None:
            if len(self._http_types) >= _CACHE_MAX:
                self._http_types.clear()
            encoded = self._http_types[kind] = http_header_value(kind)
        headers["ce-type"] = encoded
        headers["ce-time"] = rfc3339(env.created_at)
        return env.payload

    # --- Kafka ----------------------------------------------------------------------------

    def kafka(self, env: Envelope, headers: list[tuple[str, bytes]]) -> bytes:
        """The message value for ``env``; appends the CloudEvents headers to ``headers``
        (binary: the attributes; structured: none, the caller sets the content type).
        Raises NotSendable."""
        kind = self.type_of(env)
        if self.structured:
            return self.document(env, kind)
        headers.extend(self.kafka_fixed)
        headers.append(("ce_id", str(env.id).encode()))
        headers.append(("ce_type", kind.encode()))
        headers.append(("ce_time", rfc3339(env.created_at).encode()))
        return env.payload

    # --- the JSON event format ------------------------------------------------------------

    def document(self, env: Envelope, kind: str) -> bytes:
        """``env`` as one JSON CloudEvent (structured mode). A JSON payload is embedded as
        ``data`` byte for byte, after checking it is JSON; any other as ``data_base64``."""
        type_json = self._type_json.get(kind)
        if type_json is None:
            if len(self._type_json) >= _CACHE_MAX:
                self._type_json.clear()
            type_json = self._type_json[kind] = json.dumps(kind).encode()
        ct = env.content_type
        cached = self._ct_json.get(ct)
        if cached is None:
            if len(self._ct_json) >= _CACHE_MAX:
                self._ct_json.clear()
            cached = self._ct_json[ct] = (json.dumps(ct).encode(), is_json(ct))
        ct_json, as_json = cached
        if as_json:
            _check_json(env)
            data = b',"data":' + env.payload
        else:
            data = b',"data_base64":"' + base64.b64encode(env.payload) + b'"'
        return b"".join(
            (
                self._head,  # {"specversion":"1.0","source":…,"id":"
                str(env.id).encode(),
                b'","type":',
                type_json,
                b',"time":"',
                rfc3339(env.created_at).encode(),
                b'","datacontenttype":',
                ct_json,
                data,
                b"}",
            )
        )


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _check_json(env: Envelope) -> None:
    try:
        json.loads(env.payload.decode("utf-8"), parse_constant=_reject_constant)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise NotSendable(
            f"row {env.id}'s payload is not UTF-8 JSON although its content type is "
            f"{env.content_type!r}, and a structured CloudEvent holds such data as JSON "
            f"({type(exc).__name__}: {exc}); fix the row's payload or content_type, then run "
            f"outbox-relay retry --id {env.id}"
        ) from None


def attribute_problem(attr: str, value: str) -> str | None:
    """Why a row's header cannot carry the attribute ``attr`` (lower-case, its prefix
    removed) with ``value`` in binary mode, or None."""
    if attr in ATTRIBUTES:
        return f"{attr!r} is an attribute the relay sets"
    if attr == "datacontenttype":
        return "datacontenttype is the row's content type (the content-type header)"
    if attr == "data":
        return "'data' is reserved by the specification"
    if not ATTRIBUTE_NAME.fullmatch(attr):
        return (
            f"{attr[:40]!r} is not a CloudEvents attribute name (1 to 20 lower-case letters "
            "or digits)"
        )
    if attr in _NOT_EMPTY and not value:
        return f"{attr} must not be empty"
    return None


class EnvelopeSettings(Protocol):
    """What a destination's settings say of its envelope (fields of
    relay.config.base.DestinationSettings, read here without importing the settings, which
    check attributes with this module)."""

    @property
    def envelope(self) -> Literal["none", "cloudevents"]: ...
    @property
    def source(self) -> str | None: ...
    @property
    def cloudevents_mode(self) -> Literal["binary", "structured"]: ...
    @property
    def default_type(self) -> str | None: ...


def from_config(d: EnvelopeSettings) -> CloudEvents | None:
    """A destination's envelope from its settings; None when it sends payloads as they are."""
    if d.envelope != "cloudevents":
        return None
    if d.source is None:  # the settings refuse this; a model built with model_construct may not
        raise ValueError('source is required with envelope = "cloudevents"')
    return CloudEvents(d.source, d.cloudevents_mode, d.default_type)
