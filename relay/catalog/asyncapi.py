"""The AsyncAPI 3.0.0 document of a catalog (its export, outbox.catalog) as the relay's
configuration delivers it: a server for the Kafka cluster and for each webhook destination's
origin, a channel per destination, an operation ``send-<channel>`` per channel, a message per
event type and destination (headers as the sinks send them, relay/catalog/headers.py) and
each type's schema in ``components.schemas`` (relay/catalog/names.py).

What the document never holds: a secret, a configured header's value, a URL's user info or
query, the database URL, and a webhook's path unless asked (``webhook_paths``: a path may be a
token). :func:`render` writes it the same, byte for byte, for the same input.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from relay.catalog.headers import DECIMAL, http_headers, kafka_headers
from relay.catalog.names import component_schemas, escape, schema_keys
from relay.cloudevents import SPECVERSION, STRUCTURED_CONTENT_TYPE, CloudEvents, from_config
from relay.config.base import DestinationSettings
from relay.config.settings import Settings
from relay.sinks.endpoints.config import EndpointsDestination
from relay.sinks.kafka.config import KafkaDestination, KafkaSettings
from relay.sinks.webhook.config import WebhookClientSettings, WebhookDestination

ASYNCAPI_VERSION = "3.0.0"
KAFKA_BINDING = "0.5.0"
HTTP_BINDING = "0.3.0"
MAX_KEY_BYTES = 1024  # outbox.message.MAX_KEY_BYTES
STANDARD_WEBHOOKS = "standardWebhooks"
KAFKA_SERVER = "kafka"
_SASL = {"PLAIN": "plain", "SCRAM-SHA-256": "scramSha256", "SCRAM-SHA-512": "scramSha512"}
# What an example of a structured CloudEvent shows for the attributes each row sets itself.
_EXAMPLE_ID = "42"
_EXAMPLE_TIME = "2025-01-01T12:00:00.000000Z"

Json = dict[str, Any]


CATALOG_EXTENSION = "x-outbox-catalog"


def build(
    catalog: Mapping[str, Any],
    settings: Settings,
    *,
    kafka_host: str | None = None,
    webhook_paths: bool = False,
) -> Json:
    """The AsyncAPI document of ``catalog`` (an export dict) delivered by ``settings``.
    ``kafka_host``: the host the Kafka server names (default the first bootstrap server);
    ``webhook_paths``: give webhook channels their URL's path as address (else null)."""
    types = sorted(catalog.get("types") or [], key=lambda t: str(t["name"]))
    keys = schema_keys(types)
    servers: Json = {}
    schemes: Json = {}
    channels: Json = {}
    operations: Json = {}
    for name in sorted(settings.destinations):
        d = settings.destinations[name]
        mine = [t for t in types if name in t["destinations"]]
        messages = {
            escape(t["name"]): _message(t, d, settings, keys[(t["name"], None)]) for t in mine
        }
        channel = _channel(name, d, [t["name"] for t in mine], webhook_paths)
        channel["messages"] = messages
        key = escape(name)
        server = _server(name, d, settings, kafka_host, schemes)
        if server is not None:
            servers[server[0]] = server[1]
            channel["servers"] = [{"$ref": f"#/servers/{server[0]}"}]
        channels[key] = channel
        operations[f"send-{key}"] = _operation(key, name, d, sorted(messages))
    components: Json = {"schemas": component_schemas(types, keys)}
    if schemes:
        components["securitySchemes"] = schemes
    document: Json = {
        "asyncapi": ASYNCAPI_VERSION,
        "info": _info(catalog),
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": components,
        # The catalog itself, exactly: `catalog check --against` compares releases on it (the
        # document's schemas are rewritten for AsyncAPI and lose what the export says). A
        # string: parsers resolve every $ref of a document, and the export's point elsewhere.
        CATALOG_EXTENSION: json.dumps(
            {**catalog, "types": [_published(t) for t in types]},
            sort_keys=True,
            ensure_ascii=False,
        ),
    }
    if servers:
        document["servers"] = servers
    return document


# What the embedded catalog leaves out: where each type was declared (a path of the machine
# that built the document, a module name) and the application's validation modes.
_PRIVATE = ("origin", "validate")


def _published(t: Mapping[str, Any]) -> Json:
    return {
        **{k: v for k, v in t.items() if k not in _PRIVATE},
        "destinations": sorted(t["destinations"]),
    }


def render(document: Mapping[str, Any]) -> str:
    """``document`` as JSON: sorted keys, two-space indents, a final newline (so that it can
    be committed and compared release to release)."""
    return json.dumps(document, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def _info(catalog: Mapping[str, Any]) -> Json:
    title = str(catalog.get("title") or "events")
    return {
        "title": title,
        "version": str(catalog.get("version") or "1"),
        "description": (
            f"The events of {title}, as outbox-relay delivers them: a channel per destination "
            "of the relay's configuration, a message per event type on it. Events are "
            "delivered at least once: deduplicate on outbox-id (Kafka) or webhook-id (HTTP). "
            "Read them as a tolerant reader: ignore fields and enum values you do not know, "
            "which later versions may add."
        ),
    }


# --- servers ------------------------------------------------------------------------------


def _server(
    name: str,
    d: DestinationSettings,
    settings: Settings,
    kafka_host: str | None,
    schemes: Json,
) -> tuple[str, Json] | None:
    """The key and server of ``d``'s channel, adding its security scheme to ``schemes``; None
    for an endpoints destination (its addresses are registered at runtime)."""
    if isinstance(d, KafkaDestination):
        kafka = settings.section("kafka")
        assert isinstance(kafka, KafkaSettings)
        return KAFKA_SERVER, _kafka_server(kafka, kafka_host, schemes)
    if isinstance(d, WebhookDestination):
        parts = urlsplit(d.url)
        schemes[STANDARD_WEBHOOKS] = standard_webhooks()
        server = {
            # The authority without user info (check_url refuses it; kept out regardless).
            "host": parts.netloc.rpartition("@")[2],
            "protocol": parts.scheme.lower(),
            "description": f"The receiver of destination {name!r}.",
            "security": [{"$ref": f"#/components/securitySchemes/{STANDARD_WEBHOOKS}"}],
        }
        return f"webhook-{escape(name)}", server
    return None


def _kafka_server(kafka: KafkaSettings, host: str | None, schemes: Json) -> Json:
    servers = kafka.bootstrap_servers
    first = (servers.split(",") if isinstance(servers, str) else servers)[0].strip()
    protocol = kafka.security_protocol
    server: Json = {
        "host": host or first,
        "protocol": "kafka-secure" if protocol in ("SSL", "SASL_SSL") else "kafka",
        "description": f"The Kafka cluster (security protocol {protocol}).",
    }
    mechanism = kafka.sasl_mechanism
    if mechanism in _SASL:
        schemes["kafka"] = {
            "type": _SASL[mechanism],
            "description": f"SASL {mechanism}: ask the cluster's operators for credentials.",
        }
        server["security"] = [{"$ref": "#/components/securitySchemes/kafka"}]
    return server


def standard_webhooks() -> Json:
    """The Standard Webhooks signature, as an API key in a header (AsyncAPI has no scheme of
    its own for it; a type of our own is refused by the parser)."""
    return {
        "type": "httpApiKey",
        "in": "header",
        "name": "webhook-signature",
        "description": (
            "Standard Webhooks (https://www.standardwebhooks.com/): webhook-signature is "
            "`v1,` and the base64 HMAC-SHA256 of `<webhook-id>.<webhook-timestamp>.<body>`, "
            "keyed with the base64-decoded part of the destination's `whsec_` secret; while "
            "secrets rotate, one signature per secret, space-separated. Verify it over the "
            "raw body, and the timestamp's age, with a Standard Webhooks library or "
            "outbox.inbox.webhooks."
        ),
        "x-standard-webhooks": {"version": "v1"},
    }


# --- channels and operations --------------------------------------------------------------


def _channel(name: str, d: DestinationSettings, types: list[str], paths: bool) -> Json:
    channel: Json = {
        "title": name,
        "description": " ".join(_about(d, types, paths)),
        "x-outbox-destination": name,
        "address": None,
    }
    if isinstance(d, KafkaDestination):
        channel["address"] = d.topic
        channel["bindings"] = {"kafka": {"topic": d.topic, "bindingVersion": KAFKA_BINDING}}
    elif isinstance(d, WebhookDestination) and paths:
        # Braces would read as AsyncAPI parameters; a URL holds them only %-encoded anyway.
        path = urlsplit(d.url).path or "/"
        channel["address"] = path.replace("{", "%7B").replace("}", "%7D")
    return channel


def _about(d: DestinationSettings, types: list[str], paths: bool) -> list[str]:
    """The sentences of a channel's description."""
    if isinstance(d, KafkaDestination):
        about = [f"Kafka topic {d.topic}; the message key is the event's key."]
        if d.ordering == "key":
            about.append(
                'Events of one key arrive in the order they were enqueued (ordering = "key").'
            )
    elif isinstance(d, WebhookDestination):
        where = "its URL" if paths else "its URL (the server names its origin only)"
        about = [f"Each event is POSTed to {where}, signed the Standard Webhooks way."]
    elif isinstance(d, EndpointsDestination):
        about = [
            "Each event is POSTed to every endpoint registered at runtime (outbox.endpoints) for "
            "the event's tenant and type, signed the Standard Webhooks way with the endpoint's "
            "secret: its addresses are generated at runtime."
        ]
    else:
        about = [f"A destination of kind {d.kind!r}."]
    ce = from_config(d)
    if ce is not None:
        mode = "structured" if ce.structured else "binary"
        about.append(f"Events are CloudEvents 1.0 ({mode} mode) of source {ce.source}.")
    if len(types) > 1 and ce is None:
        about.append(
            f"It carries {len(types)} event types ({', '.join(types)}) without the CloudEvents "
            "envelope: no header names an event's type, so a consumer cannot tell the types "
            'apart from the headers. Set envelope = "cloudevents" on the destination: its '
            "type attribute then names each event's type."
        )
    if not types:
        about.append("No event type of the catalog is declared for this destination.")
    return about


def _operation(channel: str, name: str, d: DestinationSettings, messages: list[str]) -> Json:
    operation: Json = {
        "action": "send",
        "title": f"Send to {name}",
        "channel": {"$ref": f"#/channels/{channel}"},
        "messages": [{"$ref": f"#/channels/{channel}/messages/{m}"} for m in messages],
        "x-outbox-destination": name,
    }
    if not isinstance(d, KafkaDestination):
        operation["bindings"] = {"http": {"method": "POST", "bindingVersion": HTTP_BINDING}}
        operation["security"] = [{"$ref": f"#/components/securitySchemes/{STANDARD_WEBHOOKS}"}]
    return operation


# --- messages -----------------------------------------------------------------------------


def _message(t: Mapping[str, Any], d: DestinationSettings, settings: Settings, schema: str) -> Json:
    """The message of type ``t`` on destination ``d``."""
    name = str(t["name"])
    content_type = str(t.get("content_type") or "application/json")
    ce = from_config(d)
    structured = ce is not None and ce.structured
    payload: Json = {"$ref": f"#/components/schemas/{schema}"}
    if structured:
        assert ce is not None
        payload = _structured(payload, ce, name, content_type)
    message: Json = {
        "name": name,
        "title": name,
        "contentType": STRUCTURED_CONTENT_TYPE if structured else content_type,
        "payload": payload,
        "x-outbox-event-type": name,
        "x-outbox-version": t.get("version", 1),
    }
    headers = _headers(name, content_type, d, ce, settings)
    if headers is not None:
        message["headers"] = headers
    if t.get("description"):
        message["summary"] = str(t["description"]).strip().split("\n")[0]
        message["description"] = str(t["description"])
    if t.get("deprecated"):
        message["deprecated"] = True
    examples = list(t.get("examples") or [])
    if examples:
        message["examples"] = [
            {
                "name": f"example-{i}",
                "payload": _example(e, ce, name, content_type) if structured else e,
            }
            for i, e in enumerate(examples, 1)
        ]
    if isinstance(d, KafkaDestination):
        message["bindings"] = {
            "kafka": {"key": _key(t.get("key")), "bindingVersion": KAFKA_BINDING}
        }
    return message


def _headers(
    name: str,
    content_type: str,
    d: DestinationSettings,
    ce: CloudEvents | None,
    settings: Settings,
) -> Json | None:
    if isinstance(d, KafkaDestination):
        return kafka_headers(name, content_type, ce)
    if isinstance(d, WebhookDestination | EndpointsDestination):
        client = settings.section("webhooks")
        assert isinstance(client, WebhookClientSettings)
        return http_headers(
            name, content_type, ce, id_prefix=client.id_prefix, configured=sorted(d.headers)
        )
    return None


def _key(description: Any) -> Json:
    """The Kafka key: the row's key, required when the type says what it is."""
    if description is None:
        return {
            "type": ["string", "null"],
            "maxLength": MAX_KEY_BYTES,
            "description": "the event's key if it has one (the type declares none)",
        }
    return {"type": "string", "maxLength": MAX_KEY_BYTES, "description": str(description)}


def _structured(data: Json, ce: CloudEvents, name: str, content_type: str) -> Json:
    """The JSON CloudEvent (structured mode) holding the type's payload as ``data``."""
    return {
        "type": "object",
        "description": f"A CloudEvent 1.0 (JSON format) whose data is an event of type {name}.",
        "properties": {
            "specversion": {"type": "string", "const": SPECVERSION},
            "id": {"type": "string", "pattern": DECIMAL, "description": "the outbox row id"},
            "source": {"type": "string", "const": ce.source},
            "type": {"type": "string", "const": name},
            "time": {"type": "string", "format": "date-time"},
            "datacontenttype": {"type": "string", "examples": [content_type]},
            "data": data,
        },
        "required": sorted(
            ["specversion", "id", "source", "type", "time", "datacontenttype", "data"]
        ),
    }


def _example(payload: Any, ce: CloudEvents | None, name: str, content_type: str) -> Json:
    assert ce is not None
    return {
        "specversion": SPECVERSION,
        "id": _EXAMPLE_ID,
        "source": ce.source,
        "type": name,
        "time": _EXAMPLE_TIME,
        "datacontenttype": content_type,
        "data": payload,
    }
