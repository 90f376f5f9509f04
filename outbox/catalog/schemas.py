"""JSON Schemas as a catalog declares them: read, bundled, checked, and made portable.

Pure functions on JSON values, no validator: relative file references are read here, at
declaration, and copied into the schema (so a schema is one self-contained document that is
never resolved over the network, nor from files, afterwards); keywords draft-07 cannot say
are refused; ``portable`` gives the draft-07 form AsyncAPI 3.0 payloads are written in.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, unquote, urlsplit

Dialect = Literal["draft-07", "2020-12"]
JSONObject = dict[str, Any]
MAX_SCHEMA_BYTES = 1 << 20

_DIALECTS: dict[str, Dialect] = {
    "http://json-schema.org/draft-07/schema": "draft-07",
    "https://json-schema.org/draft-07/schema": "draft-07",
    "https://json-schema.org/draft/2020-12/schema": "2020-12",
    "http://json-schema.org/draft/2020-12/schema": "2020-12",
}
# Where a keyword holds subschemas: one, a list, or a map of them.
_ONE = frozenset(
    {
        "additionalProperties",
        "additionalItems",
        "contains",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
        "items",
        "unevaluatedItems",
        "unevaluatedProperties",
    }
)
_LIST = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_MAP = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)
DEFS = ("$defs", "definitions")
# Keywords the portable (draft-07) form cannot carry, by the dialect that may declare them.
_NO_DRAFT_07 = {
    "unevaluatedProperties": "has no draft-07 form",
    "unevaluatedItems": "has no draft-07 form",
    "$dynamicRef": "has no draft-07 form",
    "$dynamicAnchor": "has no draft-07 form",
    "$recursiveRef": "has no draft-07 form",
    "$recursiveAnchor": "has no draft-07 form",
    "dependentSchemas": "has no draft-07 form",
    "minContains": "has no draft-07 form",
    "maxContains": "has no draft-07 form",
    "$anchor": "is not supported: refer to definitions by JSON pointer",
}
_ONLY_2020 = frozenset({"prefixItems", "dependentRequired"})
_ONLY_DRAFT_07 = frozenset({"dependencies", "additionalItems"})
# What may stand beside a $ref in the portable form, where draft-07 ignores a $ref's siblings.
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly"}
    | {"$comment"}
)


class SchemaProblem(Exception):
    """A schema refused at declaration: what, and the JSON pointer where."""

    def __init__(self, pointer: str, what: str) -> None:
        super().__init__(f"{what} at {pointer}")
        self.pointer = pointer
        self.what = what


def pointer(segments: tuple[str, ...]) -> str:
    """``("properties", "a/b")`` → ``#/properties/a~1b``."""
    return "#" + "".join("/" + s.replace("~", "~0").replace("/", "~1") for s in segments)


def _ref(segments: tuple[str, ...]) -> str:
    return "#" + "".join(
        "/" + quote(s.replace("~", "~0").replace("/", "~1"), safe="$") for s in segments
    )


def _segments(fragment: str) -> tuple[str, ...]:
    """A URI fragment (``/a/b~1c``, percent-encoded or not) as pointer segments."""
    text = unquote(fragment)
    if not text:
        return ()
    return tuple(s.replace("~1", "/").replace("~0", "~") for s in text[1:].split("/"))


def children(node: Mapping[str, Any]) -> Iterator[tuple[tuple[str, ...], Any]]:
    """The subschemas directly under ``node``, each with its path from ``node``."""
    for key, value in node.items():
        if key in _MAP and isinstance(value, Mapping):
            for name, sub in value.items():
                if isinstance(sub, Mapping | bool):
                    yield (key, name), sub
        elif key in _LIST and isinstance(value, list):
            for i, sub in enumerate(value):
                yield (key, str(i)), sub
        elif key in _ONE and isinstance(value, Mapping | bool):
            yield (key,), value


def walk(node: Any, at: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], JSONObject]]:
    """Every (sub)schema that is an object, with its path, ``node`` first."""
    if isinstance(node, Mapping):
        yield at, node  # type: ignore[misc]
        for path, sub in children(node):
            yield from walk(sub, at + path)


def resolve(schema: Any, segments: tuple[str, ...]) -> Any:
    node = schema
    for s in segments:
        if isinstance(node, Mapping) and s in node:
            node = node[s]
        elif isinstance(node, list) and s.isdigit() and int(s) < len(node):
            node = node[int(s)]
        else:
            raise KeyError(s)
    return node


# --- reading ---------------------------------------------------------------------------------


def read_json(path: Path) -> Any:
    """A schema file's JSON: a regular file (a device or a FIFO would never end), at most
    ``MAX_SCHEMA_BYTES``."""
    try:
        if path.exists() and not path.is_file():
            raise SchemaProblem(str(path), "is not a regular file")
        with path.open("rb") as file:
            data = file.read(MAX_SCHEMA_BYTES + 1)
    except OSError as exc:
        raise SchemaProblem(str(path), f"cannot be read ({exc.strerror})") from None
    if len(data) > MAX_SCHEMA_BYTES:
        raise SchemaProblem(str(path), f"is larger than {MAX_SCHEMA_BYTES} bytes")
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError as exc:
        raise SchemaProblem(str(path), f"is not JSON ({exc})") from None


def dialect(schema: Mapping[str, Any]) -> Dialect:
    """The schema's dialect by its ``$schema``: draft-07 or 2020-12 (none: 2020-12)."""
    declared = schema.get("$schema")
    if declared is None:
        return "2020-12"
    found = _DIALECTS.get(str(declared).rstrip("#")) if isinstance(declared, str) else None
    if found is None:
        raise SchemaProblem(
            "#/$schema", f"names {declared!r}; a catalog takes draft-07 or 2020-12 schemas"
        )
    return found


# --- bundling relative file references -------------------------------------------------------


class _Bundler:
    """Copies each file a ``$ref`` names into the root's definitions, once, rewriting the
    references (the root's and the files') to point there. Only files in ``folder`` (the root
    schema's) or below are read: a schema is published, the files beside it are not all."""

    def __init__(self, root: JSONObject, defs: str, kind: Dialect, folder: Path | None) -> None:
        self.root = root
        self.folder = folder.resolve() if folder is not None else None
        self.defs = defs
        self.kind = kind
        self.placed: dict[Path, str] = {}
        self.taken = set(root.get(defs, {}))
        self.added: dict[str, JSONObject] = {}

    def rewrite(self, doc: Any, base: Path | None, prefix: tuple[str, ...]) -> None:
        for at, node in walk(doc):
            ref = node.get("$ref")
            if isinstance(ref, str):
                node["$ref"] = self._target(ref, base, prefix, prefix + at)

    def _target(
        self, ref: str, base: Path | None, prefix: tuple[str, ...], at: tuple[str, ...]
    ) -> str:
        where = pointer(at)
        parts = urlsplit(ref)
        if parts.scheme or ref.startswith("//"):
            raise SchemaProblem(
                where,
                f"a remote $ref ({ref!r}) is never fetched: copy that schema beside this one "
                "and refer to it by a relative path",
            )
        path, _, fragment = ref.partition("#")
        if fragment and not fragment.startswith("/"):
            raise SchemaProblem(where, f"$ref {ref!r} names an anchor: use a JSON pointer")
        if not path:
            return _ref(prefix + _segments(fragment)) if prefix else ref
        if base is None or self.folder is None:
            raise SchemaProblem(where, f"$ref {ref!r} names a file, but the schema has no folder")
        if Path(unquote(path)).is_absolute():
            raise SchemaProblem(
                where, f"$ref {ref!r} is absolute: name a file relative to this one"
            )
        file = (base / unquote(path)).resolve()
        if not file.is_relative_to(self.folder):
            raise SchemaProblem(where, f"$ref {ref!r} leaves the schema's folder ({self.folder})")
        name = self._place(file, where)
        return _ref((self.defs, name, *_segments(fragment)))

    def _place(self, file: Path, where: str) -> str:
        if file in self.placed:
            return self.placed[file]
        try:
            doc = read_json(file)
        except SchemaProblem as exc:
            raise SchemaProblem(where, f"{file} {exc.what}") from None
        if not isinstance(doc, dict):
            raise SchemaProblem(where, f"{file} holds no JSON object")
        try:
            kind = dialect(doc)
        except SchemaProblem as exc:
            raise SchemaProblem(where, f"{file}: {exc.what}") from None
        if "$schema" in doc and kind != self.kind:
            raise SchemaProblem(where, f"{file} is {kind}, the schema referring to it is not")
        doc.pop("$schema", None)
        doc.pop("$id", None)
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", file.stem) or "schema"
        name, n = stem, 1
        while name in self.taken:
            n += 1
            name = f"{stem}_{n}"
        self.taken.add(name)
        self.placed[file] = name
        self.added[name] = doc
        self.rewrite(doc, file.parent, (self.defs, name))
        return name


def bundle(schema: Mapping[str, Any], base: Path | None, kind: Dialect) -> JSONObject:
    """A copy of ``schema`` with every relative file reference read (from ``base``, the root
    schema's folder, or below it) into its definitions; remote references refused."""
    root: JSONObject = copy.deepcopy(dict(schema))
    defs = "$defs" if kind == "2020-12" else "definitions"
    bundler = _Bundler(root, defs, kind, base)
    bundler.rewrite(root, base, ())
    if bundler.added:
        root[defs] = {**root.get(defs, {}), **bundler.added}
    return root


# --- what the portable form can say ----------------------------------------------------------


def check(schema: Mapping[str, Any], kind: Dialect) -> None:
    """Refuse what the portable form cannot carry, or carry with the same meaning."""
    for at, node in walk(schema):
        where = pointer(at)
        for key in node:
            if key in _NO_DRAFT_07:
                raise SchemaProblem(pointer((*at, key)), f"{key} {_NO_DRAFT_07[key]}")
            if key in (_ONLY_2020 if kind == "draft-07" else _ONLY_DRAFT_07):
                raise SchemaProblem(pointer((*at, key)), f"{key} is not a {kind} keyword")
        if at and "$id" in node:
            raise SchemaProblem(where, "a nested $id is not supported")
        if kind == "2020-12" and isinstance(node.get("items"), list):
            raise SchemaProblem(where, "items is a list: 2020-12 says prefixItems")
        ref = node.get("$ref")
        if "$ref" in node:
            _check_ref(schema, ref, where)


def _check_ref(schema: Mapping[str, Any], ref: Any, where: str) -> None:
    if not isinstance(ref, str) or not ref.startswith("#/"):
        raise SchemaProblem(where, f"$ref {ref!r} is not a JSON pointer into this schema")
    segments = _segments(ref[1:])
    if not any(s in DEFS for s in segments):
        raise SchemaProblem(where, f"$ref {ref!r} points outside $defs/definitions")
    try:
        resolve(schema, segments)
    except KeyError:
        raise SchemaProblem(where, f"$ref {ref!r} points at nothing") from None


# --- the portable (draft-07) form ------------------------------------------------------------


def definition_names(schema: Mapping[str, Any]) -> dict[tuple[str, ...], str]:
    """Each definition of ``schema``, wherever it sits, and its name once hoisted: its own key,
    or the key and a number where two share one (the shallowest keeps the plain key)."""
    found = [
        ((*at, defs, key), key)
        for at, node in walk(schema)
        for defs in DEFS
        if isinstance(node.get(defs), Mapping)
        for key in node[defs]
    ]
    found.sort(key=lambda item: (len(item[0]), item[0]))
    names: dict[tuple[str, ...], str] = {}
    taken: set[str] = set()
    for path, key in found:
        name, n = key, 1
        while name in taken:
            n += 1
            name = f"{key}_{n}"
        taken.add(name)
        names[path] = name
    return names


def portable(schema: Mapping[str, Any], kind: Dialect) -> tuple[JSONObject, JSONObject]:
    """The draft-07 form of a checked, bundled schema and its hoisted definitions: no
    ``$defs``/``definitions`` inside, no ``$schema``; each reference to a definition written
    ``#/definitions/<name>``; ``prefixItems`` as a list of ``items`` (and ``additionalItems``),
    ``dependentRequired`` as ``dependencies``, a ``$ref`` with assertions beside it (which
    draft-07 would ignore) under ``allOf``."""
    names = definition_names(schema)
    convert = _Converter(names, kind)
    top = convert(schema, root=True)
    assert isinstance(top, dict)
    defs = {names[path]: convert(resolve(schema, path)) for path in names}
    return top, dict(sorted(defs.items()))


class _Converter:
    def __init__(self, names: dict[tuple[str, ...], str], kind: Dialect) -> None:
        self.names = names
        self.kind = kind

    def __call__(self, node: Any, *, root: bool = False) -> Any:
        if not isinstance(node, Mapping):
            return copy.deepcopy(node)
        out: JSONObject = {}
        for key, value in node.items():
            if key in DEFS or (root and key in ("$schema", "$id")):
                continue
            if key == "$ref":
                out[key] = self.ref(value)
            elif key in _MAP and isinstance(value, Mapping):
                out[key] = {k: self(v) for k, v in value.items()}
            elif key in _LIST and isinstance(value, list):
                out[key] = [self(v) for v in value]
            elif key in _ONE:
                out[key] = self(value)
            else:
                out[key] = copy.deepcopy(value)
        return self._draft_07(out) if self.kind == "2020-12" else out

    def _draft_07(self, out: JSONObject) -> JSONObject:
        if "prefixItems" in out:
            prefix = out.pop("prefixItems")
            if "items" in out:
                out["additionalItems"] = out.pop("items")
            out["items"] = prefix
        if "dependentRequired" in out:
            out["dependencies"] = out.pop("dependentRequired")
        if "$ref" in out and set(out) - _ANNOTATIONS - {"$ref"}:
            ref = {"$ref": out.pop("$ref")}
            out["allOf"] = [ref, *out.get("allOf", [])]
        return out

    def ref(self, ref: str) -> str:
        segments = _segments(ref[1:])
        for cut in range(len(segments), 0, -1):
            name = self.names.get(segments[:cut])
            if name is not None:
                rest = tuple("items" if s == "prefixItems" else s for s in segments[cut:])
                return _ref(("definitions", name, *rest))
        raise AssertionError(f"unchecked $ref {ref!r}")  # check() refuses it first
