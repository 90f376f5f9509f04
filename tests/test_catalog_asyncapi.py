"""The AsyncAPI document of a catalog (relay/catalog/asyncapi.py): each kind of destination
with each envelope mapped as docs/design/event-catalog.md §5 says, headers that are exactly
what the sinks send (checked against the sinks' own output), keys escaped injectively, the
same bytes for the same input, nothing secret in it, and what the AsyncAPI parser does not
check (tests/test_asyncapi_parser.py runs the parser): draft-07 keywords only, every
``$ref`` resolving inside the document. No database."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from jsonschema import Draft7Validator
from referencing import Registry
from referencing.jsonschema import DRAFT7

from outbox.webhooks.signing import decode_secret
from relay import cloudevents
from relay.catalog import build, render
from relay.catalog import headers as catalog_headers
from relay.catalog.names import escape, rewrite
from relay.config.settings import Settings
from relay.model import Envelope, Lease
from relay.settings import settings_secrets
from relay.sinks.kafka import sink as kafka_sink
from relay.sinks.webhook.config import WebhookClientSettings
from relay.sinks.webhook.requests import RequestPath
from tests.support.catalog_docs import (
    CONFIGS,
    DB_PASSWORD,
    DB_URL,
    EVERYTHING,
    HEADER_VALUE,
    KAFKA_ONLY,
    SASL_PASSWORD,
    SASL_USER,
    URL_TOKEN,
    WEBHOOK_PATH,
    WEBHOOK_SECRET,
    catalog,
    clashing_catalog,
    settings,
)

KEY = re.compile(r"^[A-Za-z0-9.\-_]+$")
SOURCE = "/shop/orders"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
ORDER = {"order_id": 7, "currency": "USD", "lines": [{"sku": "B-2", "quantity": 1}]}

# Draft-07's keywords (its meta-schema's, and writeOnly, which the specification defines beside
# readOnly), and those AsyncAPI's Schema Object adds (x- extensions aside).
DRAFT7_KEYWORDS = frozenset(Draft7Validator.META_SCHEMA["properties"]) | {"writeOnly"}
ASYNCAPI_KEYWORDS = frozenset(("discriminator", "externalDocs", "deprecated"))
# Keywords whose value is one schema.
SUBSCHEMA = frozenset(
    (
        "items",
        "additionalItems",
        "additionalProperties",
        "contains",
        "propertyNames",
        "if",
        "then",
        "else",
        "not",
    )
)


@pytest.fixture(scope="module")
def relay_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return settings(tmp_path_factory.mktemp("everything"), EVERYTHING)


@pytest.fixture(scope="module")
def doc(relay_settings: Settings) -> dict[str, Any]:
    return build(catalog(), relay_settings)


def validator(document: dict[str, Any], pointer: str) -> Draft7Validator:
    """A draft-07 validator of the schema at ``pointer`` in ``document``, its references
    resolved inside the document (formats checked)."""
    registry: Registry[Any] = Registry().with_resource("urn:doc", DRAFT7.create_resource(document))
    return Draft7Validator(
        {"$ref": f"urn:doc#{pointer}"},
        registry=registry,
        format_checker=Draft7Validator.FORMAT_CHECKER,
    )


def envelope(destination: str, **fields: Any) -> Envelope:
    defaults: dict[str, Any] = {
        "id": 42,
        "destination": destination,
        "key": "7",
        "payload": json.dumps(ORDER).encode(),
        "content_type": "application/json",
        "headers": {"traceparent": TRACEPARENT, "x-row-header": "kept"},
        "attempts": 0,
        "created": time.time(),
        "token": 1,
        "lease": Lease(time.monotonic() + 3600),
        "event_type": "order.created",
    }
    return Envelope(**{**defaults, **fields})


# --- each kind and envelope ---------------------------------------------------------------


@pytest.mark.parametrize("envelope_kind", ["none", "binary", "structured"])
def test_a_kafka_destination_is_a_topic_channel(doc: dict[str, Any], envelope_kind: str) -> None:
    name = f"kafka-{envelope_kind}"
    channel = doc["channels"][name]
    assert channel["address"] == f"topic.{name}" and channel["title"] == name
    assert channel["servers"] == [{"$ref": "#/servers/kafka"}]
    assert channel["bindings"] == {"kafka": {"topic": f"topic.{name}", "bindingVersion": "0.5.0"}}
    assert ('ordering = "key"' in channel["description"]) == (envelope_kind == "none")
    message = channel["messages"]["order.created"]
    headers = message["headers"]
    required = {"outbox-id", "content-type"}
    if envelope_kind == "binary":
        required |= {"ce_id", "ce_source", "ce_type", "ce_specversion", "ce_time"}
        assert headers["properties"]["ce_type"]["const"] == "order.created"
        assert headers["properties"]["ce_source"]["const"] == SOURCE
        assert headers["properties"]["ce_specversion"]["const"] == "1.0"
    assert set(headers["required"]) == required
    assert headers["additionalProperties"] == {"type": "string"}
    assert {"traceparent", "tracestate"} <= set(headers["properties"])
    ref = {"$ref": "#/components/schemas/order.created"}
    if envelope_kind == "structured":
        assert message["contentType"] == "application/cloudevents+json"
        assert headers["properties"]["content-type"]["const"] == "application/cloudevents+json"
        assert message["payload"]["properties"]["data"] == ref
        assert message["payload"]["properties"]["source"]["const"] == SOURCE
    else:
        assert message["contentType"] == "application/json" and message["payload"] == ref
    key = message["bindings"]["kafka"]["key"]
    assert key == {"type": "string", "maxLength": 1024, "description": "the order id"}
    assert "security" not in doc["operations"][f"send-{name}"]


@pytest.mark.parametrize("kind", ["webhook", "endpoints"])
@pytest.mark.parametrize("envelope_kind", ["none", "binary", "structured"])
def test_a_webhook_or_endpoints_destination_is_a_signed_post(
    doc: dict[str, Any], kind: str, envelope_kind: str
) -> None:
    name = f"{kind}-{envelope_kind}"
    channel = doc["channels"][name]
    assert channel["address"] is None
    if kind == "webhook":
        assert channel["servers"] == [{"$ref": f"#/servers/webhook-{name}"}]
        server = doc["servers"][f"webhook-{name}"]
        assert (server["host"], server["protocol"]) == ("hooks.example.com:8443", "https")
        assert server["security"] == [{"$ref": "#/components/securitySchemes/standardWebhooks"}]
    else:
        assert "servers" not in channel  # addresses registered at runtime
        assert "generated at runtime" in channel["description"]
    operation = doc["operations"][f"send-{name}"]
    assert operation["bindings"] == {"http": {"method": "POST", "bindingVersion": "0.3.0"}}
    assert operation["security"] == [{"$ref": "#/components/securitySchemes/standardWebhooks"}]
    message = channel["messages"]["order.created"]
    assert "bindings" not in message  # no key travels over HTTP
    headers = message["headers"]
    required = {"webhook-id", "webhook-timestamp", "webhook-signature", "content-type"}
    required |= {"user-agent", "accept-encoding"}
    required |= {"authorization", "x-team"} if kind == "webhook" else {"x-api-key"}
    if envelope_kind == "binary":
        required |= {"ce-id", "ce-source", "ce-type", "ce-specversion", "ce-time"}
    assert set(headers["required"]) == required
    configured = "authorization" if kind == "webhook" else "x-api-key"
    assert headers["properties"][configured] == {
        "type": "string",
        "description": "set by the operator",
    }
    # [webhooks] id_prefix = "billing.v1:": the prefix's "." matches itself only.
    pattern = re.compile(headers["properties"]["webhook-id"]["pattern"])
    assert pattern.match("billing.v1:42") and not pattern.match("42")
    assert not pattern.match("billingXv1:42")


def test_the_standard_webhooks_scheme(doc: dict[str, Any]) -> None:
    scheme = doc["components"]["securitySchemes"]["standardWebhooks"]
    assert (scheme["type"], scheme["in"], scheme["name"]) == (
        "httpApiKey",
        "header",
        "webhook-signature",
    )
    assert scheme["x-standard-webhooks"] == {"version": "v1"}
    assert "HMAC-SHA256" in scheme["description"] and "whsec_" in scheme["description"]


def test_the_kafka_server_names_the_first_bootstrap_server_and_its_sasl_scheme(
    doc: dict[str, Any], relay_settings: Settings, tmp_path: Path
) -> None:
    server = doc["servers"]["kafka"]
    assert (server["host"], server["protocol"]) == ("kafka-1.internal:9093", "kafka-secure")
    assert server["security"] == [{"$ref": "#/components/securitySchemes/kafka"}]
    assert doc["components"]["securitySchemes"]["kafka"]["type"] == "scramSha512"
    chosen = build(catalog(), relay_settings, kafka_host="kafka.example.com:9092")
    assert chosen["servers"]["kafka"]["host"] == "kafka.example.com:9092"
    assert "kafka-1.internal" not in render(chosen)
    plain = build(catalog(), settings(tmp_path, KAFKA_ONLY))
    assert plain["servers"] == {
        "kafka": {
            "host": "localhost:9092",
            "protocol": "kafka",
            "description": "The Kafka cluster (security protocol PLAINTEXT).",
        }
    }
    assert "securitySchemes" not in plain["components"]


def test_a_webhook_path_only_with_webhook_paths(relay_settings: Settings) -> None:
    hidden = render(build(catalog(), relay_settings))
    assert WEBHOOK_PATH not in hidden
    shown = build(catalog(), relay_settings, webhook_paths=True)
    assert shown["channels"]["webhook-none"]["address"] == WEBHOOK_PATH
    assert shown["channels"]["endpoints-none"]["address"] is None
    assert URL_TOKEN not in render(shown)


def test_a_channel_of_several_types_without_the_envelope_says_so(doc: dict[str, Any]) -> None:
    warning = "cannot tell the types apart from the headers"
    many = doc["channels"]["kafka-none"]["description"]
    assert warning in many and 'envelope = "cloudevents"' in many
    assert "customer.deleted, facture payée, invoice_paid, order.created" in many
    assert warning in doc["channels"]["webhook-none"]["description"]
    for enveloped in ("webhook-binary", "endpoints-structured"):  # two types, with envelope
        assert warning not in doc["channels"][enveloped]["description"]
    assert warning not in doc["channels"]["endpoints-none"]["description"]  # one type


def test_operations_send_their_own_channels_messages(doc: dict[str, Any]) -> None:
    assert set(doc["operations"]) == {f"send-{c}" for c in doc["channels"]}
    for key, channel in doc["channels"].items():
        operation = doc["operations"][f"send-{key}"]
        assert operation["action"] == "send"
        assert operation["channel"] == {"$ref": f"#/channels/{key}"}
        assert operation["messages"] == [
            {"$ref": f"#/channels/{key}/messages/{m}"} for m in sorted(channel["messages"])
        ]
    assert doc["channels"]["unused"]["messages"] == {}
    assert doc["operations"]["send-unused"]["messages"] == []


def test_a_message_per_type_and_destination(doc: dict[str, Any]) -> None:
    declared: dict[str, set[str]] = {c: set() for c in doc["channels"]}
    for t in catalog()["types"]:
        for d in t["destinations"]:
            if escape(d) in declared:
                declared[escape(d)].add(escape(t["name"]))
    assert {c: set(ch["messages"]) for c, ch in doc["channels"].items()} == declared
    assert "nowhere" not in doc["channels"] and "orders" not in doc["channels"]
    message = doc["channels"]["kafka-none"]["messages"]["order.created"]
    assert (message["name"], message["title"]) == ("order.created", "order.created")
    assert message["x-outbox-event-type"] == "order.created" and message["x-outbox-version"] == 3
    assert message["summary"] == "An order was placed."
    assert message["description"].endswith("as the customer saw them.")
    assert "deprecated" not in message
    deleted = doc["channels"]["kafka-none"]["messages"]["customer.deleted"]
    assert deleted["deprecated"] is True
    assert deleted["bindings"]["kafka"]["key"]["type"] == ["string", "null"]
    invoice = doc["channels"]["kafka-none"]["messages"]["invoice__paid"]
    assert invoice["contentType"] == "application/vnd.shop.invoice+json"


# --- what the sinks send ----------------------------------------------------------------


@pytest.mark.parametrize("envelope_kind", ["none", "binary", "structured"])
def test_the_headers_and_value_the_kafka_sink_sends_fit_the_message(
    doc: dict[str, Any], relay_settings: Settings, envelope_kind: str
) -> None:
    name = f"kafka-{envelope_kind}"
    env = envelope(name)
    ce = cloudevents.from_config(relay_settings.destinations[name])
    value, headers = kafka_sink.KafkaSink._message(env, ce)
    sent = {k: v.decode() for k, v in headers}
    at = f"/channels/{name}/messages/order.created"
    validator(doc, f"{at}/headers").validate(sent)
    validator(doc, f"{at}/payload").validate(json.loads(value))
    # The schema has teeth: without the row id, or with another type, the headers fail.
    assert not validator(doc, f"{at}/headers").is_valid(
        {k: v for k, v in sent.items() if k != "outbox-id"}
    )
    if envelope_kind == "binary":
        assert not validator(doc, f"{at}/headers").is_valid({**sent, "ce_type": "other"})


@pytest.mark.parametrize("kind", ["webhook", "endpoints"])
@pytest.mark.parametrize("envelope_kind", ["none", "binary", "structured"])
def test_the_request_a_webhook_or_endpoint_gets_fits_the_message(
    doc: dict[str, Any], relay_settings: Settings, kind: str, envelope_kind: str
) -> None:
    name = f"{kind}-{envelope_kind}"
    d = relay_settings.destinations[name]
    http = relay_settings.section("webhooks")
    assert isinstance(http, WebhookClientSettings)
    url = getattr(d, "url", "https://endpoint.example.com/registered")
    path = RequestPath(http)
    target = path.target(name, d, url, [decode_secret(WEBHOOK_SECRET)])  # type: ignore[arg-type]
    request = path._request(target, envelope(name))
    assert isinstance(request, tuple)
    sent, body = request
    at = f"/channels/{name}/messages/order.created"
    validator(doc, f"{at}/headers").validate(sent)
    validator(doc, f"{at}/payload").validate(json.loads(body))
    assert sent["webhook-id"] == "billing.v1:42"
    assert not validator(doc, f"{at}/headers").is_valid({**sent, "webhook-id": "42"})


def test_the_kafka_header_names_are_the_sinks() -> None:
    assert catalog_headers.OUTBOX_ID == kafka_sink.OUTBOX_ID
    assert catalog_headers.CONTENT_TYPE == kafka_sink.CONTENT_TYPE


def test_every_example_fits_its_message(doc: dict[str, Any]) -> None:
    checked = 0
    for key, channel in doc["channels"].items():
        for m, message in channel["messages"].items():
            for example in message.get("examples", []):
                validator(doc, f"/channels/{key}/messages/{m}/payload").validate(example["payload"])
                checked += 1
    assert checked >= 10
    structured = doc["channels"]["kafka-structured"]["messages"]["order.created"]["examples"][0]
    assert structured["payload"]["data"] == catalog()["types"][3]["examples"][0]


# --- keys ---------------------------------------------------------------------------------


def unescape(key: str) -> str:
    """escape's inverse: that it exists is what makes escape injective."""
    if key == "_":
        return ""
    out, i = bytearray(), 0
    while i < len(key):
        if key[i] != "_":
            out += key[i].encode()
            i += 1
        elif key[i + 1] == "_":
            out += b"_"
            i += 2
        else:
            assert key[i + 1] == "x", key
            lead = int(key[i + 2 : i + 4], 16)
            size = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            out += bytes.fromhex(key[i + 2 : i + 2 + 2 * size])
            i += 2 + 2 * size
    return out.decode("utf-8", "surrogatepass")


@given(st.text())
def test_escaping_is_a_valid_key_and_reads_back(name: str) -> None:
    key = escape(name)
    assert KEY.match(key)
    assert unescape(key) == name


def test_names_that_look_alike_get_different_keys() -> None:
    names = ["a_b", "a.b", "a-b", "a b", "a_x20b", "a__b", "", "_", "__", "x", "_x", "é", "e\u0301"]
    names += ["commande créée", "order.created", "Order.Created", "\x00", "\U0001f600"]
    assert len({escape(n) for n in names}) == len(names)
    assert escape("commande créée") == "commande_x20cr_xc3a9_xc3a9e"
    assert escape("order.created") == "order.created" and escape("invoice_paid") == "invoice__paid"


def test_every_key_of_the_document_is_escaped(doc: dict[str, Any]) -> None:
    keys = [*doc["channels"], *doc["operations"], *doc["servers"]]
    keys += [k for section in doc["components"].values() for k in section]
    keys += [m for channel in doc["channels"].values() for m in channel["messages"]]
    bad = [k for k in keys if not KEY.match(k)]
    assert not bad
    assert doc["channels"]["commande_x20cr_xc3a9_xc3a9e"]["title"] == "commande créée"
    facture = doc["channels"]["kafka-none"]["messages"]["facture_x20pay_xc3a9e"]
    assert facture["name"] == "facture payée"


def test_a_definition_never_shares_a_key_with_a_type(tmp_path: Path) -> None:
    document = build(clashing_catalog(), settings(tmp_path, KAFKA_ONLY))
    schemas = document["components"]["schemas"]
    assert set(schemas) == {"order", "order.Line", "order_.Line"}
    assert schemas["order.Line"] == {"type": "integer", "description": "a type"}
    line = schemas["order"]["properties"]["line"]
    assert line == {"$ref": "#/components/schemas/order_.Line"}
    assert schemas["order_.Line"]["description"] == "order's Line"
    # Without the clash, a definition is <type>.<Def>.
    plain = build(catalog(), settings(tmp_path, KAFKA_ONLY))["components"]["schemas"]
    assert {"order.created.Line", "order.created.Note"} <= set(plain)
    assert plain["order.created"]["properties"]["lines"]["items"] == {
        "$ref": "#/components/schemas/order.created.Line"
    }
    assert plain["order.created"]["properties"]["replaces"]["anyOf"][0] == {
        "$ref": "#/components/schemas/order.created"
    }


def test_a_reference_outside_the_schema_is_refused(tmp_path: Path) -> None:
    remote = catalog()
    remote["types"][0]["portable"] = {"$ref": "https://schemas.example.com/order.json"}
    with pytest.raises(ValueError, match=r"customer\.deleted"):
        build(remote, settings(tmp_path, KAFKA_ONLY))


def test_data_that_looks_like_a_reference_is_left_alone() -> None:
    schema = {
        "const": {"$ref": "#/definitions/Line"},
        "examples": [{"$ref": "#"}],
        "properties": {"$ref": {"type": "string"}, "x": {"$ref": "#/definitions/Line"}},
        "$id": "https://schemas.example.com/order.json",
    }
    out = rewrite(schema, lambda ref: "#/components/schemas/t." + ref.rpartition("/")[2])
    assert out == {
        "const": {"$ref": "#/definitions/Line"},
        "examples": [{"$ref": "#"}],
        "properties": {"$ref": {"type": "string"}, "x": {"$ref": "#/components/schemas/t.Line"}},
    }


# --- deterministic, and nothing secret -----------------------------------------------------


def test_the_same_input_gives_the_same_bytes(relay_settings: Settings, tmp_path: Path) -> None:
    first = render(build(catalog(), relay_settings))
    assert first == render(build(catalog(), relay_settings))
    shuffled = catalog()
    shuffled["types"] = [{k: t[k] for k in reversed(list(t))} for t in reversed(shuffled["types"])]
    assert render(build(shuffled, relay_settings)) == first
    assert first.endswith("}\n") and json.loads(first) == build(catalog(), relay_settings)
    assert (
        first == json.dumps(json.loads(first), sort_keys=True, indent=2, ensure_ascii=False) + "\n"
    )
    # Another process, other hash seeds: sets and dicts may not order it.
    config = tmp_path / "relay.toml"
    config.write_text(f'database_url = "{DB_URL}"\n{EVERYTHING}')
    script = (
        "import sys; from relay.settings import load_settings; from relay.catalog import build, "
        "render; from tests.support.catalog_docs import catalog; "
        "sys.stdout.write(render(build(catalog(), load_settings(sys.argv[1]))))"
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", script, str(config)],
            capture_output=True,
            env=env,
            timeout=60,
            cwd=Path(__file__).resolve().parents[1],
        )
        assert done.returncode == 0, done.stderr.decode()
        assert done.stdout.decode() == first


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_no_secret_header_value_or_database_url_in_the_document(
    config: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = settings(tmp_path, CONFIGS[config])
    never = {DB_URL, DB_PASSWORD, WEBHOOK_SECRET, WEBHOOK_SECRET[6:], HEADER_VALUE, URL_TOKEN}
    never |= {SASL_USER, SASL_PASSWORD, "token=", "127.0.0.1"} | settings_secrets(s)
    for paths in (False, True):
        text = render(build(catalog(), s, webhook_paths=paths))
        assert [n for n in never if n in text] == []
    # A secret read from the environment (secret_env) is no different.
    other = "whsec_" + "ZW52aXJvbm1lbnQtc2VjcmV0LW5ldmVyLXNob3du"
    monkeypatch.setenv("SHOP_HOOK_SECRET", other)
    body = '[destinations.hook]\nkind = "webhook"\nurl = "https://h.example.com/x"\n'
    text = render(build(catalog(), settings(tmp_path, body + 'secret_env = "SHOP_HOOK_SECRET"\n')))
    assert other not in text and other[6:] not in text


# --- what the parser does not check --------------------------------------------------------


def schemas_of(document: dict[str, Any]) -> dict[str, Any]:
    """Every schema of the document, by where it is."""
    found = {f"components.schemas.{k}": s for k, s in document["components"]["schemas"].items()}
    for key, channel in document["channels"].items():
        for m, message in channel["messages"].items():
            at = f"channels.{key}.messages.{m}"
            found[f"{at}.payload"] = message["payload"]
            found[f"{at}.headers"] = message["headers"]
            if "bindings" in message:
                found[f"{at}.key"] = message["bindings"]["kafka"]["key"]
    return found


def foreign_keywords(schema: Any, at: str) -> list[str]:
    """Keywords of ``schema`` and its subschemas that neither draft-07 nor AsyncAPI has."""
    if not isinstance(schema, dict):
        return []
    bad = [
        f"{at}: {k}"
        for k in schema
        if k not in DRAFT7_KEYWORDS | ASYNCAPI_KEYWORDS and not k.startswith("x-")
    ]
    subschemas: list[tuple[str, Any]] = []
    for k, v in schema.items():
        if k in ("properties", "patternProperties", "definitions", "dependencies"):
            subschemas += [(f"{k}.{n}", s) for n, s in v.items()]
        elif k in ("allOf", "anyOf", "oneOf") or (k == "items" and isinstance(v, list)):
            subschemas += [(f"{k}[{i}]", s) for i, s in enumerate(v)]
        elif k in SUBSCHEMA:
            subschemas.append((k, v))
    for where, sub in subschemas:
        bad += foreign_keywords(sub, f"{at}.{where}")
    return bad


def test_only_draft_07_and_asyncapi_keywords(doc: dict[str, Any], tmp_path: Path) -> None:
    clashing = build(clashing_catalog(), settings(tmp_path, KAFKA_ONLY))
    for document in (doc, clashing):
        found = schemas_of(document)
        assert len(found) > 20 or document is clashing
        bad = [b for at, s in found.items() for b in foreign_keywords(s, at)]
        assert bad == []
    # The walker sees what it must refuse.
    assert foreign_keywords({"properties": {"a": {"prefixItems": []}}}, "s") == [
        "s.properties.a: prefixItems"
    ]
    assert foreign_keywords({"$defs": {}}, "s") == ["s: $defs"]


def references(value: Any) -> list[str]:
    if isinstance(value, dict):
        own = [value["$ref"]] if isinstance(value.get("$ref"), str) else []
        return own + [r for v in value.values() for r in references(v)]
    if isinstance(value, list):
        return [r for v in value for r in references(v)]
    return []


def resolve(document: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = document
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, ref
        node = node[part]
    return node


def test_every_reference_resolves_inside_the_document(doc: dict[str, Any]) -> None:
    refs = references(doc)
    assert len(refs) > 50
    for ref in refs:
        resolve(doc, ref)
    with pytest.raises(AssertionError):
        resolve(doc, "#/components/schemas/order.created/$defs/Line")


def test_without_types_a_document_still_has_its_channels(relay_settings: Settings) -> None:
    empty = build({"format": "outbox-catalog/1", "types": []}, relay_settings)
    assert empty["info"]["title"] == "events" and empty["components"]["schemas"] == {}
    assert all(c["messages"] == {} for c in empty["channels"].values())
    assert set(empty["channels"]) == {escape(n) for n in relay_settings.destinations}
