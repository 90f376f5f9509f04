"""Catalog exports and relay configurations the AsyncAPI document's tests build documents from
(tests/test_catalog_asyncapi.py, tests/test_asyncapi_parser.py): every kind of destination
with every envelope, names that need escaping, and secrets that must never reach a document.

The exports are written by hand in the format outbox.catalog's ``Catalog.export()`` returns
(``outbox-catalog/1``): the document is built from that format alone.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

from relay.config.settings import Settings
from relay.settings import load_settings

# Values that must never appear in a document (each test configuration holds them).
DB_PASSWORD = "db-Pa55word-never-shown"
DB_URL = f"postgresql://root:{DB_PASSWORD}@127.0.0.1:5432/postgres"
WEBHOOK_SECRET = "whsec_" + "c2VjcmV0LXNpZ25pbmcta2V5LW5ldmVyLXNob3du"
HEADER_VALUE = "Bearer header-value-never-shown"
URL_TOKEN = "url-query-token-never-shown"
SASL_USER = "sasl-user-never-shown"
SASL_PASSWORD = "sasl-password-never-shown"
WEBHOOK_PATH = "/hooks/path-only-with-webhook-paths"

ENVELOPES: dict[str, str] = {
    "none": "",
    "binary": 'envelope = "cloudevents"\nsource = "/shop/orders"\n',
    "structured": (
        'envelope = "cloudevents"\nsource = "/shop/orders"\ncloudevents_mode = "structured"\n'
    ),
}
KINDS = ("kafka", "webhook", "endpoints")


def destination(kind: str, envelope: str) -> str:
    """The TOML table of destination ``<kind>-<envelope>``."""
    name = f"{kind}-{envelope}"
    body = f'[destinations.{name}]\nkind = "{kind}"\n{ENVELOPES[envelope]}'
    if kind == "kafka":
        body += f'topic = "topic.{name}"\n'
        if envelope == "none":
            body += 'ordering = "key"\n'
    elif kind == "webhook":
        body += (
            f'url = "https://hooks.example.com:8443{WEBHOOK_PATH}?token={URL_TOKEN}"\n'
            f'secrets = ["{WEBHOOK_SECRET}"]\n'
            f'headers = {{ "Authorization" = "{HEADER_VALUE}", "X-Team" = "orders" }}\n'
        )
    else:
        body += f'headers = {{ "X-Api-Key" = "{HEADER_VALUE}" }}\n'
    return body


ALL_DESTINATIONS = [f"{k}-{e}" for k, e in itertools.product(KINDS, ENVELOPES)]

# Every kind with every envelope, a destination no type is declared for, a destination whose
# name needs escaping; [webhooks] id_prefix and Kafka SASL over TLS.
EVERYTHING = (
    "\n".join(destination(k, e) for k, e in itertools.product(KINDS, ENVELOPES))
    + '\n[destinations.unused]\nkind = "kafka"\ntopic = "unused"\n'
    + '\n[destinations."commande créée"]\nkind = "kafka"\ntopic = "commandes"\n'
    + '\n[webhooks]\nid_prefix = "billing.v1:"\n'
    + '\n[kafka]\nbootstrap_servers = ["kafka-1.internal:9093", "kafka-2.internal:9093"]\n'
    + 'security_protocol = "SASL_SSL"\nsasl_mechanism = "SCRAM-SHA-512"\n'
    + f'sasl_plain_username = "{SASL_USER}"\nsasl_plain_password = "{SASL_PASSWORD}"\n'
)
# The smallest: one plain Kafka topic.
KAFKA_ONLY = '[destinations.orders]\nkind = "kafka"\ntopic = "orders"\n'
# Webhooks and endpoints alone (no Kafka server), no id_prefix.
HTTP_ONLY = destination("webhook", "none") + "\n" + destination("endpoints", "binary")

CONFIGS = {"everything": EVERYTHING, "kafka-only": KAFKA_ONLY, "http-only": HTTP_ONLY}

LINE = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "minLength": 1, "maxLength": 64},
        "quantity": {"type": "integer", "minimum": 1},
        "parts": {"type": "array", "items": {"$ref": "#/definitions/Line"}},
        "note": {"$ref": "#/definitions/Note"},
    },
    "required": ["sku", "quantity"],
    "additionalProperties": False,
}
ORDER_CREATED = {
    "title": "OrderCreated",
    "type": "object",
    "properties": {
        "order_id": {"type": "integer"},
        "currency": {"type": "string", "enum": ["EUR", "USD"]},
        "lines": {"type": "array", "items": {"$ref": "#/definitions/Line"}},
        "placed_at": {"type": "string", "format": "date-time"},
        "replaces": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
    },
    "required": ["order_id", "currency", "lines"],
}
# The draft-07 keywords a portable form may hold beside the usual ones.
CUSTOMER_DELETED = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "format": "uuid"},
        "pair": {"items": [{"type": "string"}, {"type": "integer"}], "additionalItems": False},
        "tags": {"type": "object", "patternProperties": {"^t-": {"type": "string"}}},
        "codes": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
        "on": {"type": "string", "format": "date"},
        "kind": {"const": "gdpr"},
        "notes": {"type": "array", "contains": {"type": "string"}, "uniqueItems": True},
        "where": {"if": {"type": "string"}, "then": {"minLength": 2}, "else": {"type": "null"}},
        "not_zero": {"not": {"const": 0}},
    },
    "dependencies": {"pair": ["customer"], "tags": {"required": ["codes"]}},
    "required": ["customer"],
}


def _type(name: str, destinations: list[str], portable: dict[str, Any], **extra: Any) -> Any:
    return {
        "name": name,
        "version": extra.pop("version", 1),
        "description": extra.pop("description", None),
        "schema": portable,
        "portable": portable,
        "definitions": extra.pop("definitions", {}),
        "examples": extra.pop("examples", []),
        "deprecated": extra.pop("deprecated", False),
        "destinations": sorted(destinations),
        "key": extra.pop("key", None),
        "content_type": extra.pop("content_type", "application/json"),
        "validate": None,
        "origin": f"tests:{name}",
    }


def catalog() -> dict[str, Any]:
    """A catalog for the EVERYTHING configuration (and the others, which name fewer
    destinations: a type's destination a configuration lacks is left out)."""
    types = [
        _type(
            "order.created",
            [*ALL_DESTINATIONS, "orders", "nowhere"],
            ORDER_CREATED,
            version=3,
            description="An order was placed.\n\nIts lines, as the customer saw them.",
            definitions={"Line": LINE, "Note": {"type": "string", "maxLength": 500}},
            examples=[{"order_id": 1, "currency": "EUR", "lines": [{"sku": "A-1", "quantity": 2}]}],
            key="the order id",
        ),
        _type(
            "customer.deleted",
            ["kafka-none", "webhook-binary", "endpoints-structured", "orders"],
            CUSTOMER_DELETED,
            deprecated=True,
            examples=[{"customer": "3b241101-e2bb-4255-8caf-4136c566a962", "kind": "gdpr"}],
        ),
        _type("facture payée", ["kafka-none", "commande créée"], {"type": "object"}),
        _type(
            "invoice_paid",
            ["kafka-none", "webhook-none", "commande créée"],
            {"type": "object", "properties": {"amount": {"type": "number"}}},
            content_type="application/vnd.shop.invoice+json",
        ),
    ]
    return {
        "format": "outbox-catalog/1",
        "title": "shop events",
        "version": "7",
        "validate": "off",
        "unknown": "allow",
        "types": sorted(types, key=lambda t: str(t["name"])),
    }


def clashing_catalog() -> dict[str, Any]:
    """Type ``order`` with a definition ``Line`` beside a type named ``order.Line``: the
    plain ``<type>.<Def>`` key would file both under ``order.Line``."""
    order = _type(
        "order",
        ["orders"],
        {"type": "object", "properties": {"line": {"$ref": "#/definitions/Line"}}},
        definitions={"Line": {"type": "string", "description": "order's Line"}},
    )
    line = _type("order.Line", ["orders"], {"type": "integer", "description": "a type"})
    result = catalog()
    result["types"] = [copy.deepcopy(order), line]
    return result


def settings(tmp_path: Path, body: str) -> Settings:
    """A configuration file holding ``body`` and the database URL, loaded."""
    path = tmp_path / "relay.toml"
    path.write_text(f'database_url = "{DB_URL}"\n{body}')
    return load_settings(path)
