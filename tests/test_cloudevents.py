"""CloudEvents settings (envelope, source, cloudevents_mode, default_type) and the envelope's
pure rules: what the configuration refuses, with the key named, and what a row becomes.
Delivery through real brokers and receivers: test_cloudevents_kafka.py and
test_cloudevents_webhook.py."""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from relay.cloudevents import CloudEvents, NotSendable, is_json, rfc3339, source_problem
from relay.config import ConfigError
from relay.settings import load_settings
from tests.webhook_helpers import envelope, new_secret

DB = "postgresql://x@127.0.0.1/y"
CE = {"envelope": "cloudevents", "source": "/orders-service"}


def kinds() -> list[dict[str, Any]]:
    return [
        {"kind": "kafka", "topic": "orders"},
        {"kind": "webhook", "url": "https://example.com/in", "secrets": [new_secret()]},
        {"kind": "endpoints"},
    ]


def load(dest: dict[str, Any]) -> Any:
    return load_settings(database_url=DB, destinations={"d": dest}).destinations["d"]


def refused(dest: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as err:
        load(dest)
    return str(err.value)


@pytest.mark.parametrize("base", kinds(), ids=lambda b: b["kind"])
def test_every_kind_takes_the_envelope_settings(base: dict[str, Any]) -> None:
    d = load({**base, **CE, "cloudevents_mode": "structured", "default_type": "order.changed"})
    assert (d.envelope, d.source, d.cloudevents_mode, d.default_type) == (
        "cloudevents",
        "/orders-service",
        "structured",
        "order.changed",
    )
    plain = load(base)
    assert (plain.envelope, plain.source, plain.cloudevents_mode, plain.default_type) == (
        "none",
        None,
        "binary",
        None,
    )


@pytest.mark.parametrize("base", kinds(), ids=lambda b: b["kind"])
@pytest.mark.parametrize(
    ("extra", "key", "words"),
    [
        ({"envelope": "cloudevents"}, "source", 'required with envelope = "cloudevents"'),
        ({"source": "/orders"}, "source", 'add envelope = "cloudevents"'),
        ({"cloudevents_mode": "structured"}, "cloudevents_mode", "or remove cloudevents_mode"),
        ({"default_type": "a.b"}, "default_type", "or remove default_type"),
        ({**CE, "cloudevents_mode": "json"}, "cloudevents_mode", "'binary' or 'structured'"),
        ({**CE, "default_type": ""}, "default_type", "is empty"),
        ({**CE, "default_type": "a\nb"}, "default_type", "control character"),
        ({"envelope": "cloudevent", "source": "/x"}, "envelope", "'none' or 'cloudevents'"),
        ({**CE, "source": "/orders service"}, "source", "percent-encode it"),
        ({**CE, "source": ""}, "source", "is empty"),
    ],
)
def test_bad_envelope_settings_name_the_key_and_the_fix(
    base: dict[str, Any], extra: dict[str, Any], key: str, words: str
) -> None:
    text = refused({**base, **extra})
    assert f"destinations.d.{base['kind']}.{key}" in text, text
    assert words in text, text


@pytest.mark.parametrize(
    "source",
    [
        # The CloudEvents specification's own examples, and other forms of URI-reference.
        "https://github.com/cloudevents",
        "mailto:cncf-wg-serverless@lists.cncf.io",
        "urn:uuid:6e8bc430-9c3a-11d9-9669-0800200c9a66",
        "cloudevents/spec/pull/123",
        "/sensors/tn-1234567/alerts",
        "1-555-123-4567",
        "//shop.example/orders",
        "https://[2001:db8::1]:8443/orders?region=eu#main",
        "/orders%20service",
        "./1a:b",
    ],
)
def test_uri_references_are_valid_sources(source: str) -> None:
    assert source_problem(source) is None


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("", "empty"),
        ("/orders service", "a space"),
        ("/ordérs", "percent-encode"),
        ("/a\tb", "percent-encode"),
        ("1a:b", "not a URI scheme"),
        ("/a%zz", "%-escape"),
        ("/a|b", "path"),
        ("/a?b{c}", "query"),
        ("/a#b#c", "fragment"),
        ("https://[::1/x", "authority"),
        ("/" + "a" * 2048, "longer than"),
    ],
)
def test_what_is_not_a_uri_reference_is_refused_with_the_reason(source: str, words: str) -> None:
    problem = source_problem(source)
    assert problem is not None and words in problem, problem


def test_webhook_headers_cannot_replace_the_attributes() -> None:
    hook = kinds()[1]
    text = refused({**hook, **CE, "headers": {"CE-Type": "x"}})
    assert "destinations.d.webhook.headers" in text and "remove it from headers" in text
    # Other ce- headers are extension attributes in binary mode; in structured mode none is
    # sent (it would make receivers read the request as binary).
    assert load({**hook, **CE, "headers": {"ce-dataschema": "https://x/s"}}).headers
    text = refused({**hook, **CE, "cloudevents_mode": "structured", "headers": {"ce-x": "1"}})
    assert 'cloudevents_mode = "binary"' in text
    # Without the envelope a ce- header is the user's own.
    assert load({**hook, "headers": {"ce-type": "x"}}).headers == {"ce-type": "x"}


# --- what a row becomes ---------------------------------------------------------------------


def row(**kw: Any) -> Any:
    event_type = kw.pop("event_type", "order.created")
    return replace(envelope(**kw), event_type=event_type)


def test_binary_attributes_for_http_and_kafka() -> None:
    ce = CloudEvents("/orders-service")
    env = row(id=42)
    headers: dict[str, str] = {}
    assert ce.http(env, headers) is env.payload
    assert headers == {
        "ce-id": "42",
        "ce-source": "/orders-service",
        "ce-type": "order.created",
        "ce-specversion": "1.0",
        "ce-time": rfc3339(env.created_at),
    }
    kafka: list[tuple[str, bytes]] = []
    assert ce.kafka(env, kafka) is env.payload
    assert dict(kafka) == {k.replace("-", "_"): v.encode() for k, v in headers.items()}


def test_http_header_values_are_percent_encoded_as_the_binding_says() -> None:
    # Printable ASCII but space, '"' and '%' goes as it is; everything else %-encoded (UTF-8).
    ce = CloudEvents("/a%2Fb")
    headers: dict[str, str] = {}
    ce.http(row(event_type='commande créée "100%"'), headers)
    assert headers["ce-type"] == "commande%20cr%C3%A9%C3%A9e%20%22100%25%22"
    assert headers["ce-source"] == "/a%252Fb"
    kafka: list[tuple[str, bytes]] = []  # Kafka headers are bytes: UTF-8, not %-encoded
    ce.kafka(row(event_type="créée"), kafka)
    assert dict(kafka)["ce_type"] == "créée".encode()


def test_time_is_rfc3339() -> None:
    t = datetime(2026, 11, 30, 12, 0, 5, 120, tzinfo=UTC)
    assert rfc3339(t) == "2026-11-30T12:00:05.000120Z"
    assert rfc3339(t.replace(tzinfo=None)) == "2026-11-30T12:00:05.000120Z"
    plus2 = t.astimezone(timezone(timedelta(hours=2)))
    assert rfc3339(plus2) == "2026-11-30T14:00:05.000120+02:00"


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        ("application/json", True),
        ("application/json; charset=utf-8", True),
        ("application/vnd.shop.order+json", True),
        ("text/json", True),
        ("APPLICATION/JSON", True),
        ("application/octet-stream", False),
        ("text/plain", False),
        ("application/jsonl", False),
    ],
)
def test_which_content_types_are_held_as_json(content_type: str, expected: bool) -> None:
    assert is_json(content_type) is expected


def test_structured_document_embeds_json_bytes_and_base64_the_rest() -> None:
    ce = CloudEvents("/orders-service", "structured")
    payload = b'{ "n": 1,\n  "s": "\\u00e9" }'  # kept byte for byte, not re-encoded
    env = row(id=7, payload=payload)
    headers: dict[str, str] = {}
    body = ce.http(env, headers)
    assert headers == {"content-type": "application/cloudevents+json"}
    doc = json.loads(body)
    assert doc == {
        "specversion": "1.0",
        "id": "7",
        "source": "/orders-service",
        "type": "order.created",
        "time": rfc3339(env.created_at),
        "datacontenttype": "application/json",
        "data": {"n": 1, "s": "é"},
    }
    assert payload in body
    raw = bytes(range(256))
    doc = json.loads(ce.document(row(payload=raw, content_type="text/plain"), "t"))
    assert "data" not in doc and base64.b64decode(doc["data_base64"]) == raw
    assert doc["datacontenttype"] == "text/plain" and doc["type"] == "t"


@pytest.mark.parametrize("payload", [b"{nope", b"\xff{}", b"NaN", b"\xef\xbb\xbf{}", b""])
def test_a_json_row_that_is_not_json_is_not_sendable(payload: bytes) -> None:
    ce = CloudEvents("/s", "structured")
    with pytest.raises(NotSendable, match="not UTF-8 JSON although its content type"):
        ce.http(row(payload=payload), {})


def test_the_type_comes_from_the_row_then_the_default_and_is_never_made_up() -> None:
    with_default = CloudEvents("/s", "binary", "order.changed")
    assert with_default.type_of(row(event_type="order.paid")) == "order.paid"
    assert with_default.type_of(row(event_type=None)) == "order.changed"
    strict = CloudEvents("/s", "structured")
    env = row(id=99, event_type=None)
    for call in (lambda: strict.http(env, {}), lambda: strict.kafka(env, [])):
        with pytest.raises(NotSendable) as err:
            call()
        text = str(err.value)
        assert "row 99 has no event_type" in text
        assert "default_type" in text and "retry --id 99" in text


# --- a row's own ce- / ce_ headers: extension attributes, only valid ones ------------------

# Row headers a reader of binary mode would take as attributes: the valid extensions survive
# (lower-cased names), the rest would make the SDK refuse the whole event and are dropped.
ROW_CE = {
    "Trace-ID": None,  # not [a-z0-9]
    "my_ext": None,
    "Channel": "web",  # names are case-insensitive: the extension "channel"
    "tenant": '100% done é "q"  ',  # %-encoded on HTTP, and read back exactly
    "a" * 20: "longest",
    "a" * 21: None,  # longer than 20
    "type": None,  # attributes the relay sets
    "ID": None,
    "datacontenttype": None,  # would contradict content-type
    "data": None,  # reserved
    "": None,
    "subject": "",  # must not be empty when present
    "dataschema": "https://shop.example/schemas/order",
}
KEPT = {name.lower(): v for name, v in ROW_CE.items() if v}


def ce_row_headers(prefix: str) -> dict[str, str]:
    return {prefix + name: v if v is not None else "x" for name, v in ROW_CE.items()} | {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    }


def check_extensions(core: Any) -> None:
    attributes = core.get_attributes()
    for name, value in KEPT.items():
        got = core.get_dataschema() if name == "dataschema" else core.get_extension(name)
        assert got == value, name
    assert core.get_type() == "order.created" and core.get_datacontenttype() == "application/json"
    assert core.get_subject() is None
    core_names = {"id", "source", "type", "specversion", "time", "datacontenttype"}
    assert set(attributes) - core_names == set(KEPT)


def test_kafka_binary_sends_only_valid_row_extensions() -> None:
    from cloudevents.core.bindings import kafka as core_kafka
    from cloudevents.core.formats.json import JSONFormat
    from structlog.testing import capture_logs

    from relay.sinks.kafka.sink import KafkaSink

    ce = CloudEvents("/orders-service")
    env = row(id=5, headers=ce_row_headers("ce_") | {"ce_channel": "app"})
    with capture_logs() as logs:
        value, headers = KafkaSink._message(env, ce)
        KafkaSink._message(row(headers={"ce_Bad-Name": "x"}), ce)  # logged once only
    names = [k for k, _ in headers]
    assert len(names) == len(set(names))  # ce_Channel and ce_channel: the first
    sent = dict(headers)
    assert sent["ce_channel"] == b"web" and sent["traceparent"]
    assert not [k for k in names if k.startswith("ce_") and k != k.lower()]
    core = core_kafka.from_binary(core_kafka.KafkaMessage(sent, None, value), JSONFormat())
    check_extensions(core)
    assert core.get_id() == "5"
    [warning] = [e for e in logs if e["event"] == "relay.cloudevents.header_dropped"]
    assert warning["log_level"] == "warning" and warning["row"] == 5
    assert warning["destination"] == env.destination and "reason" in warning

    structured = CloudEvents("/s", "structured")
    _, plain = KafkaSink._message(row(headers=ce_row_headers("ce_")), structured)
    assert not [k for k, _ in plain if k.lower().startswith("ce_")]


def test_http_binary_sends_only_valid_row_extensions_percent_encoded() -> None:
    from cloudevents.core.bindings import http as core_http
    from cloudevents.core.formats.json import JSONFormat

    from relay.sinks.webhook.config import WebhookClientSettings, WebhookDestination
    from relay.sinks.webhook.sink import WebhookSink

    for mode in ("binary", "structured"):
        d = WebhookDestination(
            kind="webhook",
            url="https://example.com/in",
            secrets=[new_secret()],
            envelope="cloudevents",
            source="/orders-service",
            cloudevents_mode=mode,  # type: ignore[arg-type]
        )
        sink = WebhookSink(WebhookClientSettings(), {"hook": d})
        ep = sink.endpoints["hook"]
        assert ep.cloudevents is not None
        env = row(id=6, headers=ce_row_headers("ce-"))
        headers = sink.requests.headers(ep, env)
        assert isinstance(headers, dict), headers
        body = ep.cloudevents.http(env, headers)
        if mode == "structured":
            assert not [k for k in headers if k.startswith("ce-")]
            continue
        assert headers["ce-tenant"] == "100%25%20done%20%C3%A9%20%22q%22%20%20"
        assert "ce-trace-id" not in headers and "ce-my_ext" not in headers
        core = core_http.from_http(core_http.HTTPMessage(headers, body), JSONFormat())
        check_extensions(core)
        assert core.get_id() == "6"


@pytest.mark.parametrize(
    ("header", "value", "kept"),
    [
        ("ce-tenant", "acme", "tenant"),
        ("CE-Tenant", "acme", "tenant"),
        ("ce_x1", "", "x1"),  # an extension may be empty
        ("ce-" + "z" * 20, "v", "z" * 20),
        ("ce-" + "z" * 21, "v", None),
        ("ce-trace_id", "v", None),
        ("ce-trace-id", "v", None),
        ("ce-tenänt", "v", None),
        ("ce-", "v", None),
        ("ce_time", "2020-01-01T00:00:00Z", None),
        ("ce-specversion", "1.0", None),
        ("ce-source", "/x", None),
        ("ce-datacontenttype", "text/plain", None),
        ("ce-data", "v", None),
        ("ce-subject", "", None),
        ("ce-subject", "order 1", "subject"),
    ],
)
def test_which_row_headers_are_attributes(header: str, value: str, kept: str | None) -> None:
    env = row()
    assert CloudEvents("/s").row_attribute(env, header, value) == kept
    assert CloudEvents("/s", "structured").row_attribute(env, header, value) is None
