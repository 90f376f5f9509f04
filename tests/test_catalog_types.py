"""Event types and their schemas (outbox.catalog), without a database: declared from pydantic
models and from draft-07 and 2020-12 files, refused with the pointer where a schema cannot
be published, exported and loaded back, and made portable without changing a verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from outbox.catalog import Catalog, CatalogError, EventType, load_catalog
from tests.support.schemas import FORMATS, document, invalid, valid

DRAFT_07 = "http://json-schema.org/draft-07/schema#"
DRAFT_2020 = "https://json-schema.org/draft/2020-12/schema"


class Line(BaseModel):
    sku: str = Field(min_length=1, max_length=32)
    quantity: int = Field(ge=1, le=1000)


class Address(BaseModel):
    city: str
    lines: tuple[str, str]


class OrderCreated(BaseModel):
    """An order was placed."""

    order_id: int
    currency: Literal["EUR", "USD"]
    lines: list[Line]
    shipping: Address | None = None
    coupon: str | None = Field(default=None, max_length=12)


EXAMPLE = {"order_id": 1, "currency": "EUR", "lines": [{"sku": "a", "quantity": 2}]}


def order_type(**kw: Any) -> EventType:
    kw.setdefault("destinations", ["orders", "customer-events"])
    return EventType.from_model(OrderCreated, "order.created", version=3, **kw)


def write(folder: Path, name: str, schema: dict[str, Any]) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(schema))
    return path


# --- from a model ----------------------------------------------------------------------------


def test_a_model_is_declared_by_the_schema_it_publishes() -> None:
    t = order_type(key="the order id", examples=[EXAMPLE])
    assert t.schema == OrderCreated.model_json_schema(mode="serialization")
    assert (t.name, t.version, t.key) == ("order.created", 3, "the order id")
    assert t.destinations == ("customer-events", "orders")  # sorted
    assert t.description == "An order was placed."
    assert t.origin == f"pydantic:{__name__}.OrderCreated"
    assert t.examples == (EXAMPLE,) and t.validate is None

    # Portable: definitions hoisted, refs draft-07 style, the tuple a list of items.
    assert sorted(t.definitions) == ["Address", "Line"]
    assert "$defs" not in json.dumps(t.portable) and "$schema" not in t.portable
    assert t.portable["properties"]["lines"]["items"] == {"$ref": "#/definitions/Line"}
    shipping = t.portable["properties"]["shipping"]["anyOf"]
    assert {"$ref": "#/definitions/Address"} in shipping
    city_lines = t.definitions["Address"]["properties"]["lines"]
    assert city_lines["items"] == [{"type": "string"}, {"type": "string"}]
    assert "prefixItems" not in city_lines
    jsonschema.Draft7Validator.check_schema(document(t.portable, t.definitions))


def test_the_catalog_decorator_returns_the_model_and_keeps_the_type() -> None:
    catalog = Catalog(title="shop events", version="7")
    returned = catalog.event("order.created", destinations=["orders"])(OrderCreated)
    assert returned is OrderCreated
    other = EventType.from_schema("invoice.paid", {"type": "object"}, destinations=["billing"])
    catalog.add(other)
    assert [t.name for t in catalog] == ["invoice.paid", "order.created"]
    assert catalog.get("order.created") is not None and catalog.get("nope") is None
    assert [t.name for t in catalog.for_destination("billing")] == ["invoice.paid"]
    assert catalog.for_destination("elsewhere") == []


# --- from files with relative references -----------------------------------------------------


def test_a_draft_07_file_with_relative_refs_is_bundled(tmp_path: Path) -> None:
    write(
        tmp_path,
        "common/money.json",
        {"$schema": DRAFT_07, "definitions": {"Amount": {"type": "integer", "minimum": 0}}},
    )
    write(
        tmp_path,
        "line.json",
        {
            "type": "object",
            "properties": {"price": {"$ref": "common/money.json#/definitions/Amount"}},
            "required": ["price"],
        },
    )
    order = write(
        tmp_path,
        "schemas/../order.json",
        {
            "$schema": DRAFT_07,
            "type": "object",
            "properties": {
                "total": {"$ref": "common/money.json#/definitions/Amount"},
                "lines": {"type": "array", "items": {"$ref": "line.json"}},
            },
            "required": ["total"],
        },
    )
    t = EventType.from_schema("order.placed", order, destinations=["orders"])
    assert t.origin == str(order)
    # Each file once, under the root's definitions; every ref now inside the document.
    assert sorted(t.schema["definitions"]) == ["line", "money"]
    refs = _all(t.schema, "$ref")
    assert refs and all(r.startswith("#/definitions/") for r in refs)
    # Definitions inside a file's definitions hoisted too, each under its own name.
    assert t.portable["properties"]["total"] == {"$ref": "#/definitions/Amount"}
    assert sorted(t.definitions) == ["Amount", "line", "money"]
    doc = document(t.portable, t.definitions)
    ok = {"total": 3, "lines": [{"price": 1}]}
    bad = {"total": 3, "lines": [{"price": -1}]}
    for schema in (t.schema, doc):
        v = jsonschema.Draft7Validator(schema)
        assert v.is_valid(ok) and not v.is_valid(bad)


def test_a_2020_12_file_becomes_draft_07(tmp_path: Path) -> None:
    write(
        tmp_path,
        "point.json",
        {
            "$schema": DRAFT_2020,
            "type": "array",
            "prefixItems": [{"type": "number"}, {"type": "number"}],
            "items": False,
        },
    )
    path = write(
        tmp_path,
        "shape.json",
        {
            "$schema": DRAFT_2020,
            "type": "object",
            "properties": {
                "at": {"$ref": "point.json", "description": "where"},
                "label": {"$ref": "#/$defs/Label", "maxLength": 3},
                "card": {"type": "string"},
                "cvc": {"type": "string"},
            },
            "dependentRequired": {"card": ["cvc"]},
            "$defs": {"Label": {"type": "string", "minLength": 1}},
        },
    )
    t = EventType.from_schema("shape.drawn", str(path), destinations=["shapes"])
    assert t.definitions["point"] == {
        "type": "array",
        "items": [{"type": "number"}, {"type": "number"}],
        "additionalItems": False,
    }
    props = t.portable["properties"]
    # An annotation beside a $ref stays; an assertion goes under allOf (draft-07 ignores it).
    assert props["at"] == {"$ref": "#/definitions/point", "description": "where"}
    assert props["label"] == {"allOf": [{"$ref": "#/definitions/Label"}], "maxLength": 3}
    assert t.portable["dependencies"] == {"card": ["cvc"]}
    declared = jsonschema.Draft202012Validator(t.schema)
    portable = jsonschema.Draft7Validator(document(t.portable, t.definitions))
    for value in ({"at": [1, 2]}, {"at": [1, 2, 3]}, {"label": "abcd"}, {"card": "x"}):
        assert declared.is_valid(value) == portable.is_valid(value), value


# --- refusals, each naming the type and the pointer --------------------------------------------


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ({"properties": {"a": {"$ref": "https://example.com/a.json"}}}, "remote $ref"),
        ({"properties": {"a": {"$ref": "//example.com/a.json"}}}, "remote $ref"),
        ({"properties": {"a": {"unevaluatedProperties": False}}}, "unevaluatedProperties"),
        ({"unevaluatedItems": False}, "unevaluatedItems"),
        ({"properties": {"a": {"$dynamicRef": "#x"}}}, "$dynamicRef"),
        ({"dependentSchemas": {"a": {}}}, "dependentSchemas"),
        ({"properties": {"a": {"$ref": "#/properties/b"}}, "$defs": {}}, "outside $defs"),
        ({"properties": {"a": {"$ref": "#/$defs/Nope"}}}, "points at nothing"),
        ({"properties": {"a": {"$ref": "#thing"}}}, "anchor"),
        ({"$schema": "http://json-schema.org/draft-04/schema#"}, "draft-07 or 2020-12"),
        ({"items": [{"type": "string"}]}, "prefixItems"),
        ({"$schema": DRAFT_07, "prefixItems": [{}]}, "not a draft-07 keyword"),
    ],
)
def test_what_cannot_be_published_is_refused_with_its_pointer(
    schema: dict[str, Any], expected: str
) -> None:
    with pytest.raises(CatalogError) as err:
        EventType.from_schema("odd.type", schema, destinations=["d"])
    message = str(err.value)
    assert "'odd.type'" in message and expected in message, message
    assert " (at #" in message, message


def test_the_pointer_is_where_the_keyword_is() -> None:
    schema = {"properties": {"a/b": {"items": {"unevaluatedProperties": False}}}}
    with pytest.raises(CatalogError, match=r"at #/properties/a~1b/items/unevaluatedProperties"):
        EventType.from_schema("t", schema, destinations=["d"])


def test_a_missing_referred_file_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "a.json", {"properties": {"b": {"$ref": "b.json"}}})
    with pytest.raises(CatalogError, match=r"b\.json cannot be read"):
        EventType.from_schema("t", path, destinations=["d"])


def test_an_invalid_example_is_refused_in_every_mode() -> None:
    for mode in ("off", "warn", "reject", None):
        with pytest.raises(CatalogError) as err:
            order_type(validate=mode, examples=[EXAMPLE, {**EXAMPLE, "currency": "GBP"}])
        assert "examples[1].currency" in str(err.value) and "enum" in str(err.value)
        assert "GBP" not in str(err.value)  # no value, not even an example's


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"destinations": []}, "no destination"),
        ({"destinations": [""]}, "non-empty"),
        ({"version": 0}, "version"),
        ({"version": True}, "version"),
        ({"key": ""}, "key"),
        ({"validate": "strict"}, "validate"),
        ({"content_type": "text/plain"}, "content_type"),
    ],
)
def test_bad_fields_are_refused(kwargs: dict[str, Any], expected: str) -> None:
    kwargs = {"destinations": ["d"], **kwargs}
    with pytest.raises(CatalogError, match=expected):
        EventType.from_schema("t", {"type": "object"}, **kwargs)


@pytest.mark.parametrize("name", ["", " ", "a\nb", "x" * 256, 7])
def test_a_name_enqueue_would_refuse_is_refused(name: Any) -> None:
    with pytest.raises(CatalogError, match="the name"):
        EventType.from_schema(name, {"type": "object"}, destinations=["d"])


def test_a_duplicate_name_is_refused() -> None:
    catalog = Catalog()
    catalog.add(order_type())
    with pytest.raises(CatalogError, match=r"'order\.created' is declared twice"):
        catalog.event("order.created", destinations=["orders"])(OrderCreated)
    assert len(catalog) == 1


def test_a_class_that_is_no_model_is_refused() -> None:
    with pytest.raises(CatalogError, match="not a pydantic model class"):
        EventType.from_model(
            OrderCreated(order_id=1, currency="EUR", lines=[]), "t", destinations=["d"]
        )


# --- export and load ---------------------------------------------------------------------------


def shop(tmp_path: Path) -> Catalog:
    catalog = Catalog(title="shop events", version="7", validate="warn", unknown="reject")
    catalog.add(order_type(key="the order id", examples=[EXAMPLE], validate="reject"))
    path = write(
        tmp_path,
        "paid.json",
        {
            "$schema": DRAFT_07,
            "type": "object",
            "properties": {"at": {"type": "string", "format": "date-time"}},
        },
    )
    catalog.add(
        EventType.from_schema("invoice.paid", path, destinations=["billing"], deprecated=True)
    )
    return catalog


def test_export_then_load_is_the_same_catalog(tmp_path: Path) -> None:
    catalog = shop(tmp_path)
    exported = catalog.export()
    assert exported["format"] == "outbox-catalog/1"
    assert (exported["title"], exported["version"]) == ("shop events", "7")
    assert (exported["validate"], exported["unknown"]) == ("warn", "reject")
    assert [t["name"] for t in exported["types"]] == ["invoice.paid", "order.created"]
    assert json.loads(json.dumps(exported, sort_keys=True)) == exported  # JSON values only
    paid = exported["types"][0]
    assert paid["key"] is None and paid["validate"] is None and paid["deprecated"] is True
    assert exported["types"][1]["validate"] == "reject"

    file = tmp_path / "catalog.json"
    file.write_text(json.dumps(exported, sort_keys=True))
    for source in (exported, file, str(file)):
        loaded = Catalog.load(source)
        assert loaded.export() == exported
        assert list(loaded) == list(catalog)  # the types equal, field by field
    assert load_catalog(str(file)).export() == exported


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda e: e.update(format="outbox-catalog/2"), "format"),
        (lambda e: e.update(extra=1), "expected keys"),
        (lambda e: e["types"][0].pop("portable"), "expected keys"),
        (lambda e: e["types"][0].update(destinations=[]), "no destination"),
        (lambda e: e["types"].append(e["types"][0]), "declared twice"),
    ],
)
def test_a_bad_export_is_refused(tmp_path: Path, change: Any, expected: str) -> None:
    exported = shop(tmp_path).export()
    change(exported)
    with pytest.raises(CatalogError, match=expected):
        Catalog.load(exported)


def test_load_catalog_takes_module_attr_and_callables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "shop_events_mod.py").write_text(
        "from outbox.catalog import Catalog, EventType\n"
        "catalog = Catalog(title='shop')\n"
        "catalog.add(EventType.from_schema('a.b', {'type': 'object'}, destinations=['d']))\n"
        "def make():\n    return catalog\n"
        "class Holder:\n    inner = catalog\n"
        "not_one = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "shop_events_mod", raising=False)
    for spec in ("shop_events_mod:catalog", "shop_events_mod:make", "shop_events_mod:Holder.inner"):
        assert load_catalog(spec).title == "shop"
    for spec, expected in [
        ("shop_events_mod:not_one", "is a int, not a Catalog"),
        ("shop_events_mod:missing", "has no 'missing'"),
        ("no_such_module_here:catalog", "no module 'no_such_module_here'"),
        ("shop_events_mod", "expected 'module:attr'"),
        (str(tmp_path / "absent.json"), "cannot be read"),
    ]:
        with pytest.raises(CatalogError, match=expected):
            load_catalog(spec)


# --- portable keeps every verdict --------------------------------------------------------------


def _declared_schemas() -> list[EventType]:
    shape = {
        "$schema": DRAFT_2020,
        "type": "object",
        "properties": {
            "at": {
                "type": "array",
                "prefixItems": [{"type": "integer"}, {"$ref": "#/$defs/Day"}],
                "items": False,
                "minItems": 1,
            },
            "id": {"type": "string", "format": "uuid"},
            "when": {"type": "string", "format": "date-time"},
            "label": {"$ref": "#/$defs/Label", "maxLength": 4},
        },
        "required": ["id"],
        "additionalProperties": False,
        "$defs": {
            "Day": {"type": "string", "format": "date"},
            "Label": {"type": "string", "minLength": 2},
        },
    }
    return [
        order_type(),
        EventType.from_schema("shape", shape, destinations=["d"]),
        EventType.from_model(Address, "address", destinations=["d"]),
    ]


TYPES = _declared_schemas()
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


def _values(t: EventType) -> st.SearchStrategy[Any]:
    doc = document(t.portable, t.definitions)
    return st.one_of(valid(doc), invalid(doc).map(lambda i: i.value), ANY_JSON)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_value_has_the_same_verdict_under_the_declared_and_the_portable_form(
    data: st.DataObject,
) -> None:
    t = data.draw(st.sampled_from(TYPES))
    value = data.draw(_values(t))
    declared_cls = jsonschema.validators.validator_for(t.schema)
    declared = declared_cls(t.schema, format_checker=FORMATS)
    portable = jsonschema.Draft7Validator(
        document(t.portable, t.definitions), format_checker=FORMATS
    )
    assert declared.is_valid(value) == portable.is_valid(value), value


def _all(node: Any, key: str) -> list[Any]:
    if isinstance(node, dict):
        here = [node[key]] if key in node else []
        return here + [x for v in node.values() for x in _all(v, key)]
    if isinstance(node, list):
        return [x for v in node for x in _all(v, key)]
    return []
