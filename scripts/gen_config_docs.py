"""Writes docs/configuration.md, the configuration reference, from the settings models.

Every key's type, default, bounds and environment variable come from the pydantic models, its
meaning from the field's ``description``. The kinds of sink come from the registry
(``relay.sinks.registry.KINDS``), so a new kind's destinations and section are documented
without touching this script. A setting without a description stops the script, listing every
such key: describe it in its model with ``Field(description=...)``.

    .venv/bin/python scripts/gen_config_docs.py           # write docs/configuration.md
    .venv/bin/python scripts/gen_config_docs.py --check   # exit 1, with a diff, if it differs
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "configuration.md"

# The working tree's packages, not whatever copy an environment may have installed.
sys.path.insert(0, str(ROOT))

import annotated_types  # noqa: E402
from pydantic import BaseModel, BeforeValidator, SecretStr  # noqa: E402
from pydantic.fields import FieldInfo  # noqa: E402

from relay.config import MAX_SECONDS, Delivery, settings_model  # noqa: E402
from relay.config.base import package_version  # noqa: E402
from relay.durations import UNITS, format_duration, parse_duration  # noqa: E402
from relay.sinks import SinkKind  # noqa: E402
from relay.sinks.registry import KINDS  # noqa: E402

# The meaning of the settings whose model field has no description: used in its place. Once a
# field has a description its entry here must go (the script says so).
EXTRA_NOTES: dict[str, str] = {
    "log_level": "the least severe level that is logged",
    "relay.schema": "schema of the outbox table; `OUTBOX_SCHEMA` sets it too (the one schema "
    "variable of every command), and the two must not name different schemas",
    "http.enabled": "serve `/metrics`, `/healthz`, `/readyz`; `false`: no listener (the relay "
    "works the same)",
    "destinations.NAME.kind": "the kind of sink that delivers the destination's rows; it "
    "decides which other keys the destination takes",
    "destinations.NAME.topic": "the Kafka topic the destination's rows go to",
    "destinations.NAME.headers": "extra request headers (values never printed); headers the "
    "relay sets itself (`webhook-*`, `content-type`, framing headers) are refused",
    "kafka.bootstrap_servers": "`host:port` entries, comma-separated string or list "
    "(`[::1]:9092` for IPv6; port 9092 if omitted)",
    "kafka.client_id": "the producer's client id, as the brokers see it",
    "kafka.acks": "`all`, or `1` (the leader only: a leader failover can lose an acknowledged "
    "message); `0` is refused (nothing would be acknowledged); `-1` means `all`",
    "kafka.enable_idempotence": 'the idempotent producer; needs `acks = "all"`',
    "kafka.compression_type": "compression of the producer's batches; `snappy`, `lz4` and "
    "`zstd` need the cramjam package (`pip install 'aiokafka[snappy]'`), checked at load",
    "kafka.request_timeout_ms": "milliseconds the producer waits for a broker's answer",
    "kafka.security_protocol": "how the producer connects; the `SASL_` ones need `sasl_mechanism`",
    "kafka.sasl_mechanism": "`PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512` (`OAUTHBEARER` is not "
    "supported yet and refused); needs `security_protocol` `SASL_PLAINTEXT` or `SASL_SSL`",
    "kafka.sasl_plain_username": "required with a `sasl_mechanism` (for SCRAM too)",
    "kafka.sasl_plain_password": "required with a `sasl_mechanism`; never printed",
    "kafka.ssl_cafile": "TLS: the CA certificates file",
    "kafka.ssl_certfile": "TLS: the client certificate file",
    "kafka.ssl_keyfile": "TLS: the client certificate's key file",
    "webhooks.user_agent": "the `user-agent` header of every webhook request",
}

# What the reference says about some keys beyond their description, printed below the table
# that holds the key.
MORE: dict[str, str] = {
    "database_url": "libpq `key=value` strings are not accepted; percent-encode `/ ? # @ :` "
    "in the password. Never printed.",
    "relay.relay_id": "the name in `locked_by`; must be unique per process.",
    "relay.max_in_flight": "at least `relay.batch_size`.",
    "relay.retention": "`0` deletes delivered rows in the statement that records them (see "
    "[Retention](operations.md#retention)).",
    "relay.retention_batch_size": "each statement is its own transaction.",
    "relay.unknown_destinations": "see *Unknown destinations* in [How it works](how-it-works.md).",
    "relay.backoff.schedule": "e.g. `[0, 5, 300, …]`.",
    "http.host": "`127.0.0.1` to keep it local.",
    "http.port": "in use at start-up: exit 1 naming `http.port`.",
    "destinations.NAME.ordering": "see [Ordered delivery per key](ordering.md).",
    "destinations.NAME.max_attempts": "unset: `relay.max_attempts`; webhook destinations "
    "have their own default (below).",
    "destinations.NAME.backoff": "unset: `relay.backoff`; webhook destinations have their own "
    "default, the long schedule (below).",
    "destinations.NAME.url": "`http://` or `https://`; no `user:password@`. See "
    "[Webhooks](webhooks.md).",
    "destinations.NAME.secrets": "one signature per secret.",
    "kafka.max_request_size": "larger rows fail with the reason.",
}

INTRO = """\
# Configuration reference

<!-- Generated by scripts/gen_config_docs.py from the settings models (relay/config/,
relay/sinks/<kind>/config.py). Change a model's descriptions, or the script's notes, then run
`.venv/bin/python scripts/gen_config_docs.py`; tests/test_docs.py checks this file. -->

The relay reads a TOML file (`outbox-relay run --config relay.toml`, see
[Running the relay](usage.md#running-the-relay)) and `OUTBOX_*` environment variables.
Every key can be set in the TOML file or the environment; the environment wins. Environment
names are `OUTBOX_` + section + `_` + key in upper case (`OUTBOX_RELAY_BATCH_SIZE=200`,
`OUTBOX_KAFKA_BOOTSTRAP_SERVERS=…`); `OUTBOX_DESTINATIONS` takes a JSON object, and so does
the variable of a table inside a section (`OUTBOX_RELAY_BACKOFF='{{"base": 2}}'`). The
configuration is validated at start-up: a bad value exits with status 2 and a message naming
the key (`outbox-relay run --config relay.toml --check` validates and exits).

Durations are seconds, at most ten years, never `inf` or `nan`; the keys of type *duration*
({duration_keys}) also take a duration string: a number with a unit ({units}),
combinable (`90s`, `15m`, `7d`, `1h30m`). Bounds are inclusive (≥, ≤) unless written > or <.
"""

OUTRO = """\
## See also

- [Usage](usage.md#running-the-relay): a `relay.toml`, and what happens at start-up.
- [Webhooks](webhooks.md) and [Ordered delivery per key](ordering.md): what the destination
  keys do.
- [Performance](performance.md#tuning): which settings to tune, and why.
"""

HEADER = "| key | type | default | bounds | environment | meaning |\n|---|---|---|---|---|---|"


class UndocumentedSettings(Exception):
    """Settings without a description, or notes in this script that no longer fit."""


@dataclass
class Row:
    key: str
    cells: list[str]
    duration: bool


@dataclass
class Table:
    heading: str
    intro: str
    rows: list[Row] = field(default_factory=list)


@dataclass
class Walk:
    """One rendering: the tables so far, the models that have a table of their own (where a
    later field of such a model points), and the keys without a meaning."""

    env_prefix: str
    env_delimiter: str
    tables: list[Table] = field(default_factory=list)
    documented: dict[type[BaseModel], str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    extra_used: set[str] = field(default_factory=set)
    stale: list[str] = field(default_factory=list)


# --- anchors and values -------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, each
    space a '-'."""
    text = re.sub(r"^#+\s*", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def code(text: object) -> str:
    return f"`{text}`"


def number(value: float) -> str:
    if value == MAX_SECONDS:
        return "10 years"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def toml(value: Any) -> str:
    """A value as TOML writes it (strings unquoted at the top)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return number(value)
    if isinstance(value, str):
        return value.replace(package_version(), "<version>")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_item(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{k} = {_toml_item(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    if isinstance(value, BaseModel):
        return toml(value.model_dump(exclude_defaults=True))
    raise TypeError(f"no TOML form for {value!r}")


def _toml_item(value: Any) -> str:
    return f'"{toml(value)}"' if isinstance(value, str) else toml(value)


def is_duration(f: FieldInfo) -> bool:
    return any(isinstance(m, BeforeValidator) and m.func is parse_duration for m in f.metadata)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (Union, types.UnionType)


def without_none(annotation: Any) -> Any:
    """``X | None`` as ``X``; other annotations as they are."""
    args = typing.get_args(annotation)
    if _is_union(annotation) and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        return rest[0] if len(rest) == 1 else Union[rest]  # noqa: UP007 - built at run time
    return annotation


def model_of(annotation: Any) -> type[BaseModel] | None:
    kind = without_none(annotation)
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


_NAMES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    SecretStr: "secret",
    ipaddress.IPv4Network: "CIDR",
    ipaddress.IPv6Network: "CIDR",
}
_PLURALS = {"CIDR": "CIDRs", "secret": "secrets", "string": "strings", "number": "numbers"}


def type_name(annotation: Any, walk: Walk) -> str:
    annotation = without_none(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0], walk)
    if origin is Literal:
        return "one of " + ", ".join(code(a) for a in args)
    if _is_union(annotation):
        return " or ".join(dict.fromkeys(type_name(a, walk) for a in args))
    if origin in (list, dict):
        inner = type_name(args[-1], walk)
        return f"{'list' if origin is list else 'table'} of {_PLURALS.get(inner, inner)}"
    model = model_of(annotation)
    if model is not None:
        where = walk.documented[model]
        return f"table: the keys of [`{where}`](#{slug(heading_text(where))})"
    if annotation in _NAMES:
        return _NAMES[annotation]
    raise TypeError(f"no name for the type {annotation!r}: add one to _NAMES")


def default(f: FieldInfo) -> str:
    if f.is_required():
        return "(required)"
    value = f.get_default(call_default_factory=True)
    if value is None:
        return "none"
    text = code(toml(value))
    if is_duration(f) and isinstance(value, int | float) and value >= 60:
        text += f" ({format_duration(value)})"
    return text


def bounds(metadata: list[Any], unit: str = "characters") -> list[str]:
    found = []
    for m in metadata:
        if isinstance(m, annotated_types.Ge):
            found.append(f"≥ {number(m.ge)}")  # type: ignore[arg-type]
        elif isinstance(m, annotated_types.Gt):
            found.append(f"> {number(m.gt)}")  # type: ignore[arg-type]
        elif isinstance(m, annotated_types.Le):
            found.append(f"≤ {number(m.le)}")  # type: ignore[arg-type]
        elif isinstance(m, annotated_types.Lt):
            found.append(f"< {number(m.lt)}")  # type: ignore[arg-type]
        elif isinstance(m, annotated_types.MinLen):
            found.append("not empty" if m.min_length == 1 else f"≥ {m.min_length} {unit}")
        elif isinstance(m, annotated_types.MaxLen):
            found.append(f"≤ {m.max_length} {unit}")
        elif getattr(m, "pattern", None):
            found.append(f"matches `{m.pattern}`")
    return found


def field_bounds(f: FieldInfo) -> str:
    kind = without_none(f.annotation)
    is_list = typing.get_origin(kind) is list
    found = bounds(f.metadata, "entries" if is_list else "characters")
    if is_list:  # bounds of each entry: list[Annotated[float, Field(ge=0)]]
        entry = typing.get_args(kind)[0]
        if typing.get_origin(entry) is typing.Annotated:
            meta = []
            for extra in typing.get_args(entry)[1:]:
                meta += list(extra.metadata) if isinstance(extra, FieldInfo) else [extra]
            if each := bounds(meta):
                found.append("each " + ", ".join(each))
    return ", ".join(found)


def docstring(model: type[BaseModel]) -> str:
    """A model's docstring as markdown: paragraphs on one line, rst ``code`` as `code`."""
    text = (model.__doc__ or "").strip()
    if not text:
        raise UndocumentedSettings(f"the model {model.__name__} has no docstring")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    # "[relay]: …" at the start of a line would read as a link definition: as code instead.
    paragraphs = [re.sub(r"^\[([^\]]+)\]", r"`[\1]`", p) for p in paragraphs]
    return "\n\n".join(re.sub(r"``([^`]+)``", r"`\1`", p) for p in paragraphs)


def heading_text(prefix: str) -> str:
    return f"`[{prefix}]`"


# --- walking the models -------------------------------------------------------------------


def meaning(key: str, f: FieldInfo, walk: Walk) -> str:
    if f.description:
        if key in EXTRA_NOTES:
            walk.stale.append(key)
        return f.description
    if key in EXTRA_NOTES:
        walk.extra_used.add(key)
        return EXTRA_NOTES[key]
    walk.missing.append(key)
    return ""


def section(
    model: type[BaseModel],
    prefix: str,
    walk: Walk,
    *,
    level: int,
    heading: str | None = None,
    intro: str | None = None,
    env: str | None = None,
    fields: list[str] | None = None,
    types_: dict[str, str] | None = None,
) -> None:
    """A table of ``model``'s keys under ``prefix`` (``relay``, ``destinations.NAME``; ""
    for the top level), then one per table inside it. ``env``: the variable that holds the
    whole table as JSON, where its keys have no variable of their own."""
    lead = f"{prefix}." if prefix else ""
    table = Table(
        heading=f"{'#' * level} {heading or heading_text(prefix)}",
        intro=docstring(model) if intro is None else intro,
    )
    walk.tables.append(table)
    walk.documented.setdefault(model, prefix)
    inner_tables: list[tuple[str, type[BaseModel]]] = []
    for name, f in model.model_fields.items():
        if fields is not None and name not in fields:
            continue
        key = f.alias or name
        # A table of its own, the first time its model is met (``relay.backoff``); an optional
        # one, or a model met before, is a key whose value is a table.
        inner = model_of(f.annotation)
        optional = without_none(f.annotation) is not f.annotation
        if inner is not None and not optional and inner not in walk.documented:
            walk.documented[inner] = f"{lead}{key}"
            inner_tables.append((key, inner))
            continue
        if env is not None:
            variable = f"{code(env)} (JSON)"
        else:
            variable = code(f"{walk.env_prefix}{lead}{key}".upper().replace(".", "_"))
            variable = variable.replace("_", walk.env_delimiter)
        duration = is_duration(f)
        name_of_type = (types_ or {}).get(name) or (
            "duration" if duration else type_name(f.annotation, walk)
        )
        cells = [
            code(f"{lead}{key}"),
            name_of_type,
            default(f),
            field_bounds(f),
            variable,
            meaning(f"{lead}{key}", f, walk),
        ]
        table.rows.append(Row(f"{lead}{key}", cells, duration))
    for key, inner in inner_tables:
        # Set from the environment as JSON, through the variable named after the table.
        variable = env or f"{walk.env_prefix}{lead}{key}".upper().replace(".", "_")
        section(inner, f"{lead}{key}", walk, level=level + 1, env=variable)


def kind_fields(kind: SinkKind) -> list[str]:
    """What a kind's destinations add to, or set otherwise than, every destination."""
    common = Delivery.model_fields

    def same(a: FieldInfo, b: FieldInfo) -> bool:
        parts = ("annotation", "default", "default_factory", "description", "metadata")
        return all(repr(getattr(a, p)) == repr(getattr(b, p)) for p in parts)

    return [
        name
        for name, f in kind.destination.model_fields.items()
        if name != "kind" and (name not in common or not same(f, common[name]))
    ]


def destinations(walk: Walk) -> None:
    kinds = list(KINDS.values())
    env = f"{walk.env_prefix}DESTINATIONS"
    names = ", ".join(code(k.name) for k in kinds)
    walk.tables.append(
        Table(
            heading="## Destinations",
            intro="Each `[destinations.NAME]` table sends the rows whose `destination` is NAME "
            f"to a sink: its `kind` ({names}) says which, and which keys it takes beside those "
            f"every destination has. In the environment, `{env}` holds them all as one JSON "
            'object (`{"orders": {"kind": "kafka", "topic": "shop.orders.v1"}}`).',
        )
    )
    prefix = "destinations.NAME"
    section(
        Delivery,
        prefix,
        walk,
        level=3,
        heading="Every destination",
        env=env,
        types_={"kind": "one of " + names},
    )
    for kind in kinds:
        shared = (
            f" They share the settings of [`[{kind.section}]`]"
            f"(#{slug(heading_text(kind.section))})."
            if kind.section
            else ""
        )
        section(
            kind.destination,
            prefix,
            walk,
            level=3,
            heading=f"Destinations of kind `{kind.name}`",
            intro=f'With `kind = "{kind.name}"`: the keys such a destination adds to those '
            f"above, or sets otherwise.{shared}",
            env=env,
            fields=kind_fields(kind),
        )


def build() -> Walk:
    """Every table of the reference, in the order of the settings model's fields."""
    model = settings_model()
    walk = Walk(
        env_prefix=str(model.model_config.get("env_prefix", "")),
        env_delimiter=str(model.model_config.get("env_nested_delimiter", "_")),
    )
    kinds = {k.section: k for k in KINDS.values() if k.section}
    fields = model.model_fields
    plain = [n for n, f in fields.items() if model_of(f.annotation) is None]
    section(
        model,
        "",
        walk,
        level=2,
        heading="Top level",
        intro="Keys outside any section.",
        fields=[n for n in plain if n != "destinations"],
    )
    for name, f in fields.items():
        inner = model_of(f.annotation)
        if name == "destinations":
            destinations(walk)
        elif inner is not None:
            intro = docstring(inner)
            if name in kinds:
                intro += f" Used by destinations of kind `{kinds[name].name}`."
            section(inner, name, walk, level=2, intro=intro)
    return walk


def render() -> str:
    """docs/configuration.md as the models describe it; raises UndocumentedSettings."""
    walk = build()
    if walk.missing:
        raise UndocumentedSettings(
            "settings without a description (add Field(description=...) to the model):\n"
            + "\n".join(f"  {k}" for k in walk.missing)
        )
    keys = {r.key for t in walk.tables for r in t.rows}
    problems = [f"  EXTRA_NOTES[{k!r}]: the field has a description now" for k in walk.stale]
    problems += [
        f"  EXTRA_NOTES[{k!r}]: no such setting"
        for k in sorted(set(EXTRA_NOTES) - walk.extra_used - set(walk.stale))
    ]
    problems += [f"  MORE[{k!r}]: no such setting" for k in MORE if k not in keys]
    if problems:
        raise UndocumentedSettings(
            "the script's notes are out of date (remove these entries):\n" + "\n".join(problems)
        )

    durations = sorted(
        {r.key.rsplit(".", 1)[-1] for t in walk.tables for r in t.rows if r.duration}
    )
    listed = ", ".join(code(k) for k in durations[:-1]) + f" and {code(durations[-1])}"
    parts = [INTRO.format(duration_keys=listed, units=", ".join(code(u) for u in UNITS))]
    noted: set[str] = set()
    for table in walk.tables:
        parts.append(table.heading + "\n")
        if table.intro:
            parts.append(table.intro + "\n")
        if table.rows:
            lines = [
                "| " + " | ".join(c.replace("|", "\\|") for c in r.cells) + " |" for r in table.rows
            ]
            parts.append(HEADER + "\n" + "\n".join(lines) + "\n")
        notes = [r.key for r in table.rows if r.key in MORE and r.key not in noted]
        if notes:
            noted.update(notes)
            parts.append("\n".join(f"- `{k}`: {MORE[k]}" for k in notes) + "\n")
    parts.append(OUTRO)
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/configuration.md from the models.")
    parser.add_argument(
        "--check", action="store_true", help="exit 1, with a diff, if the file is out of date"
    )
    args = parser.parse_args(argv)
    try:
        text = render()
    except UndocumentedSettings as exc:
        print(f"gen_config_docs: {exc}", file=sys.stderr)
        return 2
    name = str(OUTPUT.relative_to(ROOT))
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current == text:
            return 0
        sys.stdout.writelines(
            difflib.unified_diff(
                current.splitlines(keepends=True),
                text.splitlines(keepends=True),
                f"{name} (committed)",
                f"{name} (from the models)",
            )
        )
        print(
            f"\n{name} is out of date: run .venv/bin/python scripts/gen_config_docs.py",
            file=sys.stderr,
        )
        return 1
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
