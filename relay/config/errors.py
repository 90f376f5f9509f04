"""Configuration errors people can act on: each bad key named, with what to write, and no
input echoed that could hold a secret."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from relay.obs import scrub

# Inputs echoed in an error ("got …"): short scalars of settings that cannot hold a secret.
_ECHO_MAX_CHARS = 40


def echoable_fields(models: Iterable[type[BaseModel]]) -> frozenset[str]:
    """The names of settings whose values may be echoed: none that names a secret."""
    names = {f.alias or n for m in models for n, f in m.model_fields.items()}
    return frozenset(n for n in names if not scrub.SECRET_KEY.search(n))


def _shown(err: Any, loc: tuple[Any, ...], echoable: frozenset[str]) -> str:
    """`` (got …)`` for an input that is safe to echo, else nothing: only a short scalar of a
    setting that cannot hold a secret, never a table, a list, a dict key's value (destination
    or header names) or anything under a secret-bearing key."""
    if err["type"] in ("missing", "extra_forbidden") or not loc:
        return ""
    last = loc[-1]
    if not isinstance(last, str) or last not in echoable:
        return ""
    if any(scrub.SECRET_KEY.search(str(p)) for p in loc):
        return ""
    got = err.get("input")
    if isinstance(got, bool | int | float) or (
        isinstance(got, str) and len(got) <= _ECHO_MAX_CHARS and got.isprintable()
    ):
        return f" (got {got!r})"
    return ""


def _message(err: Any, loc: str, kinds: Sequence[str]) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown key (check its spelling and section)"
    if kind == "missing":
        if loc == "database_url":
            return "required (set database_url in the file or OUTBOX_DATABASE_URL)"
        return "required"
    if loc == "destinations" and kind == "dict_type":
        return (
            "must be a table of destinations: write one [destinations.NAME] table per "
            "destination (not [[destinations]], which makes a list)"
        )
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return "must be a table: [section] or key = { … } (not [[…]], which makes a list)"
    if kind == "union_tag_not_found":
        return f"needs kind = {_kinds(kinds, ' or kind = ')}"
    if kind == "union_tag_invalid":
        tag = (err.get("ctx") or {}).get("tag")
        got = (
            f" (got {tag!r})"
            if isinstance(tag, str) and len(tag) <= _ECHO_MAX_CHARS and tag.isprintable()
            else ""
        )
        return f"kind must be {_kinds(kinds, ' or ')}{got}"
    error = (err.get("ctx") or {}).get("error")
    if kind == "value_error" and error is not None:
        return str(error)  # our validators' own words, without pydantic's "Value error, "
    msg: str = err["msg"]
    return msg


def _kinds(kinds: Sequence[str], between: str) -> str:
    return between.join(f'"{k}"' for k in kinds)


def _key(part: object) -> str:
    # A destination's or a header's name is any TOML key: one a terminal would act on (an
    # escape sequence, a newline that starts a line of its own) is shown quoted and escaped.
    name = str(part)
    return name if name.isprintable() else repr(name)


def format_errors(exc: ValidationError, echoable: frozenset[str], kinds: Sequence[str]) -> str:
    """One line per error: the key, what is wrong, and the input where it is safe to show.
    ``echoable`` (see :func:`echoable_fields`) and ``kinds`` (the kinds of destination) come
    from the models that validated."""
    lines = []
    for err in exc.errors():
        parts = tuple(p for p in err["loc"] if not str(p).startswith("function-after"))
        loc = ".".join(_key(p) for p in parts)
        loc = loc.replace("schema_", "schema") or "(top level)"
        msg = _message(err, loc, kinds)
        got = err.get("input")
        shown = "" if isinstance(got, str) and got and got in msg else _shown(err, parts, echoable)
        lines.append(f"  {loc}: {msg}{shown}")
    return "\n".join(lines)
